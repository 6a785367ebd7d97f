//! A training session: the graph `TrainingGraph::build` makes of a model without a backend
//! (bound to the batch shapes, differentiated, fused), planned on a backend, with the
//! optimizer state beside it. `step` runs one weight update over the
//! micro-batches of gradient accumulation; `evaluate` runs the forward graph with dropout off.
//!
//! Under parallelism a session is one rank's share of the training (DESIGN.md, "Parallelism"):
//! - data parallel and ZeRO: `join` chooses the rank's `parallel::GradientSync` once (the
//!   replicas' gradients averaged after the backward pass or in buckets during it, combined by
//!   Adasum, or reduce-scattered so that each replica updates its shard of the weights with
//!   its shard of the optimizer state), and `step` calls it without asking which;
//! - pipeline (`parallel::stage`): the session trains one stage of the model, whose step
//!   exchanges activations and their gradients with its neighbours in the order of a schedule;
//! - tensor parallel (`parallel::tensor`): the bound forward graph is sharded Megatron-style
//!   before anything else, so the session trains this rank's slices of the split weights; the
//!   executors run the graph's all-reduces over the tensor-parallel group. A replicated weight
//!   gets the same gradient on every tensor-parallel rank and counts once, on rank 0.

pub mod buffers;
mod evaluation;
mod losses;
mod training_graph;

pub use crate::parallel::stage::PipelineOptions;
pub use training_graph::{trained_weights, TrainedWeight, TrainingGraph};

use crate::backend::{Arg, Backend, Group};
use crate::checkpoint::keys::{self, LOSS_SCALE_KEY, STEP_KEY};
use crate::comm::{Collective, HostGroup, ProcessGroup, ReduceOp};
use crate::config::{ParamGroup, Recompute};
use crate::error::{Error, Result};
use crate::exec::optimizer::{OptimizerState, Param, StepValues};
use crate::exec::Executor;
use crate::graph::fuse;
use crate::graph::infer::Bindings;
use crate::graph::ir::{Graph, Meta, ValueId};
use crate::models::Model;
use crate::optim::scaler::LossScaler;
use crate::optim::Update;
use crate::parallel::stage::{Messages, StagePart};
use crate::parallel::tensor::TensorSplit;
use crate::parallel::{CommSpan, GradientSync, Replicas, SyncOptions};
use crate::tensor::{DType, Tensor};
use evaluation::{Evaluation, Part};
use losses::Losses;
use std::collections::{BTreeMap, HashSet};
use std::rc::Rc;
use std::sync::Arc;

/// What the session needs to know beyond the model.
#[derive(Clone, Debug)]
pub struct SessionOptions {
    pub update: Update,
    /// Fusion passes to leave out.
    pub disabled_passes: Vec<String>,
    /// Names of float initializers that do not train.
    pub frozen: Vec<String>,
    /// When not empty, only these initializers train.
    pub trainable: Vec<String>,
    /// Weights whose name contains one of these get no weight decay; empty: rank below 2.
    pub no_decay: Vec<String>,
    /// Per-weight hyperparameters: the first matching group's keys replace `update`'s.
    pub groups: Vec<ParamGroup>,
    /// Scalar values of the training graph, by name, that each step reports beside the loss.
    pub scalars: Vec<String>,
    /// Forward values computed again in the backward pass instead of kept.
    pub recompute: Recompute,
    /// Train one stage of a pipeline instead of the whole model.
    pub pipeline: Option<PipelineOptions>,
    /// ZeRO stage (parallelism.zero): 1 shards the optimizer state over the data-parallel
    /// replicas, 2 the gradients too. Takes effect in `join`.
    pub zero: u8,
    /// The data-parallel replicas (parallelism.data) ZeRO splits over: the memory check counts
    /// the largest shard before anything is allocated (`join` sees the group itself).
    pub data_replicas: usize,
    /// Keep each step's averaged gradient where `weights_and_gradients` can read it (under
    /// ZeRO that costs an all-gather per step).
    pub report_gradients: bool,
    /// Bytes of gradients per data-parallel all-reduce (parallelism.bucketMb).
    pub bucket_bytes: usize,
    /// Combine the replicas' gradients with Adasum instead of averaging them.
    pub adasum: bool,
    /// Reduce values on the device through its own collectives (NCCL) where it has them
    /// (parallelism.nccl); false: through host memory and MPI.
    pub device_collectives: bool,
    /// This rank's place in its tensor-parallel group (None: no tensor parallelism).
    pub tensor: Option<TensorPlace>,
    /// Mixed precision: the half type (F16 or BF16) products compute in (`graph::autocast`);
    /// None: f32 throughout. The weights and optimizer state stay f32.
    pub half: Option<DType>,
    /// fp16's loss scaling (None: the loss's gradient is 1).
    pub loss_scaler: Option<LossScaler>,
}

