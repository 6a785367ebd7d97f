//! `prepare-data`: what users bring, turned into the shards training reads, split into `train/`
//! and `val/` under the output folder:
//! - text (`text.rs`): plain text files, JSON Lines or Parquet, tokenized by GPT-2's BPE or a
//!   Hugging Face `tokenizer.json` into llm.c's token shards;
//! - images (`images.rs`): a folder in torchvision's ImageFolder layout (a subfolder per class)
//!   into onnxSamples shards of image tensors and their class labels.

pub mod images;
pub mod text;

pub use images::{prepare_images, ImageOptions};
pub use text::{prepare_text, TextOptions};

use crate::error::{Error, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::path::Path;

/// A progress bar on stderr over `len` units of `unit` (bytes, rows, images); drawn only where
/// stderr is a terminal, as `train`'s is.
pub(crate) fn progress(len: u64, unit: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    let template = match unit {
        "bytes" => "{wide_bar} {bytes}/{total_bytes} ({bytes_per_sec}, {eta} left) {msg}".to_string(),
        _ => format!("{{wide_bar}} {{pos}}/{{len}} {unit} ({{per_sec}}, {{eta}} left) {{msg}}"),
    };
    bar.set_style(ProgressStyle::with_template(&template).expect("a valid template"));
    bar
}

/// Runs a third-party decoder that panics on some damaged inputs instead of returning an error
/// (tests/fuzz.rs found two: parquet 60.1 asserts that the metadata's column offsets are not
/// negative, tokenizers 0.23 unwraps a decoder entry it cannot read), so that such an input is
/// refused as any damaged one is: exit 3 naming it, not a crash. The library's own panic message
/// still reaches stderr first (the panic hook is the process's).
pub(crate) fn refusing_panics<T>(subject: &str, decode: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(decode)).unwrap_or_else(|payload| {
        let why = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "no message".into());
        Err(Error::Corrupt(format!("{subject}: its decoder gave up on it ({why}): the file is damaged")))
    })
}

/// Removes the shards `dir/{prefix}_NNNNNN.{extension}` numbered `from` or later that an earlier
/// run left, which the loader would otherwise read beside this run's (another tokenizer's ids,
/// another image size).
pub(crate) fn remove_stale_shards(dir: &Path, prefix: &str, extension: &str, from: usize) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Ok(()) };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let number = name.strip_prefix(&format!("{prefix}_")).and_then(|n| n.strip_suffix(&format!(".{extension}")));
        if number.and_then(|n| n.parse::<usize>().ok()).is_some_and(|n| n >= from) {
            let path = entry.path();
            std::fs::remove_file(&path)
                .map_err(|e| Error::Runtime(format!("removing the stale shard {}: {e}", path.display())))?;
        }
    }
    Ok(())
}
