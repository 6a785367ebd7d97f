//! `inspect`: what a checkpoint, ONNX model or data shard holds, and for a model the memory
//! its forward plan needs.

use crate::checkpoint;
use crate::data::{samples, tokens};
use crate::error::{Error, Result};
use crate::exec::plan::plan;
use crate::graph::infer::{bind, Bindings};
use crate::graph::onnx_io::from_model;
use crate::session::buffers::Role;
use std::collections::BTreeMap;
use std::path::Path;

fn mib(b: usize) -> String {
    format!("{:.2} MiB", b as f64 / (1 << 20) as f64)
}

pub fn inspect(path: &Path, dims: &[String]) -> Result<()> {
    if path.is_dir() && path.join("manifest.json").exists() {
        let (m, tensors) = checkpoint::load(path)?;
        println!("checkpoint {} (step {}, data epoch {} batch {})", path.display(), m.step, m.data.epoch, m.data.batch);
        let total: usize = tensors.values().map(|t| t.numel()).sum();
        println!("  {} tensors, {} elements", tensors.len(), total);
        for (name, t) in &tensors {
            println!("  {name:<40} {} {:?}", t.dtype(), t.shape());
        }
        return Ok(());
    }
    match path.extension().and_then(|e| e.to_str()) {
        Some("bin") => {
            let h = tokens::read_header(path)?;
            println!("token shard {}: {} tokens of {} bytes", path.display(), h.tokens, h.token_bytes);
            Ok(())
        }
        Some("pb") => {
            let s = samples::read_shard(path)?;
            println!("sample shard {}: {} samples", path.display(), s.len());
            if let Some(first) = s.first() {
                for (name, t) in first {
                    println!("  {name}: {} {:?}", t.dtype(), t.shape());
                }
            }
            Ok(())
        }
        _ => inspect_model(path, dims),
    }
}

fn inspect_model(path: &Path, dims: &[String]) -> Result<()> {
    let proto = crate::onnx::load_model(path)?;
    let g = from_model(&proto, &path.display().to_string())?;
    println!("model {} (opset {}, {} nodes)", path.display(), g.opset, g.nodes.len());
    let mut ops: BTreeMap<&str, usize> = BTreeMap::new();
    for n in &g.nodes {
        *ops.entry(n.op.onnx_name().0).or_default() += 1;
    }
    println!("  ops: {}", ops.iter().map(|(k, v)| format!("{k}×{v}")).collect::<Vec<_>>().join(", "));
    // What training would do with each float initializer (docs/MODELS.md): parameters train,
    // running statistics and other buffers do not.
    let roles = crate::session::buffers::roles(&g);
    let count = |role: Role| -> (usize, usize) {
        let of_role: Vec<_> = roles.iter().filter(|(_, r)| **r == role).map(|(v, _)| *v).collect();
        (of_role.len(), of_role.iter().map(|v| g.initializers[v].numel()).sum())
    };
    let ((p, params), (s, stats), (c, consts)) =
        (count(Role::Parameter), count(Role::RunningStatistic), count(Role::Constant));
    println!(
        "  {} float initializers: {p} parameters ({params} values), {s} running statistics ({stats} values), {c} \
         buffers and constants ({consts} values)",
        roles.len()
    );
    for d in &g.inputs {
        println!("  input  {}: {} {:?}", g.name_of(d.value), d.dtype, d.dims);
    }
    for &o in &g.outputs {
        println!("  output {}", g.name_of(o));
    }
    let mut b = Bindings::default();
    for d in dims {
        let (k, v) = d.split_once('=').ok_or_else(|| Error::Config(format!("--dim {d}: expected NAME=SIZE")))?;
        let v: usize = v.parse().map_err(|_| Error::Config(format!("--dim {d}: '{v}' is not a size")))?;
        b.dims.insert(k.to_string(), v);
    }
    match bind(&g, &b, false) {
        Ok(bound) => {
            let p = plan(&bound, &[], |_| 0);
            println!(
                "  planned peak memory (forward): {} transient + {} weights (a GPU's kernel scratch not counted)",
                mib(p.arena_bytes),
                mib(p.persistent_bytes)
            );
        }
        Err(e) => println!("  no memory plan: {e} (give --dim NAME=SIZE)"),
    }
    Ok(())
}