/// Rank `rank` of a tensor-parallel group of `size` (parallelism.tensor).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorPlace {
    pub rank: usize,
    pub size: usize,
}

impl SessionOptions {
    /// Every float32 initializer trains with `update`, decayed by the default rule.
    pub fn new(update: Update) -> SessionOptions {
        SessionOptions {
            update,
            disabled_passes: vec![],
            frozen: vec![],
            trainable: vec![],
            no_decay: vec![],
            groups: vec![],
            scalars: vec![],
            recompute: Recompute::None,
            pipeline: None,
            zero: 0,
            data_replicas: 1,
            report_gradients: false,
            bucket_bytes: 25 << 20,
            device_collectives: true,
            adasum: false,
            tensor: None,
            half: None,
            loss_scaler: None,
        }
    }
}

pub struct StepResult {
    /// Mean loss over the micro-batches, before the update.
    pub loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// The values SessionOptions::scalars names, each a mean over the micro-batches.
    pub scalars: Vec<(String, f64)>,
    /// The loss scale the step's backward pass ran with, and the steps skipped so far (fp16).
    pub loss_scale: Option<f64>,
    pub skipped_steps: Option<u64>,
    /// The gradients overflowed: the weights and optimizer state did not change.
    pub skipped: bool,
}

pub struct Session<B: Backend> {
    pub train: Executor<B>,
    /// The forward graph and loss evaluation runs, planned on first use.
    eval: Evaluation<B>,
    /// The trained weights with their gradients and optimizer state.
    optimizer: OptimizerState<B>,
    /// BatchNormalization's running statistics, updated after every training forward pass.
    running: Vec<buffers::RunningStatistic>,
    /// The step's loss and reported scalars, summed over its micro-batches.
    losses: Losses<B>,
    inputs: BTreeMap<String, ValueId>,
    /// Model FLOPs of one micro-batch's forward and backward pass (graph::flops).
    pub flops_per_batch: f64,
    /// The data-parallel group whose gradients, losses and evaluation losses are averaged
    /// with this rank's (None: this rank trains alone).
    data_parallel: Option<Group<B>>,
    /// The pipeline group: the ranks training the other stages of this replica.
    pipeline: Option<Group<B>>,
    /// This rank's stage, when the model is cut into stages.
    stage: Option<StagePart>,
    /// What `join` chooses the gradient sync by.
    sync_options: SyncOptions,
    /// Whether `join` opens the groups' device collectives (parallelism.nccl).
    device_collectives: bool,
    /// How the replicas' gradients become the update: chosen by `join` (None before it; a
    /// session that joins no group gets the plain average of one on its first step).
    sync: Option<Box<dyn GradientSync<B>>>,
    /// A pipeline stage's messages, per micro-batch (allocated on the first step).
    messages: Vec<Messages<B>>,
    /// Trained weights of the whole model by name (of every stage), for validation and export.
    all_weights: Vec<(String, Meta)>,
    /// fp16's loss scale, and the training graph's input that takes it.
    scaler: Option<LossScaler>,
    loss_scale_input: Option<ValueId>,
    /// The scale the last step's gradients carry (1 without loss scaling).
    last_loss_scale: f64,
    /// Tensor parallelism: this rank's place, and how each split weight is divided.
    tensor: Option<TensorPlace>,
    splits: BTreeMap<String, TensorSplit>,
    /// The tensor-parallel group (after `join`, when tensor parallelism is on).
    tensor_group: Option<Rc<Group<B>>>,
    /// Weight updates done.
    pub step: u64,
}

/// The passes over a forward graph (training's or evaluation's) before it is differentiated or
/// planned: the forward fusions (attention), then mixed precision's casts around them. The loss
/// and `kept` (what is read after a run: the activations a stage sends, the new running
/// statistics) keep their values and types.
fn forward_passes(
    g: &mut Graph,
    loss: ValueId,
    kept: &[ValueId],
    disabled: &[String],
    half: Option<DType>,
    variables: &HashSet<ValueId>,
) -> Result<()> {
    let keep: Vec<ValueId> = std::iter::once(loss).chain(kept.iter().copied()).collect();
    fuse::run_forward(g, disabled, &keep);
    match half {
        Some(half) => crate::graph::autocast::autocast(g, half, variables, &keep),
        None => Ok(()),
    }
}

