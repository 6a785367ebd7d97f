//! Checkpoints: `checkpoint_<step>/` holding `manifest.json` (step, data position, layout,
//! settings, per-file checksums), `manifest.sum` (the manifest's own checksum) and one
//! `rank_<r>.safetensors` per rank that has something to keep (weights and optimizer
//! state). A checkpoint is written under a temporary name and
//! renamed, by rank 0, once every rank's file is complete, so a directory named
//! `checkpoint_<step>` is always whole; only the newest `keep` are kept.
//!
//! Each rank writes only what it holds: a pipeline stage its weights, a ZeRO shard its pieces
//! of the optimizer state, named `<tensor>@<first element>` (a 1-D run of the flattened tensor),
//! a tensor-parallel rank its slices of the split weights and their state, named
//! `<tensor>#tp<rank>` (how each weight is split is in the manifest's `tensorSplits`).
//! Loading reads every rank's file and joins the pieces, then the slices, so a checkpoint
//! resumes under any layout (another data-parallel or tensor-parallel size, ZeRO or not, other
//! pipeline stages).

pub mod keys;
pub mod safetensors;

use crate::comm::{Collective, HostGroup, ProcessGroup};
use crate::data::Position;
use crate::error::{Error, Result};
use crate::parallel::tensor::TensorSplit;
use crate::tensor::Tensor;
use keys::{weight_of_key, SHARED_KEYS, SLICE_MARK};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The parallel layout a checkpoint was written under.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct LayoutRecord {
    pub data: usize,
    pub tensor: usize,
    pub pipeline: usize,
    pub zero: u8,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    pub format: String,
    /// Weight updates done.
    pub step: u64,
    pub data: Position,
    pub seed: u64,
    pub world_size: usize,
    /// The layout that wrote it (absent in checkpoints from before layouts were recorded).
    #[serde(default)]
    pub layout: LayoutRecord,
    /// The configuration that trained it (export rebuilds the model from it).
    pub config: crate::config::TrainingConfig,
    /// File name → FNV-1a 64 checksum (hex) of its bytes.
    pub files: BTreeMap<String, String>,
    /// How each weight that tensor parallelism split is divided (the slices `<name>#tp<r>`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tensor_splits: BTreeMap<String, TensorSplit>,
}

/// The manifest format this worker writes: v2 with the manifest's own checksum beside it.
pub const FORMAT: &str = "tensorfleet-checkpoint-v3";

/// The format before `manifest.sum`, still read: its manifest is checked only for consistency.
const FORMAT_V2: &str = "tensorfleet-checkpoint-v2";

/// Beside `manifest.json`: `<checksum>  manifest.json`, sha256sum's line format holding FNV-1a
/// 64 (`checksum`), not a SHA-256.
const MANIFEST_SUM: &str = "manifest.sum";

/// The manifest's own consistency: a format this worker reads, and a `worldSize` that agrees
/// with the layout that wrote it and with the rank files it lists. (Another world size than
/// this run's is fine: loading reshards.)
fn check_manifest(m: &Manifest) -> Result<(), String> {
    if m.format != FORMAT && m.format != FORMAT_V2 {
        return Err(format!("format '{}' is not one this worker reads ({FORMAT}, {FORMAT_V2})", m.format));
    }
    let l = &m.layout;
    // A layout of zeros: written before layouts were recorded.
    let ranks = l.data.checked_mul(l.tensor).and_then(|n| n.checked_mul(l.pipeline));
    if *l != LayoutRecord::default() && ranks != Some(m.world_size) {
        return Err(format!(
            "worldSize {} does not match its layout (data {} × tensor {} × pipeline {})",
            m.world_size, l.data, l.tensor, l.pipeline
        ));
    }
    if !m.files.contains_key("rank_0.safetensors") {
        return Err("files does not list rank_0.safetensors, which rank 0 always writes".into());
    }
    for file in m.files.keys() {
        let rank: Option<usize> =
            file.strip_prefix("rank_").and_then(|f| f.strip_suffix(".safetensors")).and_then(|r| r.parse().ok());
        match rank {
            Some(r) if r < m.world_size => {}
            Some(_) => return Err(format!("files lists {file}, but worldSize is {}", m.world_size)),
            None => return Err(format!("files lists {file}, which is not a rank file (rank_<r>.safetensors)")),
        }
    }
    Ok(())
}

