//! The worker's modules form layers: no module of `src/` imports, through another, one that
//! imports it back (docs/ARCHITECTURE.md draws the layers). A cycle fails this test, which
//! names each import of the cycle with the files that make it. Test code (`tests.rs` files and
//! `#[cfg(test)] mod tests` blocks) may reach across layers and is not counted.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// module → module it imports → the files that import it.
type Imports = BTreeMap<String, BTreeMap<String, BTreeSet<String>>>;

#[test]
fn the_worker_has_no_import_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let imports = imports_of(&src);
    assert!(imports.len() > 20, "read only {} modules from {}", imports.len(), src.display());
    let cycles = cycles(&imports);
    let report: Vec<String> = cycles.iter().map(|c| describe(c, &imports)).collect();
    assert!(report.is_empty(), "import cycles in worker/src:\n{}", report.join("\n"));
}

#[test]
fn a_cycle_is_found_and_named() {
    let mut imports = Imports::new();
    let mut add = |from: &str, to: &str, file: &str| {
        imports.entry(from.into()).or_default().entry(to.into()).or_default().insert(file.into());
    };
    add("graph", "kernels", "graph/infer.rs");
    add("kernels", "op", "kernels/mod.rs");
    add("op", "graph", "op/mod.rs");
    add("session", "graph", "session/mod.rs");
    let found = cycles(&imports);
    assert_eq!(found, [vec!["graph".to_string(), "kernels".into(), "op".into()]]);
    let text = describe(&found[0], &imports);
    assert!(text.contains("op -> graph (op/mod.rs)"), "{text}");
}

/// The top-level modules of `src` (a folder or a file, not the crate roots) and what each
/// imports from the others, as `crate::<module>` paths in its non-test code.
fn imports_of(src: &Path) -> Imports {
    let modules: BTreeSet<String> = std::fs::read_dir(src)
        .expect("worker/src is readable")
        .map(|e| e.expect("a directory entry").path())
        .filter_map(|p| module_name(&p))
        .collect();
    let mut imports = Imports::new();
    for module in &modules {
        imports.entry(module.clone()).or_default();
        let (dir, file) = (src.join(module), src.join(format!("{module}.rs")));
        let files = if dir.is_dir() { rust_files(&dir) } else { vec![file] };
        for path in files {
            let text = std::fs::read_to_string(&path).expect("a source file is readable");
            let shown = path.strip_prefix(src).unwrap_or(&path).display().to_string();
            for target in crate_paths(&non_test_code(&text)) {
                if target != *module && modules.contains(&target) {
                    imports.entry(module.clone()).or_default().entry(target).or_default().insert(shown.clone());
                }
            }
        }
    }
    imports
}

fn module_name(path: &Path) -> Option<String> {
    let name = path.file_name()?.to_str()?;
    if path.is_dir() {
        return Some(name.to_string());
    }
    let stem = name.strip_suffix(".rs")?;
    (stem != "lib" && stem != "main").then(|| stem.to_string())
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).expect("a module folder is readable") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            out.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") && path.file_name().is_some_and(|n| n != "tests.rs") {
            out.push(path);
        }
    }
    out
}

/// The file without its unit tests and line comments (doc links name modules without
/// importing them).
fn non_test_code(text: &str) -> String {
    let code = text.split("#[cfg(test)]\nmod tests").next().unwrap_or(text);
    code.lines().map(|line| line.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n")
}

/// The first segment of every `crate::` path: `crate::a::b` and `crate::{a::b, c}` give a and c.
fn crate_paths(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (at, _) in code.match_indices("crate::") {
        let rest = &code[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            out.extend(group_heads(group));
        } else {
            out.push(ident(rest));
        }
    }
    out
}

/// The first identifier of each item of a `{...}` use group (nested groups skipped).
fn group_heads(group: &str) -> Vec<String> {
    let (mut heads, mut depth, mut at_item) = (Vec::new(), 0, true);
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            ',' if depth == 0 => at_item = true,
            c if at_item && (c.is_alphanumeric() || c == '_') => {
                heads.push(ident(&group[i..]));
                at_item = false;
            }
            _ => {}
        }
    }
    heads
}

fn ident(s: &str) -> String {
    s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect()
}

/// Every set of modules that import each other round (strongly connected, more than one),
/// each sorted, in order.
fn cycles(imports: &Imports) -> Vec<Vec<String>> {
    // Two modules share a cycle when each reaches the other.
    let reach = |from: &str| {
        let (mut seen, mut todo) = (BTreeSet::new(), vec![from.to_string()]);
        while let Some(m) = todo.pop() {
            for next in imports.get(&m).into_iter().flat_map(|t| t.keys()) {
                if seen.insert(next.clone()) {
                    todo.push(next.clone());
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<&String, BTreeSet<String>> = imports.keys().map(|m| (m, reach(m))).collect();
    let mut found: Vec<Vec<String>> = Vec::new();
    for (m, reached) in &reaches {
        let group: Vec<String> =
            reached.iter().filter(|o| reaches.get(o).is_some_and(|r| r.contains(*m))).cloned().collect();
        if group.len() > 1 && !found.contains(&group) {
            found.push(group);
        }
    }
    found
}

/// A cycle's modules and the imports between them, with the files that make each.
fn describe(cycle: &[String], imports: &Imports) -> String {
    let mut text = format!("  {}:", cycle.join(", "));
    for from in cycle {
        for (to, files) in &imports[from] {
            if cycle.contains(to) {
                let files: Vec<&str> = files.iter().map(String::as_str).collect();
                text.push_str(&format!("\n    {from} -> {to} ({})", files.join(", ")));
            }
        }
    }
    text
}
