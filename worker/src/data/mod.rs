//! Training data: llm.c token shards and ONNX Runtime sample shards, read into batches of
//! named tensors, in a seeded order whose position can be saved and restored; training reads
//! them on a thread of its own, ahead of the step (`prefetch`).

pub mod prefetch;
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
    /// Refuses a label outside `range` anywhere in the data, naming its shard and place (exit
    /// 3), before a kernel meets it mid-run. Token data is checked against the vocabulary as it
    /// is read instead.
    fn check_labels(&self, _range: &LabelRange) -> Result<()> {
        Ok(())
    }
}

/// The classes a label input may name: `0..classes`, and `ignore` (a loss's ignore_index).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LabelRange {
    pub input: String,
    pub classes: usize,
    pub ignore: Option<i64>,
}

impl LabelRange {
    pub fn admits(&self, label: i64) -> bool {
        Some(label) == self.ignore || (0..self.classes as i64).contains(&label)
    }
}

/// How a loader names what it produces.
#[derive(Clone, Debug, Default)]
pub struct Feeds {
    /// Token data: the input the token ids feed, and the label input the next tokens feed.
    pub token_input: String,
    pub token_label: String,
    /// The rows of the embedding the token ids index, where the model says: a token at or past
    /// it is refused as it is read, naming its shard and offset.
    pub vocab: Option<usize>,
}

/// Shard files of a source: the file itself, or every file with `ext` in the directory,
/// sorted by name. A missing path, an empty directory, or a shard that is not a regular file
/// (a FIFO would block its reader) is a configuration error.
pub fn shard_files(path: &Path, ext: &str, key: &str) -> Result<Vec<PathBuf>> {
    let regular =
        |p: &Path| crate::files::open_input(p).map_err(|e| Error::Config(format!("{key}: {}: {e}", p.display())));
    if !path.is_dir() {
        regular(path)?;
        return Ok(vec![path.to_path_buf()]);
    }
    let rd = std::fs::read_dir(path).map_err(|e| Error::Config(format!("{key}: {}: {e}", path.display())))?;
    let mut files: Vec<PathBuf> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().and_then(|x| x.to_str()) == Some(ext))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(Error::Config(format!("{key}: {} holds no *.{ext} shards", path.display())));
    }
    for f in &files {
        regular(f)?;
    }
    Ok(files)
}

/// The share of the data one data-parallel rank reads: every global batch holds `count`
/// rank batches, and rank `index` takes the `index`-th. So the ranks of one step together see
/// exactly the samples a single process would see with a batch `count` times larger, which is
/// what makes data parallelism equal to large-batch training.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Partition {
    pub index: usize,
    pub count: usize,
}

impl Partition {
    /// All of the data: a single data-parallel rank.
    pub const WHOLE: Partition = Partition { index: 0, count: 1 };
}

/// How a loader cuts its data into batches.
#[derive(Clone, Copy, Debug)]
pub struct Batching {
    /// Samples (token sequences) per batch of this rank.
    pub batch: usize,
    /// Sequence length of token data (unused for sample shards).
    pub seq_len: usize,
    /// Visit the data in a seeded permutation, a new one each epoch.
    pub shuffle: bool,
    pub seed: u64,
    pub partition: Partition,
}

impl Batching {
    /// Samples per global batch, over all data-parallel ranks.
    pub fn global_batch(&self) -> usize {
        self.batch * self.partition.count
    }
}

/// Opens the loader for a source; `key` names the source's configuration key in messages.
pub fn open(src: &DataSource, key: &str, batching: Batching, feeds: &Feeds) -> Result<Box<dyn Loader>> {
    Ok(match src.format {
        DataFormat::Tokens => Box::new(tokens::TokenLoader::open(&src.path, key, batching, feeds)?),
        DataFormat::OnnxSamples => Box::new(samples::SampleLoader::open(&src.path, key, batching)?),
    })
}