/// The manifest's bytes against `manifest.sum` (None: a checkpoint written before it, whose
/// format the caller then requires to be v2).
fn check_manifest_sum(text: &[u8], sum: Option<&[u8]>) -> Result<(), String> {
    let Some(line) = sum else { return Ok(()) };
    let want = std::str::from_utf8(line)
        .ok()
        .and_then(|l| l.trim_end().strip_suffix("  manifest.json"))
        .ok_or_else(|| format!("{MANIFEST_SUM}: not a line '<checksum>  manifest.json'"))?;
    match checksum(text) {
        got if got == want => Ok(()),
        got => Err(format!("manifest.json: its checksum {got} does not match {MANIFEST_SUM} ({want})")),
    }
}

/// FNV-1a, 64-bit, in hex: cheap and enough to notice a torn or damaged file.
pub fn checksum(bytes: &[u8]) -> String {
    format!("{:016x}", checksum_u64(bytes))
}

fn checksum_u64(bytes: &[u8]) -> u64 {
    use std::hash::Hasher;
    let mut h = fnv::FnvHasher::default();
    h.write(bytes);
    h.finish()
}

fn io(path: &Path, e: std::io::Error) -> Error {
    Error::Runtime(format!("{}: {e}", path.display()))
}

/// Writes checkpoint `step` into `dir` and prunes old ones; returns its path. Every rank of
/// `world` calls it at the same step with its own `tensors` (`Session::state`) and the same
/// `splits` (`Session::tensor_splits`); a rank whose tensors hold nothing but what every rank
/// holds (`optimizer/step`, the loss scale: a data-parallel replica without ZeRO) writes no file.
#[allow(clippy::too_many_arguments)]
pub fn save(
    dir: &Path,
    step: u64,
    data: Position,
    config: &crate::config::TrainingConfig,
    tensors: &BTreeMap<String, Tensor>,
    splits: &BTreeMap<String, TensorSplit>,
    keep: usize,
    world: &HostGroup,
) -> Result<PathBuf> {
    let rank = world.rank();
    let final_dir = dir.join(format!("checkpoint_{step}"));
    let tmp = dir.join(format!(".checkpoint_{step}.tmp"));
    if rank == 0 {
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
        }
        std::fs::create_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
    }
    world.barrier()?;
    let file = format!("rank_{rank}.safetensors");
    // (wrote a file, checksum's high and low 32 bits): exact in f64, so one all-gather
    // tells rank 0 every file's checksum.
    let mut mine = [0f64; 3];
    let own = tensors.keys().any(|k| !SHARED_KEYS.contains(&k.as_str()));
    if rank == 0 || own {
        let bytes = safetensors::encode(tensors);
        write_synced(&tmp.join(&file), &bytes)?;
        let sum = checksum_u64(&bytes);
        mine = [1.0, (sum >> 32) as f64, (sum & 0xffff_ffff) as f64];
    }
    let mut all = vec![0f64; 3 * world.size()];
    world.all_gather(&mine[..], &mut all[..])?;
    if rank == 0 {
        let files = all
            .chunks(3)
            .enumerate()
            .filter(|(_, c)| c[0] == 1.0)
            .map(|(r, c)| (format!("rank_{r}.safetensors"), format!("{:016x}", ((c[1] as u64) << 32) | c[2] as u64)))
            .collect();
        let p = &config.parallelism;
        let manifest = Manifest {
            format: FORMAT.into(),
            step,
            data,
            seed: config.seed,
            world_size: world.size(),
            layout: LayoutRecord { data: p.data, tensor: p.tensor, pipeline: p.pipeline, zero: p.zero },
            config: config.clone(),
            files,
            tensor_splits: splits.clone(),
        };
        let text = serde_json::to_vec_pretty(&manifest).map_err(|e| Error::Runtime(e.to_string()))?;
        write_synced(&tmp.join("manifest.json"), &text)?;
        write_synced(&tmp.join(MANIFEST_SUM), format!("{}  manifest.json\n", checksum(&text)).as_bytes())?;
        if final_dir.exists() {
            std::fs::remove_dir_all(&final_dir).map_err(|e| io(&final_dir, e))?;
        }
        std::fs::rename(&tmp, &final_dir).map_err(|e| io(&final_dir, e))?;
        if let Ok(d) = std::fs::File::open(dir) {
            d.sync_all().ok();
        }
        prune(dir, keep)?;
    }
    // When save returns, on any rank, the checkpoint is complete.
    world.barrier()?;
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

