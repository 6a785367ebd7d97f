//! The kernels, compiled at run time by NVRTC for the GPU at hand and loaded once per device.
//!
//! One program holds every kernel file (`kernels/*.cu` after `kernels/common.cuh`); it is
//! compiled to PTX for the device's compute capability, once per process and capability, and
//! the driver JIT-compiles the PTX (and caches the result in its own compute cache).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// The program's source: the shared prelude, then each family of kernels.
pub const SOURCE_FILES: [(&str, &str); 9] = [
    ("common.cuh", include_str!("kernels/common.cuh")),
    ("elementwise.cu", include_str!("kernels/elementwise.cu")),
    ("rows.cu", include_str!("kernels/rows.cu")),
    ("window.cu", include_str!("kernels/window.cu")),
    ("channels.cu", include_str!("kernels/channels.cu")),
    ("shard.cu", include_str!("kernels/shard.cu")),
    ("attention.cu", include_str!("kernels/attention.cu")),
    ("attention_mma.cu", include_str!("kernels/attention_mma.cu")),
    ("optim.cu", include_str!("kernels/optim.cu")),
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

/// Compiles the program for compute capability `major.minor` (`compute_90` on an H100); Err
/// carries NVRTC's log. Precise division and square roots, no flush-to-zero: the kernels
/// are checked against the CPU backend's results.
pub fn compile(major: i32, minor: i32) -> Result<Arc<cudarc::nvrtc::Ptx>, String> {
    type ByCapability = HashMap<(i32, i32), Arc<cudarc::nvrtc::Ptx>>;
    static CACHE: OnceLock<Mutex<ByCapability>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(ptx) = cache.lock().unwrap().get(&(major, minor)) {
        return Ok(ptx.clone());
    }
    let opts = cudarc::nvrtc::CompileOptions {
        options: vec![format!("--gpu-architecture=compute_{major}{minor}"), "--std=c++17".into()],
        name: Some("tensorfleet_kernels.cu".into()),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(source(), opts).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => {
            format!("NVRTC could not compile the CUDA kernels:\n{}", log.to_string_lossy())
        }
        other => format!("NVRTC failed: {other:?}"),
    })?;
    let ptx = Arc::new(ptx);
    cache.lock().unwrap().insert((major, minor), ptx.clone());
    Ok(ptx)
}
