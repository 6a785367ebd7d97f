//! Training telemetry: `metrics.jsonl` (one JSON object per logged step or evaluation) and,
//! when enabled, the same scalars as TensorBoard events under `output.dir/tensorboard/`, and
//! the live `/progress` and `/metrics` endpoint (`endpoint`).

pub mod console;
pub mod endpoint;
pub mod profile;
pub mod tensorboard;

use crate::error::{Error, Result};
use std::io::Write;
use std::path::{Path, PathBuf};

/// What one logged weight update reports.
pub struct StepLog<'a> {
    /// The weight update, counting from 1.
    pub step: u64,
    /// That update's forward loss, before the update.
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    /// Tokens (token data) or samples per second, over all data-parallel ranks.
    pub items_per_sec: f64,
    pub elapsed_sec: f64,
    /// Model FLOPs utilization, when the device's peak is known.
    pub mfu: Option<f64>,
    /// The fp16 loss scale the step ran with, when one is used.
    pub loss_scale: Option<f64>,
    /// Steps skipped so far because their gradients overflowed (fp16), this one included.
    pub skipped_steps: Option<u64>,
    /// This step's gradients overflowed: no update.
    pub skipped: bool,
    /// Values of the training graph named by logging.scalars.
    pub graph_scalars: &'a [(String, f64)],
}

/// A weight whose histogram or norm is logged, with its gradient of the step.
pub struct Watched {
    pub name: String,
    pub value: crate::tensor::Tensor,
    pub grad: crate::tensor::Tensor,
    pub histogram: bool,
    pub norm: bool,
}

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

    /// One logged weight update: `metrics.jsonl` gets a line, TensorBoard the scalars.
    pub fn step(&mut self, s: &StepLog) -> Result<()> {
        if let Some(ev) = &mut self.events {
            let mut scalars: Vec<(String, f64)> = [
                ("train/loss", Some(s.loss)),
                ("train/lr", Some(s.lr)),
                ("train/grad_norm", Some(s.grad_norm)),
                ("train/items_per_sec", Some(s.items_per_sec)),
                ("train/loss_scale", s.loss_scale),
                ("train/skipped_steps", s.skipped_steps.map(|n| n as f64)),
                ("train/mfu", s.mfu),
            ]
            .into_iter()
            .filter_map(|(tag, v)| v.map(|v| (tag.to_string(), v)))
            .collect();
            scalars.extend(s.graph_scalars.iter().map(|(name, v)| (format!("scalars/{name}"), *v)));
            let refs: Vec<(&str, f64)> = scalars.iter().map(|(t, v)| (t.as_str(), *v)).collect();
            ev.scalars(s.step, &refs)?;
        }
        let mut line = serde_json::json!({
            "step": s.step, "loss": s.loss, "lr": s.lr, "gradNorm": s.grad_norm,
            "itemsPerSec": s.items_per_sec, "elapsedSec": s.elapsed_sec,
        });
        if let Some(m) = s.mfu {
            line["mfu"] = m.into();
        }
        if let Some(ls) = s.loss_scale {
            line["lossScale"] = ls.into();
        }
        if let Some(n) = s.skipped_steps {
            line["skippedSteps"] = n.into();
        }
        if s.skipped {
            line["skipped"] = true.into();
        }
        if !s.graph_scalars.is_empty() {
            line["scalars"] = s.graph_scalars.iter().map(|(name, v)| (name.clone(), serde_json::json!(v))).collect();
        }
        self.line(line)
    }

    /// Histograms and L2 norms of watched weights and their gradients (TensorBoard only):
    /// `weights/<name>` and `gradients/<name>` histograms, `norms/...` scalars.
    pub fn weights(&mut self, step: u64, watched: &[Watched]) -> Result<()> {
        let Some(ev) = &mut self.events else { return Ok(()) };
        let l2 = |v: &[f32]| v.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
        let mut hist: Vec<(String, &[f32])> = Vec::new();
        let mut norms: Vec<(String, f64)> = Vec::new();
        for w in watched {
            let (value, grad) = (w.value.as_slice::<f32>(), w.grad.as_slice::<f32>());
            if w.histogram {
                hist.push((format!("weights/{}", w.name), value));
                hist.push((format!("gradients/{}", w.name), grad));
            }
            if w.norm {
                norms.push((format!("norms/weights/{}", w.name), l2(value)));
                norms.push((format!("norms/gradients/{}", w.name), l2(grad)));
            }
        }
        if !hist.is_empty() {
            ev.histograms(step, &hist)?;
        }
        if !norms.is_empty() {
            let refs: Vec<(&str, f64)> = norms.iter().map(|(t, v)| (t.as_str(), *v)).collect();
            ev.scalars(step, &refs)?;
        }
        Ok(())
    }

    pub fn eval(&mut self, step: u64, eval_loss: f64) -> Result<()> {
        if let Some(ev) = &mut self.events {
            ev.scalars(step, &[("eval/loss", eval_loss)])?;
        }
        self.line(serde_json::json!({"step": step, "evalLoss": eval_loss}))
    }
}