/// Reads and verifies a checkpoint: its manifest (`check_manifest`), each rank file against its
/// checksum and the strict safetensors reader, and every rank's tensors joined into one
/// state (pieces `<name>@<start>` joined into a flat `<name>`).
pub fn load(dir: &Path) -> Result<(Manifest, BTreeMap<String, Tensor>)> {
    let corrupt = |what: String| Error::Corrupt(format!("checkpoint {}: {what}", dir.display()));
    let text =
        crate::files::read_input(&dir.join("manifest.json")).map_err(|e| corrupt(format!("manifest.json: {e}")))?;
    let sum = match crate::files::read_input(&dir.join(MANIFEST_SUM)) {
        Ok(line) => Some(line),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(corrupt(format!("{MANIFEST_SUM}: {e}"))),
    };
    check_manifest_sum(&text, sum.as_deref()).map_err(corrupt)?;
    let m: Manifest = serde_json::from_slice(&text).map_err(|e| corrupt(format!("manifest.json: {e}")))?;
    check_manifest(&m).map_err(|e| corrupt(format!("manifest.json: {e}")))?;
    if m.format == FORMAT && sum.is_none() {
        return Err(corrupt(format!("{MANIFEST_SUM} is missing; every {FORMAT} checkpoint has one")));
    }
    let mut whole = BTreeMap::new();
    let mut pieces: BTreeMap<String, Vec<(usize, Tensor, String)>> = BTreeMap::new();
    for (file, sum) in &m.files {
        let bytes = crate::files::read_input(&dir.join(file)).map_err(|e| corrupt(format!("{file}: {e}")))?;
        if *sum != checksum(&bytes) {
            return Err(corrupt(format!("{file}: the checksum does not match the manifest")));
        }
        for (name, t) in safetensors::decode(&bytes).map_err(|e| corrupt(format!("{file}: {e}")))? {
            match name.rsplit_once('@').and_then(|(base, start)| Some((base, start.parse::<usize>().ok()?))) {
                Some((base, start)) => pieces.entry(base.to_string()).or_default().push((start, t, file.clone())),
                None => {
                    whole.insert(name, t);
                }
            }
        }
    }
    for (name, mut parts) in pieces {
        parts.sort_by_key(|p| p.0);
        let mut flat: Vec<f32> = Vec::new();
        for (start, t, file) in &parts {
            if *start != flat.len() {
                return Err(corrupt(format!(
                    "'{name}': the piece in {file} starts at element {start}, but the pieces before it end at {}",
                    flat.len()
                )));
            }
            if t.dtype() != crate::tensor::DType::F32 {
                return Err(corrupt(format!("'{name}@{start}' in {file} is {}, not f32", t.dtype())));
            }
            flat.extend_from_slice(t.as_slice::<f32>());
        }
        whole.insert(name, Tensor::from_vec(&[flat.len()], flat));
    }
    join_slices(&m, &mut whole).map_err(|e| corrupt(e.to_string()))?;
    Ok((m, whole))
}

/// Replaces the tensor-parallel ranks' slices `<key>#tp<r>` with the whole `<key>`.
fn join_slices(m: &Manifest, state: &mut BTreeMap<String, Tensor>) -> Result<()> {
    let keys: Vec<String> = state.keys().filter(|k| k.contains(SLICE_MARK)).cloned().collect();
    let mut slices: BTreeMap<String, BTreeMap<usize, Tensor>> = BTreeMap::new();
    for key in keys {
        let t = state.remove(&key).expect("listed above");
        let (base, rank) = key.rsplit_once(SLICE_MARK).expect("listed above");
        let rank = rank.parse::<usize>().map_err(|_| Error::Corrupt(format!("'{key}': not a slice name")))?;
        slices.entry(base.to_string()).or_default().insert(rank, t);
    }
    let size = m.layout.tensor.max(1);
    for (base, parts) in slices {
        let split = weight_of_key(&base).and_then(|w| m.tensor_splits.get(w)).ok_or_else(|| {
            Error::Corrupt(format!("'{base}' is written in slices, but the manifest's tensorSplits does not say how"))
        })?;
        if parts.len() != size || parts.keys().copied().ne(0..size) {
            return Err(Error::Corrupt(format!(
                "'{base}': slices of tensor-parallel ranks {:?} are here; the layout has {size}",
                parts.keys().collect::<Vec<_>>()
            )));
        }
        let parts: Vec<Tensor> = parts.into_values().collect();
        state.insert(base.clone(), split.join(&parts).map_err(|e| Error::Corrupt(format!("'{base}': {e}")))?);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    /// The checksums are FNV-1a 64 as checkpoints have always been written: the published test
    /// vectors hold, so earlier checkpoints still verify.
    #[test]
    fn checksums_are_fnv1a_64() {
        assert_eq!(super::checksum(b""), "cbf29ce484222325");
        assert_eq!(super::checksum(b"a"), "af63dc4c8601ec8c");
        assert_eq!(super::checksum(b"foobar"), "85944171f73967e8");
    }
}
