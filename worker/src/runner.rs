//! The training runner, after ONNX Runtime's TrainingRunner: configure → initialize the device
//! → load the model and data → train loop (update, log, evaluate, checkpoint) → export.

use crate::backend::cpu::CpuBackend;
use crate::backend::device::{self, Device};
use crate::backend::Backend;
use crate::checkpoint;
use crate::comm::{CommOptions, Layout, World};
use crate::config::{ModelConfig, ModelSpec, OptimizerName, Precision, TrainingConfig};
use crate::data::prefetch::Prefetched;
use crate::data::{self, Batch, Batching, Feeds, LabelRange, Loader, Partition};
use crate::error::{Error, Result};
use crate::files::OutputLock;
use crate::graph::ir::{Dim, Graph, ValueId};
use crate::models::{self, Model};
use crate::monitor::console::{Console, ConsoleMode, StepLine};
use crate::monitor::endpoint::Endpoint;
use crate::monitor::profile::Trace;
use crate::monitor::{Metrics, StepLog, Watched};
use crate::op::Op;
use crate::optim::{scaler::LossScaler, schedule::learning_rate, Update};
use crate::session::{PipelineOptions, Session, SessionOptions, TensorPlace};
use crate::tensor::DType;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

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
/// The environment variable naming fusion passes to leave out, comma-separated (as ONNX
/// Runtime's disabled optimizers): for measuring a pass, or working round one suspected of a
/// fault, without a rebuild.
pub const DISABLED_PASSES_ENV: &str = "TENSORFLEET_DISABLED_PASSES";

/// The passes `TENSORFLEET_DISABLED_PASSES` names; a name that is no pass is a config error.
fn disabled_passes() -> Result<Vec<String>> {
    let Ok(list) = std::env::var(DISABLED_PASSES_ENV) else { return Ok(vec![]) };
    let known: Vec<&str> =
        crate::graph::fuse::FORWARD_PASSES.iter().chain(crate::graph::fuse::PASSES).copied().collect();
    let names: Vec<String> = list.split(',').map(str::trim).filter(|n| !n.is_empty()).map(String::from).collect();
    match names.iter().find(|n| !known.contains(&n.as_str())) {
        Some(n) => {
            Err(Error::Config(format!("{DISABLED_PASSES_ENV}: '{n}' is not a fusion pass (the passes: {known:?})")))
        }
        None => Ok(names),
    }
}

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
    let vocab = embedding_rows(g, input.value);
    Ok((Feeds { token_input: g.name_of(input.value).to_string(), token_label: label, vocab }, seq))
}

/// The rows of the table the token ids index: the first input of the Gather on the table's
/// first axis that reads the ids directly, where that table is an initializer. (Ids that pass
/// through a Cast or a Reshape first, or a table computed at run time, go unchecked here; the
/// Gather then refuses an id out of range, naming its node.)
fn embedding_rows(g: &Graph, ids: ValueId) -> Option<usize> {
    g.nodes.iter().find_map(|n| {
        let Op::Gather { axis, .. } = n.op else { return None };
        let table = g.initializers.get(&n.input(0)?)?.shape();
        let first_axis = axis == 0 || axis == -(table.len() as i64);
        (first_axis && n.input(1) == Some(ids)).then(|| table.first().copied()).flatten()
    })
}

/// The classes each label input may name, where a cross-entropy of the bound graph reads it
/// (directly, or through reshapes and casts): its scores' class axis, or, for a
/// vocabulary-sharded loss (tensor parallelism), the whole vocabulary its op records (a label
/// past it would fall in no rank's slice, a loss term silently lost).
fn label_ranges(g: &Graph) -> Vec<LabelRange> {
    let producers = g.producers();
    let behind = |mut v: ValueId| loop {
        if g.inputs.iter().any(|d| d.value == v) {
            return Some(v);
        }
        let n = &g.nodes[producers[v]?];
        match n.op {
            Op::Reshape | Op::Identity | Op::Cast { .. } => v = n.input(0)?,
            _ => return None,
        }
    };
    let ranges = g.nodes.iter().filter_map(|n| {
        let (classes, ignore) = match n.op {
            Op::SoftmaxCrossEntropyLoss { ignore_index, .. }
            | Op::SoftmaxCrossEntropyLse { ignore_index, .. }
            | Op::NegativeLogLikelihoodLoss { ignore_index, .. } => (*g.meta(n.input(0)?)?.shape.get(1)?, ignore_index),
            Op::VocabShardCrossEntropy { classes, ignore_index, .. } => (usize::try_from(classes).ok()?, ignore_index),
            _ => return None,
        };
        Some(LabelRange { input: g.name_of(behind(n.input(1)?)?).to_string(), classes, ignore })
    });
    ranges.collect()
}

