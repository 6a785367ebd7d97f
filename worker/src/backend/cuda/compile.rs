//! The kernels, compiled at run time by NVRTC for the GPU at hand and loaded once per device.
//!
//! One program holds every kernel file (`kernels/*.cu` after `kernels/common.cuh`); it is
//! compiled to PTX for the device's compute capability, once per capability: per process, and
//! on disk for the processes after (`CACHE_ENV`); the driver JIT-compiles the PTX (and caches
//! the result in its own compute cache).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

/// The program's source: the shared prelude, then each family of kernels.
pub const SOURCE_FILES: [(&str, &str); 11] = [
    ("common.cuh", include_str!("kernels/common.cuh")),
    ("elementwise.cu", include_str!("kernels/elementwise.cu")),
    ("rows.cu", include_str!("kernels/rows.cu")),
    ("window.cu", include_str!("kernels/window.cu")),
    ("channels.cu", include_str!("kernels/channels.cu")),
    ("shard.cu", include_str!("kernels/shard.cu")),
    ("attention.cu", include_str!("kernels/attention.cu")),
    ("attention_mma.cu", include_str!("kernels/attention_mma.cu")),
    ("optim.cu", include_str!("kernels/optim.cu")),
    ("product.cu", include_str!("kernels/product.cu")),
    ("resize.cu", include_str!("kernels/resize.cu")),
];

pub fn source() -> String {
    let mut s = String::new();
    for (name, text) in SOURCE_FILES {
        s.push_str(&format!("// ---- {name} ----\n"));
        s.push_str(text);
        s.push('\n');
    }
    s
}

/// Each kernel's name and its parameters' declared types (`const float*`, `i64`, `Dims`, ...),
/// in order, read from the program (`extern "C" __global__ void name(type name, ...)`).
pub fn declarations() -> Vec<(String, Vec<String>)> {
    let marker = "extern \"C\" __global__ void ";
    let src = source();
    src.match_indices(marker)
        .filter_map(|(at, _)| {
            let rest = &src[at + marker.len()..];
            let (open, close) = (rest.find('(')?, rest.find(')')?);
            let types = rest[open + 1..close]
                .split(',')
                .map(|p| {
                    let p = p.trim();
                    // The type is all but the last word; a pointer's `*` stays with the type.
                    let (ty, _name) = p.rsplit_once(|c: char| c.is_whitespace() || c == '*').unwrap_or((p, ""));
                    let star = if p[ty.len()..].trim_start().starts_with('*') { "*" } else { "" };
                    format!("{}{star}", ty.trim())
                })
                .collect();
            Some((rest[..open].trim().to_string(), types))
        })
        .collect()
}

pub fn kernel_names() -> Vec<String> {
    declarations().into_iter().map(|(name, _)| name).collect()
}

/// Where compiled PTX outlives the process: this variable's directory, else
/// `$XDG_CACHE_HOME/tensorfleet/kernels`, else `~/.cache/tensorfleet/kernels`. Every rank of
/// every job on a node then skips NVRTC (seconds) once one has compiled the program (CuPy's
/// kernel cache does the same); `off` turns it off. A directory that cannot be written is
/// passed over with a debug message.
pub const CACHE_ENV: &str = "TENSORFLEET_KERNEL_CACHE";

/// The kernel cache's directory ([`CACHE_ENV`]); None when it is off or no home is known.
pub fn cache_dir() -> Option<PathBuf> {
    match std::env::var_os(CACHE_ENV) {
        Some(v) if v == "off" => None,
        Some(v) if !v.is_empty() => Some(PathBuf::from(v)),
        _ => std::env::var_os("XDG_CACHE_HOME")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache")))
            .map(|base| base.join("tensorfleet").join("kernels")),
    }
}

