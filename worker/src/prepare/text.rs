//! `prepare-data`: text files → GPT-2 BPE token shards (llm.c's format), split into `train/`
//! and `val/`. Each file is one document, preceded by the end-of-text token as GPT-2's
//! training data was.

use crate::data::tokens::write_shard;
use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

/// GPT-2's `<|endoftext|>`.
pub const END_OF_TEXT: u16 = 50256;
/// Tokens per shard file (llm.c's default shard size).
pub const SHARD_TOKENS: usize = 100_000_000;

fn write_split(dir: &Path, prefix: &str, tokens: &[u16]) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).map_err(|e| Error::Runtime(format!("{}: {e}", dir.display())))?;
    let mut files = Vec::new();
    for (i, chunk) in tokens.chunks(SHARD_TOKENS).enumerate() {
        let p = dir.join(format!("{prefix}_{i:06}.bin"));
        write_shard(&p, chunk)?;
        files.push(p);
    }
    Ok(files)
}

/// What `prepare_text` tokenizes with, and where the text is.
#[derive(Clone, Debug)]
pub struct TextOptions {
    /// `gpt2` or the path of a tokenizer.json.
    pub tokenizer: String,
    /// The JSON field or Parquet column of each document's text.
    pub text_field: String,
    pub val_fraction: f64,
}

pub fn prepare_text(inputs: &[PathBuf], output: &Path, opts: &TextOptions) -> Result<()> {
    let val_fraction = opts.val_fraction;
    let bpe = tiktoken_rs::r50k_base().map_err(|e| Error::Runtime(format!("loading the GPT-2 BPE: {e}")))?;
    let mut tokens: Vec<u16> = Vec::new();
    for (i, path) in inputs.iter().enumerate() {
        let text =
            std::fs::read_to_string(path).map_err(|e| Error::Config(format!("--input {}: {e}", path.display())))?;
        tokens.push(END_OF_TEXT);
        // GPT-2's vocabulary (50257) fits in u16, as llm.c's shards assume.
        tokens.extend(bpe.encode_ordinary(&text).into_iter().map(|t| t as u16));
        eprintln!(
            "[{}/{}] {}: {} bytes, {} tokens so far",
            i + 1,
            inputs.len(),
            path.display(),
            text.len(),
            tokens.len()
        );
    }
    let n_val = ((tokens.len() as f64) * val_fraction).round() as usize;
    let (val, train) = tokens.split_at(n_val);
    let t = write_split(&output.join("train"), "train", train)?;
    println!("train: {} tokens in {} shard(s) under {}", train.len(), t.len(), output.join("train").display());
    if !val.is_empty() {
        let v = write_split(&output.join("val"), "val", val)?;
        println!("val:   {} tokens in {} shard(s) under {}", val.len(), v.len(), output.join("val").display());
    }
    Ok(())
}