/// What this build can run of the configuration, checked before anything heavy starts.
fn check_supported(cfg: &TrainingConfig) -> Result<()> {
    let p = &cfg.parallelism;
    if p.zero == 2 && p.pipeline > 1 {
        // Stage 2 reduces every micro-batch's gradient at once, which would have to happen in
        // the middle of the pipeline's schedule (DeepSpeed refuses the pair too).
        return Err(Error::Config(
            "parallelism.zero: ZeRO-2 does not run with pipeline parallelism; use zero: 1 with pipeline > 1".into(),
        ));
    }
    if p.zero > 0 && cfg.optimizer.name == OptimizerName::Lamb {
        return Err(Error::Config(
            "parallelism.zero: LAMB's trust ratio needs each weight whole, which ZeRO splits; use adam, adamw or sgd \
             with ZeRO, or parallelism.zero: 0"
                .into(),
        ));
    }
    Ok(())
}

/// A checkpoint continues this run only if it trained the same model with the same optimizer
/// (else its weights would be dropped or read as other ones, its moments lost) and the same
/// global batch (its data position counts global batches). The layout may differ: another
/// data-parallel, tensor or pipeline size reshards.
fn check_resumable(cfg: &TrainingConfig, m: &checkpoint::Manifest, path: &std::path::Path) -> Result<()> {
    let mismatch = |key: String, was: String, is: String| {
        Err(Error::Config(format!(
            "checkpoint.resume: {} was trained with {key} {was}, this run has {is}; resume under the same {key} \
             (or start in another output.dir)",
            path.display()
        )))
    };
    if let Some((key, was, is)) = model_difference(&m.config.model, &cfg.model) {
        return mismatch(key, was, is);
    }
    if m.config.optimizer.name != cfg.optimizer.name {
        let name = |c: &TrainingConfig| format!("{:?}", c.optimizer.name).to_lowercase();
        return mismatch("optimizer.name".into(), name(&m.config), name(cfg));
    }
    let global = |c: &TrainingConfig| c.batch_size * c.parallelism.data * c.gradient_accumulation_steps;
    if global(&m.config) != global(cfg) {
        return Err(Error::Config(format!(
            "checkpoint.resume: {} was trained with a global batch of {} (batchSize {} × parallelism.data {} × \
             gradientAccumulationSteps {}), this run's is {}; keep the global batch when resuming",
            path.display(),
            global(&m.config),
            m.config.batch_size,
            m.config.parallelism.data,
            m.config.gradient_accumulation_steps,
            global(cfg)
        )));
    }
    Ok(())
}

/// The first key (`model.gpt2.heads`, …) whose value defines the model's weights differently in
/// `was` and `is`, with both values. Dropout defines none; an ONNX model's weights are checked
/// against the checkpoint's by name and shape when they load (its file may have moved).
fn model_difference(was: &ModelSpec, is: &ModelSpec) -> Option<(String, String, String)> {
    if was.onnx.is_some() && is.onnx.is_some() {
        return None;
    }
    let shape_defining = |spec: &ModelSpec| {
        let mut v = serde_json::to_value(spec).expect("a model spec serializes");
        if let Some(gpt2) = v.get_mut("gpt2").and_then(|g| g.as_object_mut()) {
            gpt2.remove("dropout");
        }
        v
    };
    first_difference("model", &shape_defining(was), &shape_defining(is))
}

