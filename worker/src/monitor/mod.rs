//! Training telemetry: `metrics.jsonl` (one JSON object per logged step or evaluation) and,
//! when enabled, the same scalars as TensorBoard events under `output.dir/tensorboard/`, and
//! the live `/progress` and `/metrics` endpoint (`endpoint`).

pub mod endpoint;
pub mod profile;
pub mod tensorboard;

use crate::error::{Error, Result};
use std::io::Write;
use std::path::{Path, PathBuf};

pub struct Metrics {
    path: PathBuf,
    file: std::fs::File,
    events: Option<tensorboard::EventWriter>,
}

impl Metrics {
    /// Starts a fresh metrics file.
    pub fn create(path: &Path) -> Result<Metrics> {
        let file = std::fs::File::create(path).map_err(|e| Error::Runtime(format!("{}: {e}", path.display())))?;
        Ok(Metrics { path: path.to_path_buf(), file, events: None })
    }

    /// Also writes TensorBoard events into `dir` (a new event file per run or resume).
    pub fn with_tensorboard(mut self, dir: &Path) -> Result<Metrics> {
        self.events = Some(tensorboard::EventWriter::create(dir)?);
        Ok(self)
    }

    /// Continues a run resumed after update `step`: lines of later steps (written before the
    /// run stopped, and about to be redone) are dropped.
    pub fn resume(path: &Path, step: u64) -> Result<Metrics> {
        let old = std::fs::read_to_string(path).unwrap_or_default();
        let kept: String = old
            .lines()
            .filter(|l| {
                serde_json::from_str::<serde_json::Value>(l)
                    .ok()
                    .and_then(|v| v.get("step").and_then(|s| s.as_u64()))
                    .is_some_and(|s| s <= step)
            })
            .map(|l| format!("{l}\n"))
            .collect();
        std::fs::write(path, kept).map_err(|e| Error::Runtime(format!("{}: {e}", path.display())))?;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(path)
            .map_err(|e| Error::Runtime(format!("{}: {e}", path.display())))?;
        Ok(Metrics { path: path.to_path_buf(), file, events: None })
    }

    fn line(&mut self, v: serde_json::Value) -> Result<()> {
        writeln!(self.file, "{v}").map_err(|e| Error::Runtime(format!("{}: {e}", self.path.display())))
    }

    /// `step` counts weight updates from 1; `loss` is that update's forward loss.
    pub fn step(
        &mut self,
        step: u64,
        loss: f64,
        lr: f64,
        grad_norm: f64,
        items_per_sec: f64,
        elapsed_sec: f64,
    ) -> Result<()> {
        if let Some(ev) = &mut self.events {
            let scalars = [
                ("train/loss", loss),
                ("train/lr", lr),
                ("train/grad_norm", grad_norm),
                ("train/items_per_sec", items_per_sec),
            ];
            ev.scalars(step, &scalars)?;
        }
        self.line(serde_json::json!({
            "step": step, "loss": loss, "lr": lr, "gradNorm": grad_norm,
            "itemsPerSec": items_per_sec, "elapsedSec": elapsed_sec,
        }))
    }

    pub fn eval(&mut self, step: u64, eval_loss: f64) -> Result<()> {
        if let Some(ev) = &mut self.events {
            ev.scalars(step, &[("eval/loss", eval_loss)])?;
        }
        self.line(serde_json::json!({"step": step, "evalLoss": eval_loss}))
    }
}