/// Compiles the program for compute capability `major.minor` (`compute_90` on an H100); Err
/// carries NVRTC's log. Precise division and square roots, no flush-to-zero: the kernels
/// are checked against the CPU backend's results. Kept per process and capability, and in
/// [`cache_dir`] between processes.
pub fn compile(major: i32, minor: i32) -> Result<Arc<cudarc::nvrtc::Ptx>, String> {
    type ByCapability = HashMap<(i32, i32), Arc<cudarc::nvrtc::Ptx>>;
    static CACHE: OnceLock<Mutex<ByCapability>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(ptx) = cache.lock().unwrap().get(&(major, minor)) {
        return Ok(ptx.clone());
    }
    let ptx = Arc::new(compile_in(cache_dir().as_deref(), major, minor)?);
    cache.lock().unwrap().insert((major, minor), ptx.clone());
    Ok(ptx)
}

/// The PTX for `major.minor`: read from `dir` when an earlier process left it there, else
/// compiled by NVRTC and left there (written under a temporary name and renamed, so that ranks
/// starting together never read half a file).
pub fn compile_in(dir: Option<&Path>, major: i32, minor: i32) -> Result<cudarc::nvrtc::Ptx, String> {
    let options = vec![format!("--gpu-architecture=compute_{major}{minor}"), "--std=c++17".to_string()];
    let source = source();
    let file = dir.map(|d| d.join(cache_name(&source, &options)));
    if let Some(text) = file.as_ref().and_then(|f| std::fs::read_to_string(f).ok()) {
        // A file cut short, or not of this program, is compiled again and replaced.
        let entries = kernel_names().iter().all(|name| text.contains(&format!(".entry {name}(")));
        if text.ends_with(COMPLETE) && entries {
            return Ok(cudarc::nvrtc::Ptx::from_src(text));
        }
        tracing::warn!(file = %file.as_ref().map_or(String::new(), |f| f.display().to_string()),
            "the kernel cache's file is incomplete; compiling the kernels again");
    }
    let opts =
        cudarc::nvrtc::CompileOptions { options, name: Some("tensorfleet_kernels.cu".into()), ..Default::default() };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(&source, opts).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => {
            format!("NVRTC could not compile the CUDA kernels:\n{}", log.to_string_lossy())
        }
        other => format!("NVRTC failed: {other:?}"),
    })?;
    if let Some(file) = &file {
        if let Err(e) = keep(file, &(ptx.to_src() + COMPLETE)) {
            tracing::debug!(file = %file.display(), "kernel cache not written: {e}");
        }
    }
    Ok(ptx)
}

/// The last line of a cache file, written with it: a file without it was cut short.
const COMPLETE: &str = "\n// tensorfleet: complete\n";

/// The cache file's name: a hash of everything the PTX depends on (the source, the options,
/// NVRTC's version), then the architecture for whoever lists the directory.
fn cache_name(source: &str, options: &[String]) -> String {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-parameters; NVRTC is loaded (the probe checked it) or this returns an error
    // code and leaves them 0, which only makes the key less specific.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    // FNV-1a: stable across Rust versions, unlike std's hasher.
    use std::hash::Hasher;
    let mut h = fnv::FnvHasher::default();
    let nvrtc = format!("nvrtc {major}.{minor}");
    for part in [source, &options.join(" "), &nvrtc] {
        h.write(part.as_bytes());
        h.write_u8(0);
    }
    let arch = options[0].trim_start_matches("--gpu-architecture=");
    format!("{:016x}-{arch}.ptx", h.finish())
}

/// Writes `text` to `file` by way of a temporary file of its own (created exclusively, named by
/// process, time and thread: processes of different containers may share a pid and a cache), so
/// that a reader sees the whole file or none.
fn keep(file: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    let dir = file.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let thread = format!("{:?}", std::thread::current().id());
    let unique: String = thread.chars().filter(char::is_ascii_digit).collect();
    let name = file.file_name().unwrap_or_default().to_string_lossy();
    let tmp = dir.join(format!(".{name}.{}.{nanos}.{unique}", std::process::id()));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .and_then(|mut f| f.write_all(text.as_bytes()).and_then(|()| f.sync_all()));
    match written.and_then(|()| std::fs::rename(&tmp, file)) {
        Ok(()) => Ok(()),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}
