//! The training runner, after ONNX Runtime's TrainingRunner: configure → initialize the device
//! → load the model and data → train loop (update, log, evaluate, checkpoint) → export.

use crate::backend::cpu::CpuBackend;
use crate::checkpoint;
use crate::config::{DeviceKind, ModelConfig, OptimizerName, Precision, TrainingConfig};
use crate::data::{self, Batch, Feeds};
use crate::error::{Error, Result};
use crate::graph::ir::Dim;
use crate::models::{self, Model};
use crate::monitor::endpoint::Endpoint;
use crate::monitor::profile::Trace;
use crate::monitor::Metrics;
use crate::optim::{schedule::learning_rate, Update};
use crate::session::{Session, SessionOptions};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

/// Where a run's outputs went.
#[derive(Debug)]
pub struct Summary {
    /// The update the run started from (0, or the resumed checkpoint's step).
    pub start_step: u64,
    pub steps: u64,
    pub first_loss: f64,
    pub final_loss: f64,
    pub metrics: PathBuf,
    pub checkpoints: Option<PathBuf>,
    pub model: PathBuf,
}

pub fn update_of(cfg: &TrainingConfig) -> Update {
    let o = &cfg.optimizer;
    match o.name {
        OptimizerName::Sgd => {
            Update::Sgd { momentum: o.momentum as f32, nesterov: o.nesterov, weight_decay: o.weight_decay as f32 }
        }
        OptimizerName::Adam | OptimizerName::Adamw => Update::Adam {
            beta1: o.beta1 as f32,
            beta2: o.beta2 as f32,
            epsilon: o.epsilon as f32,
            weight_decay: o.weight_decay as f32,
            decoupled: o.name == OptimizerName::Adamw,
        },
        OptimizerName::Lamb => Update::Lamb {
            beta1: o.beta1 as f32,
            beta2: o.beta2 as f32,
            epsilon: o.epsilon as f32,
            weight_decay: o.weight_decay as f32,
        },
    }
}

/// What feeds token data into this model, and the sequence length of its windows.
fn token_feeds(cfg: &TrainingConfig, model: &Model) -> Result<(Feeds, usize)> {
    let g = &model.graph;
    let kind = cfg.model.kind()?;
    let label = match kind {
        ModelConfig::Onnx(o) => o.loss.label.clone(),
        _ => "labels".into(),
    };
    let input =
        g.inputs.iter().find(|d| d.dtype == crate::tensor::DType::I64 && g.name_of(d.value) != label).ok_or_else(
            || Error::Config("data.train.format: token data needs an int64 input (token ids) in the model".into()),
        )?;
    let seq = match (kind, input.dims.get(1)) {
        (ModelConfig::Gpt2(c), _) => c.seq_len,
        (_, Some(Dim::Fixed(t))) => *t,
        (ModelConfig::Onnx(o), Some(Dim::Named(n))) => *o.dims.get(n).ok_or_else(|| {
            Error::Config(format!(
                "model.onnx.dims: give the size of '{n}' (the sequence length of input '{}')",
                g.name_of(input.value)
            ))
        })?,
        _ => {
            return Err(Error::Config(format!(
                "input '{}' must be [batch, sequence] for token data",
                g.name_of(input.value)
            )))
        }
    };
    Ok((Feeds { token_input: g.name_of(input.value).to_string(), token_label: label }, seq))
}

fn check_world(cfg: &TrainingConfig) -> Result<()> {
    let p = &cfg.parallelism;
    let world = p.data * p.tensor * p.pipeline;
    if world != 1 {
        return Err(Error::Config(format!(
            "parallelism: data×tensor×pipeline = {world}, but this process runs alone (world size 1); multi-rank training needs mpirun with {world} ranks and the MPI build"
        )));
    }
    if p.zero > 0 {
        return Err(Error::Config(
            "parallelism.zero: ZeRO shards over data-parallel ranks; it needs parallelism.data > 1".into(),
        ));
    }
    match cfg.device {
        DeviceKind::Cuda => {
            return Err(Error::Config(
                "device: cuda was asked for, but this worker has no CUDA backend; use device: cpu or auto".into(),
            ))
        }
        DeviceKind::Auto | DeviceKind::Cpu => {}
    }
    if cfg.precision != Precision::Fp32 {
        return Err(Error::Config(
            format!("precision: {:?} needs the CUDA backend; the CPU trains in fp32", cfg.precision).to_lowercase(),
        ));
    }
    Ok(())
}