/// The input shapes of a batch, as bindings for a graph.
fn bindings_for(g: &Graph, batch: &BTreeMap<String, Tensor>, variables: &HashSet<ValueId>) -> Result<Bindings> {
    let mut b = Bindings { variables: variables.clone(), ..Default::default() };
    for d in &g.inputs {
        let name = g.name_of(d.value);
        let t = batch.get(name).ok_or_else(|| {
            let have: Vec<&String> = batch.keys().collect();
            Error::Config(format!("graph input '{name}' is not provided by the data (the data provides {have:?})"))
        })?;
        if t.dtype() != d.dtype {
            return Err(Error::Config(format!("graph input '{name}' is {} but the data gives {}", d.dtype, t.dtype())));
        }
        if d.dims.len() == t.shape().len() {
            for (dim, &n) in d.dims.iter().zip(t.shape()) {
                match dim {
                    crate::graph::ir::Dim::Named(s) => {
                        b.dims.insert(s.clone(), n);
                    }
                    crate::graph::ir::Dim::Fixed(f) if *f != n => {
                        return Err(Error::Config(format!(
                            "graph input '{name}' has shape {:?}; the data gives {:?}",
                            d.dims,
                            t.shape()
                        )))
                    }
                    _ => {}
                }
            }
        }
        b.shapes.insert(d.value, t.shape().to_vec());
    }
    Ok(b)
}

impl<B: Backend> Session<B> {
    /// Builds the training graph for batches shaped like `sample` and plans it on `backend`:
    /// the whole model's, or the stage's that `opts.pipeline` names.
    pub fn new(
        backend: Arc<B>,
        model: &Model,
        sample: &BTreeMap<String, Tensor>,
        accumulation: usize,
        opts: &SessionOptions,
    ) -> Result<Session<B>> {
        let t = TrainingGraph::build(model, sample, accumulation, opts)?;
        let train = Executor::with_state(backend.clone(), t.graph, &[], t.state_bytes)?;
        let mut stage = t.stage;
        if let Some(p) = stage.as_mut() {
            p.plan(&train, t.input_grads);
        }

        let mut params = Vec::new();
        for TrainedWeight { value, grad, update, lr_scale } in t.weights {
            let meta = train.graph.meta(value).cloned().expect("bound");
            let name = train.graph.name_of(value);
            let alloc = || backend.alloc(meta.bytes());
            let (state_count, has_accum) = crate::parallel::zero::whole_buffers(opts.zero, &update, accumulation);
            let state = (0..state_count).map(|_| Ok(alloc()?)).collect::<Result<Vec<_>>>()?;
            let accum = if has_accum { Some(alloc()?) } else { None };
            let holders: Vec<usize> =
                (0..t.stage_weights.len()).filter(|&s| t.stage_weights[s].contains(&value)).collect();
            let first_stage = holders.first() == Some(&stage.as_ref().map_or(0, |p| p.index));
            let owner = first_stage && (t.splits.contains_key(name) || opts.tensor.is_none_or(|p| p.rank == 0));
            params.push(Param { value, grad, update, lr_scale, state, accum, first_stage, owner });
        }
        let losses = Losses::new(&train, t.loss, t.scalars)?;
        Ok(Session {
            train,
            eval: Evaluation::new((t.forward, model.loss), t.variables, opts.disabled_passes.clone(), opts.half),
            optimizer: OptimizerState { params },
            running: t.running,
            losses,
            inputs: t.inputs,
            flops_per_batch: t.flops_per_batch,
            data_parallel: None,
            pipeline: None,
            stage,
            sync_options: SyncOptions {
                zero: opts.zero,
                adasum: opts.adasum,
                bucket_bytes: opts.bucket_bytes,
                report_gradients: opts.report_gradients,
            },
            device_collectives: opts.device_collectives,
            sync: None,
            messages: Vec::new(),
            all_weights: t.all_weights,
            tensor: opts.tensor,
            scaler: opts.loss_scaler.clone(),
            loss_scale_input: t.loss_scale_input,
            last_loss_scale: 1.0,
            splits: t.splits,
            tensor_group: None,
            step: 0,
        })
    }

