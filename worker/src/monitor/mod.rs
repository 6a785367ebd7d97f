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

/// One record as one line, in one write: a reader never sees part of a line, and a crash can
/// tear only the last one.
fn write_record(out: &mut impl Write, v: &serde_json::Value) -> std::io::Result<()> {
    let mut line = v.to_string();
    line.push('\n');
    out.write_all(line.as_bytes())
}

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
        Metrics::start(path, "")
    }

    /// Replaces the file at `path` with `kept` (atomically, and only if it is a regular file)
    /// and appends to it from there.
    fn start(path: &Path, kept: &str) -> Result<Metrics> {
        crate::files::write_atomically(path, kept.as_bytes())?;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(path)
            .map_err(|e| Error::Runtime(format!("{}: {e}", path.display())))?;
        Ok(Metrics { path: path.to_path_buf(), file, events: None })
    }

    /// Also writes TensorBoard events into `dir` (a new event file per run or resume).
    pub fn with_tensorboard(mut self, dir: &Path) -> Result<Metrics> {
        self.events = Some(tensorboard::EventWriter::create(dir)?);
        Ok(self)
    }

    /// Continues a run resumed after update `step`: the file is first cut back to it, so that
    /// no step appears twice: lines of later steps (written before the run stopped, and about to
    /// be redone) are dropped, and so is a line a crash tore (it does not parse).
    pub fn resume(path: &Path, step: u64) -> Result<Metrics> {
        let old = match crate::files::read_input(path) {
            Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(crate::files::io_error(path, e)),
        };
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
        Metrics::start(path, &kept)
    }

    fn line(&mut self, v: serde_json::Value) -> Result<()> {
        write_record(&mut self.file, &v).map_err(|e| Error::Runtime(format!("{}: {e}", self.path.display())))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Records each `write` call it gets.
    #[derive(Default)]
    struct Writes(Vec<Vec<u8>>);

    impl Write for Writes {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.push(buf.to_vec());
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// A line written in pieces interleaves with another writer's and tears where a crash
    /// stops it; each record must reach the file in one write.
    #[test]
    fn a_record_is_one_write_of_one_whole_line() {
        let mut out = Writes::default();
        let v = serde_json::json!({"step": 7, "loss": 2.5, "lr": 0.001, "scalars": {"a": 1.0}});
        write_record(&mut out, &v).unwrap();
        assert_eq!(out.0, vec![format!("{v}\n").into_bytes()]);
    }
}
