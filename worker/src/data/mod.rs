//! Training data: llm.c token shards and ONNX Runtime sample shards, read into batches of
//! named tensors, in a seeded order whose position can be saved and restored.

pub mod samples;
pub mod tokens;

use crate::config::{DataFormat, DataSource};
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// One micro-batch: graph input name → tensor.
pub type Batch = BTreeMap<String, Tensor>;

/// Where a loader is in its data: enough to continue exactly there.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Position {
    pub epoch: u64,
    /// Batches taken in this epoch.
    pub batch: u64,
}

pub trait Loader: Send {
    /// The next batch (wrapping into a new epoch at the end of the data).
    fn next_batch(&mut self) -> Result<Batch>;
    fn position(&self) -> Position;
    /// Continues from a saved position.
    fn seek(&mut self, p: &Position) -> Result<()>;
    /// Tokens or samples per batch, for throughput.
    fn items_per_batch(&self) -> usize;
}

/// How a loader names what it produces.
#[derive(Clone, Debug)]
pub struct Feeds {
    /// Token data: the input the token ids feed, and the label input the next tokens feed.
    pub token_input: String,
    pub token_label: String,
}

/// Shard files of a source: the file itself, or every file with `ext` in the directory,
/// sorted by name. A missing path or an empty directory is a configuration error.
pub fn shard_files(path: &Path, ext: &str, key: &str) -> Result<Vec<PathBuf>> {
    if path.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    let rd = std::fs::read_dir(path).map_err(|e| Error::Config(format!("{key}: {}: {e}", path.display())))?;
    let mut files: Vec<PathBuf> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().and_then(|x| x.to_str()) == Some(ext))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(Error::Config(format!("{key}: {} holds no *.{ext} shards", path.display())));
    }
    Ok(files)
}

/// Opens the loader for a source. `batch` samples per batch; `seq_len` for token data.
pub fn open(
    src: &DataSource,
    key: &str,
    batch: usize,
    seq_len: usize,
    feeds: &Feeds,
    shuffle: bool,
    seed: u64,
) -> Result<Box<dyn Loader>> {
    Ok(match src.format {
        DataFormat::Tokens => {
            Box::new(tokens::TokenLoader::open(&src.path, key, batch, seq_len, feeds, shuffle, seed)?)
        }
        DataFormat::OnnxSamples => Box::new(samples::SampleLoader::open(&src.path, key, batch, shuffle, seed)?),
    })
}