fn first_difference(key: &str, a: &serde_json::Value, b: &serde_json::Value) -> Option<(String, String, String)> {
    match (a, b) {
        (serde_json::Value::Object(x), serde_json::Value::Object(y)) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            keys.into_iter().find_map(|k| {
                let null = serde_json::Value::Null;
                first_difference(&format!("{key}.{k}"), x.get(k).unwrap_or(&null), y.get(k).unwrap_or(&null))
            })
        }
        _ if a == b => None,
        _ => Some((key.to_string(), a.to_string(), b.to_string())),
    }
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

/// Whether a watched-weight list (logging.histograms / logging.norms) names `weight`.
fn watches(list: &[String], weight: &str) -> bool {
    list.iter().any(|w| w == "*" || w == weight)
}

/// Every name in logging.histograms and logging.norms must be a trained weight (or `*`).
fn check_watched(cfg: &TrainingConfig, weights: &[String]) -> Result<()> {
    for (key, list) in [("logging.histograms", &cfg.logging.histograms), ("logging.norms", &cfg.logging.norms)] {
        if let Some(w) = list.iter().find(|w| *w != "*" && !weights.contains(w)) {
            return Err(Error::Config(format!("{key}: '{w}' is not a trained weight of the model")));
        }
    }
    Ok(())
}

/// The peak FLOP/s MFU is measured against: logging.peakTflops, else the device's known dense
/// peak for the precision's products (none on the CPU).
fn peak_flops(cfg: &TrainingConfig, backend: &impl Backend) -> Option<f64> {
    if cfg.logging.peak_tflops > 0.0 {
        return Some(cfg.logging.peak_tflops * 1e12);
    }
    backend.peak_flops(half_type(cfg.precision).unwrap_or(DType::F32))
}

/// The half type `precision` computes its products in (None: f32).
fn half_type(precision: Precision) -> Option<DType> {
    match precision {
        Precision::Fp32 => None,
        Precision::Fp16 => Some(DType::F16),
        Precision::Bf16 => Some(DType::BF16),
    }
}

/// Runs the whole training described by `cfg` as one rank of the world mpirun started (or
/// alone); `console` says what a watching person sees. Rank 0 writes every output: metrics,
/// TensorBoard events, checkpoints, the profile and the exported model.
pub fn train(cfg: &TrainingConfig, console: ConsoleMode) -> Result<Summary> {
    let world = World::init(&CommOptions { collective_timeout: Duration::from_secs(cfg.parallelism.timeout_seconds) })?;
    let p = &cfg.parallelism;
    let layout = Layout::new(p.data, p.tensor, p.pipeline, world.size())?;
    check_supported(cfg)?;
    let result = match device::resolve(cfg.device, world.local_rank())? {
        Device::Cpu => train_on(Arc::new(CpuBackend::new()), cfg, console, &world, layout),
        #[cfg(feature = "cuda")]
        Device::Cuda { ordinal } => {
            crate::backend::cuda::AttentionKernels::from_env().map_err(Error::Config)?;
            let gpu = crate::backend::cuda::CudaBackend::new(ordinal)
                .map_err(|e| Error::from(e.at(format_args!("rank {} on GPU {ordinal}", world.rank()))))?
                .with_wait_limit(Duration::from_secs(p.timeout_seconds));
            train_on(Arc::new(gpu), cfg, console, &world, layout)
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda { .. } => Err(Error::Config("device: cuda needs a worker built with the cuda feature".into())),
    };
    match result {
        // The other ranks may be waiting for this one in a collective, and finishing MPI would
        // wait for them: the job ends here, with this rank's error.
        Err(e) if world.size() > 1 => {
            eprintln!("error: rank {}: {e}", world.rank());
            world.abort(e.exit_code())
        }
        result => result,
    }
}

/// Aborts the backend's device collectives when dropped armed, as the run returns an error
/// (`Backend::abort_collectives`), so that freeing the session's buffers does not wait for
/// NCCL kernels that wait for peers; `train` then ends the job (`World::abort`).
struct AbortCollectives<'a, B: Backend> {
    backend: &'a B,
    armed: bool,
}

impl<B: Backend> Drop for AbortCollectives<'_, B> {
    fn drop(&mut self) {
        if self.armed {
            self.backend.abort_collectives();
        }
    }
}