/// A checkpoint's manifest, tensors and path.
type Restored = (checkpoint::Manifest, std::collections::BTreeMap<String, crate::tensor::Tensor>, PathBuf);

/// The checkpoint to continue from, as `checkpoint.resume` says.
fn find_resume(cfg: &TrainingConfig, dir: &std::path::Path) -> Result<Option<Restored>> {
    match cfg.checkpoint.resume.as_str() {
        "never" => Ok(None),
        "auto" => {
            for (_, path) in checkpoint::list(dir).into_iter().rev() {
                match checkpoint::load(&path) {
                    Ok((m, t)) => return Ok(Some((m, t, path))),
                    Err(e) => tracing::warn!(error = %e, "skipping a damaged checkpoint"),
                }
            }
            Ok(None)
        }
        explicit => {
            let path = PathBuf::from(explicit);
            if !path.exists() {
                return Err(Error::Config(format!("checkpoint.resume: {} does not exist", path.display())));
            }
            let (m, t) = checkpoint::load(&path)?;
            Ok(Some((m, t, path)))
        }
    }
}

/// Runs the whole training described by `cfg`. `quiet` silences the per-step console lines.
pub fn train(cfg: &TrainingConfig, quiet: bool) -> Result<Summary> {
    check_world(cfg)?;
    let backend = Arc::new(CpuBackend::new());
    let model = models::load(&cfg.model, cfg.seed)?;
    let (feeds, seq_len) = match cfg.data.train.format {
        crate::config::DataFormat::Tokens => token_feeds(cfg, &model)?,
        crate::config::DataFormat::OnnxSamples => (Feeds { token_input: String::new(), token_label: String::new() }, 0),
    };
    let mut train_data =
        data::open(&cfg.data.train, "data.train", cfg.batch_size, seq_len, &feeds, cfg.data.shuffle, cfg.seed)?;
    let mut eval_data = match &cfg.data.eval {
        Some(src) if cfg.evaluation.every > 0 => {
            Some(data::open(src, "data.eval", cfg.batch_size, seq_len, &feeds, false, cfg.seed)?)
        }
        _ => None,
    };
    let ckpt_dir = cfg.output.dir.join("checkpoints");
    let resumed = find_resume(cfg, &ckpt_dir)?;
    if let Some((manifest, _, path)) = &resumed {
        train_data.seek(&manifest.data)?;
        tracing::info!(path = %path.display(), step = manifest.step, "resuming");
    }
    let first: Batch = train_data.next_batch()?;
    let opts = SessionOptions {
        update: update_of(cfg),
        disabled_passes: vec![],
        frozen: cfg.frozen_weights.clone(),
        no_decay: cfg.optimizer.no_decay.clone(),
    };
    let t_build = Instant::now();
    let mut session = Session::new(backend.clone(), &model, &first, cfg.gradient_accumulation_steps, &opts)?;
    let (arena, persistent) = session.memory();
    tracing::info!(
        backend = %crate::backend::Backend::name(&*backend),
        arena_mib = arena as f64 / (1 << 20) as f64,
        weights_mib = persistent as f64 / (1 << 20) as f64,
        nodes = session.train.plan.steps.len(),
        build_ms = t_build.elapsed().as_millis() as u64,
        "training graph planned"
    );

    std::fs::create_dir_all(&cfg.output.dir)
        .map_err(|e| Error::Runtime(format!("output.dir {}: {e}", cfg.output.dir.display())))?;
    let metrics_path = cfg.output.dir.join("metrics.jsonl");
    let start_step = match &resumed {
        Some((manifest, tensors, path)) => {
            session.load_state(tensors, &format!("checkpoint {}", path.display()))?;
            manifest.step
        }
        None => 0,
    };
    let mut metrics =
        if resumed.is_some() { Metrics::resume(&metrics_path, start_step)? } else { Metrics::create(&metrics_path)? };
    if cfg.logging.tensorboard {
        metrics = metrics.with_tensorboard(&cfg.output.dir.join("tensorboard"))?;
    }
    let endpoint = match cfg.logging.port {
        0 => None,
        port => Some(Endpoint::serve(std::net::SocketAddr::from(([0, 0, 0, 0], port)), cfg.steps)?),
    };
    if let Some(ep) = &endpoint {
        ep.update(|r| r.step = start_step);
        tracing::info!(addr = %ep.addr, "serving /progress and /metrics");
    }
    let mut profiling = (cfg.profiling.from_step > 0).then(|| Trace::new(0));
    let mut pending = Some(first);
    let mut first_loss = f64::NAN;
    let mut last_loss = f64::NAN;
    let start = Instant::now();
    let items = train_data.items_per_batch() * cfg.gradient_accumulation_steps;
    for step in start_step..cfg.steps {
        let t0 = Instant::now();
        let mut batches = Vec::with_capacity(cfg.gradient_accumulation_steps);
        for _ in 0..cfg.gradient_accumulation_steps {
            batches.push(match pending.take() {
                Some(b) => b,
                None => train_data.next_batch()?,
            });
        }
        let lr = learning_rate(&cfg.lr_schedule, cfg.optimizer.lr, step, cfg.steps);
        let profiled = profiling.is_some() && (cfg.profiling.from_step..=cfg.profiling.to_step).contains(&(step + 1));
        if profiled {
            session.train.profile = Some(Vec::new());
        }
        let r = session.step(&batches, lr, cfg.grad_clip_norm, crate::rng::mix(cfg.seed ^ (step + 1)))?;
        if let (true, Some(trace)) = (profiled, profiling.as_mut()) {
            let timings = session.train.profile.take().unwrap_or_default();
            trace.step(step + 1, t0, t0.elapsed());
            trace.ops(step + 1, &session.train.graph, &timings);
            if step + 1 == cfg.profiling.to_step {
                let path = cfg.output.dir.join("profile.json");
                trace.write(&path)?;
                tracing::info!(path = %path.display(), steps = ?(cfg.profiling.from_step..=cfg.profiling.to_step), "profile written");
            }
        }
        if !r.loss.is_finite() {
            return Err(Error::Runtime(format!(
                "step {}: the loss is {} (diverged); lower optimizer.lr or set gradClipNorm",
                step + 1,
                r.loss
            )));
        }
        let n = step + 1;
        if step == start_step {
            first_loss = r.loss;
        }
        last_loss = r.loss;
        let dt = t0.elapsed().as_secs_f64();
        if n % cfg.logging.every == 0 || n == cfg.steps {
            let rate = items as f64 / dt.max(1e-9);
            metrics.step(n, r.loss, lr, r.grad_norm, rate, start.elapsed().as_secs_f64())?;
            if let Some(ep) = &endpoint {
                let per_step = start.elapsed().as_secs_f64() / (n - start_step) as f64;
                ep.update(|p| {
                    p.step = n;
                    p.loss = Some(r.loss);
                    p.learning_rate = Some(lr);
                    p.grad_norm = Some(r.grad_norm);
                    p.tokens_per_second = Some(rate);
                    p.eta_seconds = Some(per_step * (cfg.steps - n) as f64);
                });
            }
            if !quiet {
                eprintln!(
                    "step {n:>5}/{} | loss {:.4} | lr {lr:.2e} | grad norm {:.3} | {:.0} {}/s",
                    cfg.steps,
                    r.loss,
                    r.grad_norm,
                    rate,
                    if seq_len > 0 { "tok" } else { "samples" }
                );
            }
        }
        if let Some(ev) = eval_data.as_mut() {
            if n % cfg.evaluation.every == 0 || n == cfg.steps {
                ev.seek(&Default::default())?;
                let batches: Vec<Batch> =
                    (0..cfg.evaluation.batches).map(|_| ev.next_batch()).collect::<Result<_>>()?;
                let loss = session.evaluate(&batches)?;
                metrics.eval(n, loss)?;
                if let Some(ep) = &endpoint {
                    ep.update(|p| p.eval_loss = Some(loss));
                }
                if !quiet {
                    eprintln!("step {n:>5}/{} | eval loss {loss:.4}", cfg.steps);
                }
            }
        }
        if cfg.checkpoint.every > 0 && n % cfg.checkpoint.every == 0 {
            let path =
                checkpoint::save(&ckpt_dir, n, train_data.position(), cfg, &session.state()?, cfg.checkpoint.keep)?;
            tracing::info!(path = %path.display(), "checkpoint written");
            if let Some(ep) = &endpoint {
                ep.update(|p| p.latest_checkpoint = Some(path.display().to_string()));
            }
        }
    }
    let model_path = cfg.output.dir.join("model.onnx");
    crate::export::write(&model, &session.weights()?, &model_path)?;
    Ok(Summary {
        start_step,
        steps: cfg.steps,
        first_loss,
        final_loss: last_loss,
        metrics: cfg.output.dir.join("metrics.jsonl"),
        checkpoints: (cfg.checkpoint.every > 0).then_some(ckpt_dir),
        model: model_path,
    })
}