    /// Trains as one rank of `data` × `tensor` × `pipeline` (groups of one when alone): the
    /// weights start from data-parallel rank 0's (call before loading a checkpoint), every
    /// update averages the replicas' gradients, and under ZeRO this rank keeps its shard of the
    /// state.
    pub fn join(&mut self, data: HostGroup, tensor: HostGroup, pipeline: HostGroup) -> Result<()> {
        let ranks = self.tensor.map_or(1, |t| t.size);
        if tensor.size() != ranks || tensor.rank() != self.tensor.map_or(0, |t| t.rank) {
            return Err(Error::Runtime(format!(
                "the session was split for tensor-parallel rank {} of {ranks}, but this rank is in {}",
                self.tensor.map_or(0, |t| t.rank),
                crate::comm::describe(&tensor)
            )));
        }
        // The groups' device collectives (NCCL) are opened in one order on every rank: data,
        // tensor, pipeline.
        let backend = self.train.backend.clone();
        let open = |host| if self.device_collectives { Group::open(&*backend, host) } else { Ok(Group::host(host)) };
        let data = open(data)?;
        if ranks > 1 {
            let group = Rc::new(open(tensor)?);
            self.train.tensor_group = Some(group.clone());
            self.tensor_group = Some(group);
        }
        let stages = self.stage.as_ref().map_or(1, |p| p.count);
        if pipeline.size() != stages {
            return Err(Error::Runtime(format!(
                "the session trains one of {stages} pipeline stage(s), but {} has {} rank(s)",
                crate::comm::describe(&pipeline),
                pipeline.size()
            )));
        }
        if data.size() > 1 {
            let weights: Vec<Arg<B::Buffer>> = self.optimizer.params.iter().map(|p| self.train.arg(p.value)).collect();
            data.broadcast_values(&backend, &weights, 0)?;
        }
        let replicas = (data.size(), data.rank());
        let group = (data.size() > 1).then_some(&data);
        let r = Replicas { ex: &self.train, optimizer: &self.optimizer, group };
        self.sync = Some(crate::parallel::choose(&self.sync_options, &r, replicas, self.stage.is_some(), ranks)?);
        self.data_parallel = (data.size() > 1).then_some(data);
        self.pipeline = if stages > 1 { Some(open(pipeline)?) } else { None };
        Ok(())
    }

    /// Averages `values` over the data-parallel replicas (a no-op alone).
    fn average_over_replicas(&self, values: &mut [f64]) -> Result<()> {
        match &self.data_parallel {
            Some(group) => group.all_reduce(values, ReduceOp::Average),
            None => Ok(()),
        }
    }

    /// Sums `values` over the pipeline's stages (a no-op without stages): each stage gives
    /// what it computed (the last stage the loss) and zeros for the rest.
    fn sum_over_stages(&self, values: &mut [f64]) -> Result<()> {
        match &self.pipeline {
            Some(group) => group.all_reduce(values, ReduceOp::Sum),
            None => Ok(()),
        }
    }

    /// Sums `values` over the tensor-parallel ranks (a no-op without tensor parallelism).
    fn sum_over_tensor_ranks(&self, values: &mut [f64]) -> Result<()> {
        match &self.tensor_group {
            Some(group) => group.all_reduce(values, ReduceOp::Sum),
            None => Ok(()),
        }
    }

    fn feed(ex: &Executor<B>, inputs: &BTreeMap<String, ValueId>, batch: &BTreeMap<String, Tensor>) -> Result<()> {
        for (name, &v) in inputs {
            let t = batch.get(name).ok_or_else(|| Error::Config(format!("the data provides no '{name}'")))?;
            ex.feed(v, t)?;
        }
        Ok(())
    }

