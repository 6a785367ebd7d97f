//! Checkpoints: `checkpoint_<step>/` holding `manifest.json` (step, data position, settings,
//! per-file checksums) and `rank_<r>.safetensors` (weights and optimizer state). A checkpoint is
//! written under a temporary name and renamed when complete, so a directory named
//! `checkpoint_<step>` is always whole; only the newest `keep` are kept.

pub mod safetensors;

use crate::data::Position;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    pub format: String,
    /// Weight updates done.
    pub step: u64,
    pub data: Position,
    pub seed: u64,
    pub world_size: usize,
    /// The configuration that trained it (export rebuilds the model from it).
    pub config: crate::config::TrainingConfig,
    /// File name → FNV-1a 64 checksum (hex) of its bytes.
    pub files: BTreeMap<String, String>,
}

/// FNV-1a, 64-bit: cheap and enough to notice a torn or damaged file.
pub fn checksum(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

fn io(path: &Path, e: std::io::Error) -> Error {
    Error::Runtime(format!("{}: {e}", path.display()))
}

/// Writes checkpoint `step` of rank 0 into `dir` and prunes old ones; returns its path.
pub fn save(
    dir: &Path,
    step: u64,
    data: Position,
    config: &crate::config::TrainingConfig,
    tensors: &BTreeMap<String, Tensor>,
    keep: usize,
) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let final_dir = dir.join(format!("checkpoint_{step}"));
    let tmp = dir.join(format!(".checkpoint_{step}.tmp"));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
    let bytes = safetensors::encode(tensors);
    let file = "rank_0.safetensors".to_string();
    write_synced(&tmp.join(&file), &bytes)?;
    let manifest = Manifest {
        format: "tensorfleet-checkpoint-v1".into(),
        step,
        data,
        seed: config.seed,
        // Data-parallel replicas hold the same state, which rank 0 writes.
        world_size: config.parallelism.data * config.parallelism.tensor * config.parallelism.pipeline,
        config: config.clone(),
        files: [(file, checksum(&bytes))].into_iter().collect(),
    };
    let text = serde_json::to_vec_pretty(&manifest).map_err(|e| Error::Runtime(e.to_string()))?;
    write_synced(&tmp.join("manifest.json"), &text)?;
    if final_dir.exists() {
        std::fs::remove_dir_all(&final_dir).map_err(|e| io(&final_dir, e))?;
    }
    std::fs::rename(&tmp, &final_dir).map_err(|e| io(&final_dir, e))?;
    if let Ok(d) = std::fs::File::open(dir) {
        d.sync_all().ok();
    }
    prune(dir, keep)?;
    Ok(final_dir)
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(path).map_err(|e| io(path, e))?;
    f.write_all(bytes).map_err(|e| io(path, e))?;
    f.sync_all().map_err(|e| io(path, e))
}

/// Complete checkpoints in `dir`, oldest first.
pub fn list(dir: &Path) -> Vec<(u64, PathBuf)> {
    let mut v: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let step = name.strip_prefix("checkpoint_")?.parse().ok()?;
            Some((step, e.path()))
        })
        .collect();
    v.sort();
    v
}

fn prune(dir: &Path, keep: usize) -> Result<()> {
    let all = list(dir);
    for (_, p) in all.iter().take(all.len().saturating_sub(keep.max(1))) {
        std::fs::remove_dir_all(p).map_err(|e| io(p, e))?;
    }
    Ok(())
}

/// Reads and verifies a checkpoint: its manifest and rank 0's tensors.
pub fn load(dir: &Path) -> Result<(Manifest, BTreeMap<String, Tensor>)> {
    let corrupt = |what: String| Error::Corrupt(format!("checkpoint {}: {what}", dir.display()));
    let text = std::fs::read(dir.join("manifest.json")).map_err(|e| corrupt(format!("manifest.json: {e}")))?;
    let m: Manifest = serde_json::from_slice(&text).map_err(|e| corrupt(format!("manifest.json: {e}")))?;
    let file = "rank_0.safetensors";
    let bytes = std::fs::read(dir.join(file)).map_err(|e| corrupt(format!("{file}: {e}")))?;
    if m.files.get(file) != Some(&checksum(&bytes)) {
        return Err(corrupt(format!("{file}: the checksum does not match the manifest")));
    }
    let tensors = safetensors::decode(&bytes).map_err(|e| corrupt(format!("{file}: {e}")))?;
    Ok((m, tensors))
}