/// The run itself, on `backend` (one rank's device).
fn train_on<B: Backend>(
    backend: Arc<B>,
    cfg: &TrainingConfig,
    console: ConsoleMode,
    world: &World,
    layout: Layout,
) -> Result<Summary> {
    let p = &cfg.parallelism;
    let groups = world.parallel_groups(layout)?;
    let leader = world.rank() == 0;
    // Before anything is written, and held to the end of the run.
    let _lock = leader.then(|| OutputLock::acquire(&cfg.output.dir, "output.dir")).transpose()?;
    let model = models::load(&cfg.model, cfg.seed)?;
    if let Some(path) = cfg.output.model_with_loss.as_ref().filter(|_| leader) {
        crate::export::write_graph(&crate::export::loss_graph(&model)?, path)?;
        tracing::info!(path = %path.display(), "model with loss written");
    }
    let (feeds, seq_len) = match cfg.data.train.format {
        crate::config::DataFormat::Tokens => token_feeds(cfg, &model)?,
        crate::config::DataFormat::OnnxSamples => (Feeds::default(), 0),
    };
    let partition = Partition { index: groups.coords.dp, count: layout.data };
    let batching = Batching { batch: cfg.batch_size, seq_len, shuffle: cfg.data.shuffle, seed: cfg.seed, partition };
    // Read ahead on a thread while the device runs the step.
    let mut train_data = Prefetched::new(data::open(&cfg.data.train, "data.train", batching, &feeds)?, "data.train");
    let mut eval_data = match &cfg.data.eval {
        Some(src) if cfg.evaluation.every > 0 => {
            let b = Batching { batch: cfg.eval_batch_size(), shuffle: false, ..batching };
            Some(data::open(src, "data.eval", b, &feeds)?)
        }
        _ => None,
    };
    let ckpt_dir = cfg.checkpoint_dir();
    let resumed = find_resume(cfg, &ckpt_dir)?;
    if let Some((manifest, _, path)) = &resumed {
        check_resumable(cfg, manifest, path)?;
        train_data.seek(&manifest.data)?;
        tracing::info!(path = %path.display(), step = manifest.step, "resuming");
    }
    let first: Batch = train_data.next_batch()?;
    let opts = SessionOptions {
        update: update_of(cfg),
        disabled_passes: disabled_passes()?,
        frozen: cfg.frozen_weights.clone(),
        trainable: cfg.weights_to_train.clone(),
        no_decay: cfg.optimizer.no_decay.clone(),
        groups: cfg.optimizer.groups.clone(),
        scalars: cfg.logging.scalars.clone(),
        recompute: cfg.recompute,
        pipeline: (p.pipeline > 1).then(|| PipelineOptions {
            stage: groups.coords.pp,
            stages: p.pipeline,
            cuts: p.pipeline_cuts.clone(),
            schedule: p.schedule,
        }),
        zero: p.zero,
        data_replicas: p.data,
        report_gradients: !cfg.logging.histograms.is_empty() || !cfg.logging.norms.is_empty(),
        bucket_bytes: ((p.bucket_mb * (1 << 20) as f64) as usize).max(4),
        device_collectives: p.nccl,
        adasum: p.adasum,
        tensor: (p.tensor > 1).then_some(TensorPlace { rank: groups.coords.tp, size: p.tensor }),
        half: half_type(cfg.precision),
        loss_scaler: (cfg.precision == Precision::Fp16)
            .then(|| LossScaler::new(cfg.loss_scale, cfg.dynamic_loss_scale)),
    };
    let t_build = Instant::now();
    let mut session = Session::new(backend.clone(), &model, &first, cfg.gradient_accumulation_steps, &opts)?;
    // Declared after the session, so dropped before it: an error from here on aborts the device
    // collectives before the session's buffers are freed.
    let mut on_error = AbortCollectives { backend: &*backend, armed: true };
    let missing = backend.unsupported(&session.train.graph);
    if let Some(first) = missing.first() {
        return Err(Error::Config(format!(
            "device: {} has no kernel for {} node(s) of the training graph, the first: {first}; set device: cpu",
            backend.name(),
            missing.len()
        )));
    }
    check_watched(cfg, &session.weight_names())?;
    for range in label_ranges(&session.train.graph) {
        train_data.check_labels(&range)?;
        eval_data.as_ref().map_or(Ok(()), |d| d.check_labels(&range))?;
    }
    let (arena, persistent) = session.memory();
    tracing::info!(
        backend = %backend.name(),
        arena_mib = arena as f64 / (1 << 20) as f64,
        largest_scratch_mib = session.train.plan.scratch_peak() as f64 / (1 << 20) as f64,
        weights_mib = persistent as f64 / (1 << 20) as f64,
        nodes = session.train.plan.steps.len(),
        build_ms = t_build.elapsed().as_millis() as u64,
        "training graph planned"
    );
    if let Some(path) = cfg.output.training_graph.as_ref().filter(|_| leader) {
        crate::export::write_graph(&session.train.graph, path)?;
        tracing::info!(path = %path.display(), "training graph written");
    }

    std::fs::create_dir_all(&cfg.output.dir)
        .map_err(|e| Error::Runtime(format!("output.dir {}: {e}", cfg.output.dir.display())))?;
    let metrics_path = cfg.output.dir.join("metrics.jsonl");
    let world_group = world.world_group();
    let coords = groups.coords;
    session.join(groups.data, groups.tensor, groups.pipeline)?;
    let start_step = match &resumed {
        Some((manifest, tensors, path)) => {
            session.load_state(tensors, &format!("checkpoint {}", path.display()))?;
            manifest.step
        }
        None => 0,
    };
    // Only rank 0 reports; the other ranks train silently beside it.
    let mut metrics = match (leader, &resumed) {
        (false, _) => None,
        (true, Some(_)) => Some(Metrics::resume(&metrics_path, start_step)?),
        (true, None) => Some(Metrics::create(&metrics_path)?),
    };
    if cfg.logging.tensorboard {
        if let Some(m) = metrics.take() {
            metrics = Some(m.with_tensorboard(&cfg.tensorboard_dir())?);
        }
    }
    let endpoint = match cfg.logging.port {
        0 => None,
        _ if !leader => None,
        port => Some(Endpoint::serve(std::net::SocketAddr::from(([0, 0, 0, 0], port)), cfg.steps)?),
    };
    if let Some(ep) = &endpoint {
        ep.update(|r| r.step = start_step);
        tracing::info!(addr = %ep.addr, "serving /progress and /metrics");
    }
    let console = Console::new(if leader { console } else { ConsoleMode::Quiet }, start_step, cfg.steps);
    let unit = if seq_len > 0 { "tok" } else { "samples" };
    let peak = peak_flops(cfg, backend.as_ref());
    let watched = |w: &str| watches(&cfg.logging.histograms, w) || watches(&cfg.logging.norms, w);
    let mut profiling = (leader && cfg.profiling.from_step > 0).then(|| Trace::new(world.rank()));
    let mut pending = Some(first);
    let mut first_loss = f64::NAN;
    let mut last_loss = f64::NAN;
    let start = Instant::now();
    let micro_batches = cfg.gradient_accumulation_steps;
    let items = train_data.items_per_batch() * micro_batches * partition.count;
    let flops_per_step = session.flops_per_batch * (micro_batches * partition.count) as f64;
    for step in start_step..cfg.steps {
        let t0 = Instant::now();
        let mut batches = Vec::with_capacity(micro_batches);
        for _ in 0..micro_batches {
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
        // Each data-parallel replica draws its own dropout masks.
        let seed = crate::rng::mix(cfg.seed ^ (step + 1)) ^ coords.dp as u64;
        let r = session.step(&batches, lr, cfg.grad_clip_norm, seed)?;
        if r.skipped {
            tracing::warn!(
                step = step + 1,
                loss_scale = r.loss_scale.unwrap_or(1.0),
                skipped_steps = r.skipped_steps.unwrap_or(0),
                "the gradients overflowed: the update is skipped (and a dynamic loss scale halves)"
            );
        }
        if let (true, Some(trace)) = (profiled, profiling.as_mut()) {
            let timings = session.train.profile.take().unwrap_or_default();
            trace.step(step + 1, t0, t0.elapsed());
            trace.ops(step + 1, &session.train.graph, &timings);
            trace.comm(step + 1, session.comm_spans());
            if step + 1 == cfg.profiling.to_step {
                let path = cfg.output.dir.join("profile.json");
                trace.write(&path)?;
                tracing::info!(path = %path.display(), steps = ?(cfg.profiling.from_step..=cfg.profiling.to_step), "profile written");
            }
        }
        if !r.loss.is_finite() {
            return Err(Error::Diverged(format!(
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
        let dt = t0.elapsed().as_secs_f64().max(1e-9);
        if let (Some(metrics), true) = (metrics.as_mut(), n % cfg.logging.every == 0 || n == cfg.steps) {
            let rate = items as f64 / dt;
            let flops = flops_per_step / dt;
            // Each rank's device has the peak: the world's share is the utilization.
            let mfu = peak.map(|p| flops / (p * world.size() as f64));
            metrics.step(&StepLog {
                step: n,
                loss: r.loss,
                lr,
                grad_norm: r.grad_norm,
                items_per_sec: rate,
                elapsed_sec: start.elapsed().as_secs_f64(),
                mfu,
                loss_scale: r.loss_scale,
                skipped_steps: r.skipped_steps,
                skipped: r.skipped,
                graph_scalars: &r.scalars,
            })?;
            let watched: Vec<Watched> = session
                .weights_and_gradients(watched)?
                .into_iter()
                .map(|(name, value, grad)| Watched {
                    histogram: watches(&cfg.logging.histograms, &name),
                    norm: watches(&cfg.logging.norms, &name),
                    name,
                    value,
                    grad,
                })
                .collect();
            metrics.weights(n, &watched)?;
            if let Some(ep) = &endpoint {
                let per_step = start.elapsed().as_secs_f64() / (n - start_step) as f64;
                ep.update(|p| {
                    p.step = n;
                    p.loss = Some(r.loss);
                    p.learning_rate = Some(lr);
                    p.grad_norm = Some(r.grad_norm);
                    p.tokens_per_second = Some(rate);
                    p.flops_per_second = (flops > 0.0).then_some(flops);
                    p.mfu = mfu;
                    p.eta_seconds = Some(per_step * (cfg.steps - n) as f64);
                });
            }
            let line =
                StepLine { step: n, total: cfg.steps, loss: r.loss, lr, grad_norm: r.grad_norm, rate, unit, mfu };
            console.step(&line);
        }
        if let Some(ev) = eval_data.as_mut() {
            if n % cfg.evaluation.every == 0 || n == cfg.steps {
                ev.seek(&Default::default())?;
                let batches: Vec<Batch> =
                    (0..cfg.evaluation.batches).map(|_| ev.next_batch()).collect::<Result<_>>()?;
                let loss = session.evaluate(&batches)?;
                if let Some(m) = metrics.as_mut() {
                    m.eval(n, loss)?;
                }
                if let Some(ep) = &endpoint {
                    ep.update(|p| p.eval_loss = Some(loss));
                }
                console.eval(n, loss);
            }
        }
        if cfg.checkpoint.every > 0 && n % cfg.checkpoint.every == 0 {
            let state = session.state()?;
            let path = checkpoint::save(
                &ckpt_dir,
                n,
                train_data.position(),
                cfg,
                &state,
                session.tensor_splits(),
                cfg.checkpoint.keep,
                &world_group,
            )?;
            if leader {
                tracing::info!(path = %path.display(), "checkpoint written");
            }
            if let Some(ep) = &endpoint {
                ep.update(|p| p.latest_checkpoint = Some(path.display().to_string()));
            }
        }
    }
    console.finish();
    let model_path = cfg.output.dir.join("model.onnx");
    // Every stage's weights meet on rank 0, which exports the whole model.
    if let Some(weights) = session.gather_weights()? {
        if leader {
            crate::export::write(&model, &weights, &model_path)?;
        }
    }
    on_error.armed = false;
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