    /// What the gradient sync works on.
    fn replicas(&self) -> Replicas<'_, B> {
        Replicas { ex: &self.train, optimizer: &self.optimizer, group: self.data_parallel.as_ref() }
    }

    /// One weight update over `batches` (one per micro-batch). `lr` is this update's learning
    /// rate, `clip` the global grad-norm threshold (0 = off), `seed` varies dropout.
    pub fn step(&mut self, batches: &[BTreeMap<String, Tensor>], lr: f64, clip: f64, seed: u64) -> Result<StepResult> {
        let mut sync = match self.sync.take() {
            Some(sync) => sync,
            None if self.sync_options.zero > 0 => {
                return Err(Error::Runtime(
                    "parallelism.zero: the session must join its data-parallel group first".into(),
                ))
            }
            // A session that joined no group trains on its own gradients.
            None => Box::new(crate::parallel::data::Replicated::average()),
        };
        let result = self.step_with(&mut *sync, batches, (lr, clip), seed);
        self.sync = Some(sync);
        result
    }

    fn step_with(
        &mut self,
        sync: &mut dyn GradientSync<B>,
        batches: &[BTreeMap<String, Tensor>],
        (lr, clip): (f64, f64),
        seed: u64,
    ) -> Result<StepResult> {
        let n = batches.len();
        if let (Some(v), Some(scaler)) = (self.loss_scale_input, &self.scaler) {
            self.train.feed(v, &Tensor::from_vec(&[], vec![scaler.scale as f32]))?;
        }
        // The loss, then each reported scalar, summed over the micro-batches.
        let mut sums = vec![0.0; 1 + self.losses.scalars.len()];
        self.run_micro_batches(sync, batches, seed, &mut sums)?;
        // A weight held by several stages (a tied embedding) gets the sum of their gradients.
        self.sum_shared_gradients()?;
        // Data parallelism: every replica's gradient becomes the replicas' combination, the
        // gradient of the loss over the global batch, so that the updates below agree.
        sync.reduce(&self.replicas())?;
        // This rank's share of the global gradient norm, then the loss summed on the device:
        // the step's one wait for a device, which has done all of the step's work by then.
        let mut sq = [sync.sum_squares(&self.replicas())?];
        self.losses.read(&self.train, &mut sums)?;
        // Per-stage values: the scalars this stage computed, the loss on the last stage.
        let mut means: Vec<f64> = sums.iter().map(|s| s / n as f64).collect();
        let names: Vec<String> = self.losses.scalars.iter().map(|(name, _)| name.clone()).collect();
        self.sum_over_stages(&mut means)?;
        self.average_over_replicas(&mut means)?;
        let scalars = names.into_iter().zip(means[1..].iter().copied()).collect();

        // The global gradient norm: every weight once, over all stages and shards.
        self.sum_over_stages(&mut sq)?;
        self.sum_over_tensor_ranks(&mut sq)?;
        // Under loss scaling the gradients are the scale times the true ones; an inf or NaN
        // anywhere (every rank sees the same global sum) skips the update.
        let loss_scale = self.scaler.as_ref().map(|s| s.scale);
        self.last_loss_scale = loss_scale.unwrap_or(1.0);
        let grad_norm = sq[0].sqrt() / loss_scale.unwrap_or(1.0);
        let apply = self.scaler.as_mut().is_none_or(|s| s.update(grad_norm.is_finite()));
        let skipped_steps = self.scaler.as_ref().map(|s| s.skipped);
        if !apply {
            return Ok(StepResult { loss: means[0], grad_norm, scalars, loss_scale, skipped_steps, skipped: true });
        }
        // torch.nn.utils.clip_grad_norm_: scale by max/(norm+1e-6) when that is below 1.
        let clip_scale = if clip > 0.0 { (clip / (grad_norm + 1e-6)).min(1.0) } else { 1.0 };
        let grad_scale = clip_scale / loss_scale.unwrap_or(1.0);
        self.step += 1;
        sync.update(&self.replicas(), StepValues { lr, step: self.step, grad_scale })?;
        Ok(StepResult { loss: means[0], grad_norm, scalars, loss_scale, skipped_steps, skipped: false })
    }

    /// Every micro-batch's forward and backward pass (a stage's in its schedule's order),
    /// their losses and scalars added to `sums` and their gradients handed to `sync`.
    fn run_micro_batches(
        &mut self,
        sync: &mut dyn GradientSync<B>,
        batches: &[BTreeMap<String, Tensor>],
        seed: u64,
        sums: &mut [f64],
    ) -> Result<()> {
        let n = batches.len();
        if let Some(part) = &self.stage {
            let group = self.pipeline.as_ref().ok_or_else(|| {
                Error::Runtime("a pipeline stage must join its pipeline group before training".into())
            })?;
            let (inputs, losses) = (&self.inputs, &mut self.losses);
            let (optimizer, data) = (&self.optimizer, self.data_parallel.as_ref());
            let feed = |ex: &Executor<B>, mb: usize| Self::feed(ex, inputs, &batches[mb]);
            // After the run that computed micro-batch `mb`'s gradients (its backward pass).
            let mut done = |ex: &Executor<B>, mb: usize| {
                losses.collect(ex, part.is_last(), sums)?;
                sync.micro_batch_done(&Replicas { ex, optimizer, group: data }, mb, n)
            };
            part.run_step(&mut self.train, group, &mut self.messages, (n, seed), &feed, &mut done)?;
        } else {
            for (k, batch) in batches.iter().enumerate() {
                Self::feed(&self.train, &self.inputs, batch)?;
                let seed = crate::rng::mix(seed ^ k as u64);
                let on = (&self.optimizer, self.data_parallel.as_ref());
                if k + 1 == n && sync.run_last_overlapped(&mut self.train, on, seed, n)? {
                    self.update_running_statistics()?;
                    self.losses.collect(&self.train, true, sums)?;
                } else {
                    self.train.run(seed)?;
                    self.update_running_statistics()?;
                    self.losses.collect(&self.train, true, sums)?;
                    sync.micro_batch_done(&self.replicas(), k, n)?;
                }
            }
        }
        Ok(())
    }

    /// Moves the running statistics to the values the forward pass just computed, as PyTorch
    /// does in every training-mode forward pass (each micro-batch's; on a data-parallel rank,
    /// from its own batch).
    fn update_running_statistics(&self) -> Result<()> {
        for r in &self.running {
            let (value, updated) = (self.train.arg(r.value), self.train.arg(r.updated));
            self.train.backend.accumulate(value, r.keep, updated, r.scale)?;
        }
        Ok(())
    }

    /// The running statistics by name, as they are now.
    pub fn running_statistics(&self) -> Result<BTreeMap<String, Tensor>> {
        self.running
            .iter()
            .map(|r| Ok((self.train.graph.name_of(r.value).to_string(), self.train.fetch(r.value)?)))
            .collect()
    }

    /// Sums the gradients of weights several stages hold over the pipeline group. Every stage
    /// takes part for every shared weight, in one order, a stage without it giving zeros.
    fn sum_shared_gradients(&self) -> Result<()> {
        let (Some(group), Some(part)) = (&self.pipeline, &self.stage) else { return Ok(()) };
        for (name, meta) in &part.shared {
            match self.optimizer.params.iter().find(|p| self.train.graph.name_of(p.value) == name) {
                Some(p) => group.all_reduce_values(&self.train.backend, &[p.gradient(&self.train)], ReduceOp::Sum)?,
                None => {
                    // Zeros of the weight's size, where this stage's collective expects them.
                    let zeros = self.train.backend.alloc(meta.bytes())?;
                    group.all_reduce_values(
                        &self.train.backend,
                        &[Arg { buf: &zeros, offset: 0, meta }],
                        ReduceOp::Sum,
                    )?;
                }
            }
        }
        Ok(())
    }

    /// The gradient all-reduces of the last step, as they overlapped the backward pass (none
    /// without plain data parallelism).
    pub fn comm_spans(&self) -> &[CommSpan] {
        self.sync.as_ref().map_or(&[], |s| s.comm_spans())
    }

    /// Mean loss of the forward graph (dropout off) over `batches`, with the current weights
    /// (over the data-parallel replicas' batches too).
    pub fn evaluate(&mut self, batches: &[BTreeMap<String, Tensor>]) -> Result<f64> {
        let Some(first) = batches.first() else { return Ok(f64::NAN) };
        let part = Part { tensor: self.tensor, stage: self.stage.as_ref(), tensor_group: self.tensor_group.clone() };
        let loss = self.eval.loss;
        let eval = self.eval.executor(&self.train.backend, first, part)?;
        for v in self.optimizer.params.iter().map(|p| p.value).chain(self.running.iter().map(|r| r.value)) {
            let w = self.train.fetch(v)?;
            eval.feed(v, &w)?;
        }
        let mut total = [0.0];
        for b in batches {
            Self::feed(eval, &self.inputs, b)?;
            match (&self.stage, &self.pipeline) {
                (Some(part), Some(group)) => {
                    part.recv_activations(eval, group)?;
                    eval.run(0)?;
                    part.send_activations(eval, group)?;
                    if part.is_last() {
                        total[0] += losses::scalar(&eval.fetch(loss)?);
                    }
                }
                _ => {
                    eval.run(0)?;
                    total[0] += losses::scalar(&eval.fetch(loss)?);
                }
            }
        }
        self.sum_over_stages(&mut total)?;
        let mut mean = [total[0] / batches.len() as f64];
        self.average_over_replicas(&mut mean)?;
        Ok(mean[0])
    }

    /// This rank's trained weights whose names `select` picks, with the gradient of the last
    /// step (averaged over micro-batches and replicas, before clipping; fp16's loss scale
    /// divided out). A pipeline stage has
    /// its own weights only; ZeRO keeps whole gradients only with `report_gradients`.
    pub fn weights_and_gradients(&self, select: impl Fn(&str) -> bool) -> Result<Vec<(String, Tensor, Tensor)>> {
        let mut out = Vec::new();
        for (i, p) in self.optimizer.params.iter().enumerate() {
            let name = self.train.graph.name_of(p.value);
            if select(name) {
                let mut grad = match &self.sync {
                    Some(sync) => sync.gradient(&self.replicas(), i)?,
                    None => self.train.backend.download(p.gradient(&self.train))?,
                };
                if self.last_loss_scale != 1.0 {
                    let unscale = (1.0 / self.last_loss_scale) as f32;
                    grad.as_mut_slice::<f32>().iter_mut().for_each(|g| *g *= unscale);
                }
                out.push((name.to_string(), self.train.fetch(p.value)?, grad));
            }
        }
        Ok(out)
    }

    /// Names of the trained weights of the whole model (of every pipeline stage).
    pub fn weight_names(&self) -> Vec<String> {
        self.all_weights.iter().map(|(name, _)| name.clone()).collect()
    }

    /// This rank's trainable weights by name (its stage's, under pipeline parallelism).
    pub fn weights(&self) -> Result<BTreeMap<String, Tensor>> {
        self.optimizer.weights(&self.train)
    }

    /// Every trained weight of the model, on the rank that holds the first pipeline stage of
    /// data-parallel replica 0 (None elsewhere): the other stages send theirs to it. Every rank
    /// calls it, at the same point.
    pub fn gather_weights(&self) -> Result<Option<BTreeMap<String, Tensor>>> {
        let replica0 = self.data_parallel.as_ref().is_none_or(|g| g.rank() == 0);
        let stages = match (&self.stage, &self.pipeline) {
            (Some(part), Some(group)) if replica0 => part.gather_weights(&self.train, &self.optimizer, group)?,
            _ if replica0 => Some(self.weights()?.into_iter().chain(self.running_statistics()?).collect()),
            _ => None,
        };
        // The first stage's tensor-parallel ranks (of replica 0) join their slices.
        match (stages, &self.tensor_group) {
            (Some(weights), Some(group)) => self.join_slices(weights, group).map(Some),
            (weights, _) => Ok(weights),
        }
    }

    /// Every split weight of `weights` (this rank's slices) made whole from the tensor-parallel
    /// ranks' slices, which every rank of `group` contributes in the same (name) order.
    fn join_slices(
        &self,
        mut weights: BTreeMap<String, Tensor>,
        group: &HostGroup,
    ) -> Result<BTreeMap<String, Tensor>> {
        let size = group.size();
        for (name, t) in weights.iter_mut() {
            let Some(split) = self.splits.get(name) else { continue };
            // Slices may differ in length by a row (an uneven vocabulary): gathered padded.
            let lens: Vec<usize> = (0..size).map(|r| split.local_shape(r, size).iter().product()).collect();
            let longest = lens.iter().copied().max().unwrap_or(0);
            let mut mine = t.as_slice::<f32>().to_vec();
            mine.resize(longest, 0.0);
            let mut all = vec![0f32; longest * size];
            group.all_gather(&mine[..], &mut all[..])?;
            let slices: Vec<Tensor> = (0..size)
                .map(|r| Tensor::from_vec(&[lens[r]], all[r * longest..r * longest + lens[r]].to_vec()))
                .collect();
            *t = split.join(&slices)?;
        }
        Ok(weights)
    }

    /// How each split weight is divided among the tensor-parallel ranks (empty without tensor
    /// parallelism): checkpoints record it, to join the ranks' slices.
    pub fn tensor_splits(&self) -> &BTreeMap<String, TensorSplit> {
        &self.splits
    }

    /// What this rank writes into a checkpoint, by name (`checkpoint` assembles the ranks'
    /// files into one state):
    /// - the weights its stage is first to hold, by data-parallel replica 0;
    /// - their optimizer state as `optimizer/<name>/<k>`; under ZeRO every replica writes its
    ///   shard's pieces, as `optimizer/<name>/<k>@<first element>`;
    /// - the running statistics, by data-parallel replica 0 on tensor-parallel rank 0;
    /// - `optimizer/step`, and under fp16 `optimizer/loss_scale` (the same on every rank).
    pub fn state(&self) -> Result<BTreeMap<String, Tensor>> {
        let mut out = BTreeMap::new();
        let replica0 = self.data_parallel.as_ref().is_none_or(|g| g.rank() == 0);
        for p in self.optimizer.params.iter().filter(|p| p.owner && replica0) {
            let name = self.train.graph.name_of(p.value);
            out.insert(name.to_string(), self.train.fetch(p.value)?);
            let meta = self.train.graph.meta(p.value).expect("bound");
            for (k, buf) in p.state.iter().enumerate() {
                let t = self.train.backend.download(Arg { buf, offset: 0, meta })?;
                out.insert(keys::optimizer_key(name, k), t);
            }
        }
        if let Some(sync) = &self.sync {
            for piece in sync.state_pieces(&self.replicas())? {
                let name = self.train.graph.name_of(self.optimizer.params[piece.weight].value);
                out.insert(keys::piece_key(&keys::optimizer_key(name, piece.k), piece.start), piece.value);
            }
        }
        if replica0 && self.tensor.is_none_or(|t| t.rank == 0) {
            out.extend(self.running_statistics()?);
        }
        if let Some(t) = self.tensor {
            out = out
                .into_iter()
                .map(|(key, v)| (keys::slice_key(&key, t.rank, |w| self.splits.contains_key(w)), v))
                .collect();
        }
        out.insert(STEP_KEY.to_string(), Tensor::from_vec(&[1], vec![self.step as i64]));
        if let Some(scaler) = &self.scaler {
            out.insert(LOSS_SCALE_KEY.to_string(), scaler.state());
        }
        Ok(out)
    }

    /// This rank's slices of an assembled (whole) state's split weights and their optimizer
    /// state; everything else as it is.
    fn slice_state(&self, state: &BTreeMap<String, Tensor>, t: TensorPlace) -> Result<BTreeMap<String, Tensor>> {
        state
            .iter()
            .map(|(key, v)| {
                let split = keys::weight_of_key(key).and_then(|w| self.splits.get(w));
                Ok((
                    key.clone(),
                    match split {
                        Some(split) => split.slice(v, t.rank, t.size)?,
                        None => v.clone(),
                    },
                ))
            })
            .collect()
    }

    /// Restores this rank's part of a state the ranks' `state` saved (assembled: every weight
    /// and optimizer tensor whole); `origin` names the checkpoint in errors. The layout may
    /// differ from the one that saved it: any data-parallel size, ZeRO or not.
    pub fn load_state(&mut self, state: &BTreeMap<String, Tensor>, origin: &str) -> Result<()> {
        let sliced;
        let state = match self.tensor {
            Some(t) => {
                sliced = self.slice_state(state, t).map_err(|e| Error::Corrupt(format!("{origin}: {e}")))?;
                &sliced
            }
            None => state,
        };
        let missing = |what: &str| Error::Corrupt(format!("{origin}: '{what}' is missing"));
        for p in &self.optimizer.params {
            let name = self.train.graph.name_of(p.value).to_string();
            let meta = self.train.graph.meta(p.value).expect("bound").clone();
            let w = state.get(&name).ok_or_else(|| missing(&name))?;
            if w.dtype() != meta.dtype || w.shape() != meta.shape {
                return Err(Error::Corrupt(format!(
                    "{origin}: weight '{name}' is {}{:?}; the model's is {}{:?}",
                    w.dtype(),
                    w.shape(),
                    meta.dtype,
                    meta.shape
                )));
            }
            self.train.feed(p.value, w)?;
            for (k, buf) in p.state.iter().enumerate() {
                let t = optimizer_state(state, &name, k, &meta, origin)?;
                self.train.backend.upload(&t, Arg { buf, offset: 0, meta: &meta })?;
            }
        }
        for r in &self.running {
            let name = self.train.graph.name_of(r.value);
            let t = state.get(name).ok_or_else(|| missing(name))?;
            self.train.feed(r.value, t).map_err(|e| Error::Corrupt(format!("{origin}: running statistic {e}")))?;
        }
        if let Some(mut sync) = self.sync.take() {
            let params = &self.optimizer.params;
            let whole = |i: usize, k| {
                let p: &Param<B> = &params[i];
                optimizer_state(state, self.train.graph.name_of(p.value), k, p.meta(&self.train), origin)
            };
            let loaded = sync.load_pieces(&self.replicas(), &whole);
            self.sync = Some(sync);
            loaded?;
        }
        let step = state.get(STEP_KEY).and_then(|t| t.to_i64_vec()).and_then(|v| v.first().copied());
        self.step = step.ok_or_else(|| missing(STEP_KEY))? as u64;
        // A checkpoint without a loss scale (trained in fp32 or bf16) starts the configured one.
        if let (Some(scaler), Some(t)) = (self.scaler.as_mut(), state.get(LOSS_SCALE_KEY)) {
            scaler.load_state(t).map_err(|e| Error::Corrupt(format!("{origin}: '{LOSS_SCALE_KEY}': {e}")))?;
        }
        Ok(())
    }

    /// Planned bytes: the training arena, and persistent weights/inputs.
    pub fn memory(&self) -> (usize, usize) {
        (self.train.plan.arena_bytes, self.train.plan.persistent_bytes)
    }
}

/// Optimizer state `k` of weight `name` from an assembled checkpoint state, shaped like the
/// weight (a state that ZeRO saved in pieces comes back flat).
fn optimizer_state(
    state: &BTreeMap<String, Tensor>,
    name: &str,
    k: usize,
    meta: &Meta,
    origin: &str,
) -> Result<Tensor> {
    let key = keys::optimizer_key(name, k);
    let t = state.get(&key).ok_or_else(|| Error::Corrupt(format!("{origin}: '{key}' is missing")))?;
    if t.numel() != meta.numel() || t.dtype() != DType::F32 {
        return Err(Error::Corrupt(format!(
            "{origin}: '{key}' is {}{:?}, not f32 of {:?}",
            t.dtype(),
            t.shape(),
            meta.shape
        )));
    }
    Ok(Tensor::from_vec(&meta.shape, t.as_slice::<f32>().to_vec()))
}
