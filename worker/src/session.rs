//! A training session: a model bound to the batch shapes, differentiated, fused and planned
//! on a backend, with the optimizer state beside it. `step` runs one weight update over the
//! micro-batches of gradient accumulation; `evaluate` runs the forward graph with dropout off.

use crate::autodiff;
use crate::backend::{Arg, Backend, StepHyper};
use crate::comm::{Collective, HostGroup, ProcessGroup, ReduceOp};
use crate::config::{ParamGroup, Recompute};
use crate::error::{Error, Result};
use crate::exec::Executor;
use crate::graph::fuse;
use crate::graph::infer::{bind, Bindings};
use crate::graph::ir::{Graph, Meta, ValueId};
use crate::models::Model;
use crate::optim::Update;
use crate::tensor::{DType, Tensor};
use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

/// The shape of each input of a batch, by name.
type BatchShapes = BTreeMap<String, Vec<usize>>;

/// Checkpointed optimizer tensors are named under this prefix; weights keep their own names.
pub const OPTIMIZER_PREFIX: &str = "optimizer/";

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
        }
    }
}

/// A trainable weight and its device-side companions.
struct Param<B: Backend> {
    value: ValueId,
    grad: ValueId,
    update: Update,
    /// Multiplies the scheduled learning rate (optimizer.groups[].lrScale).
    lr_scale: f64,
    /// Optimizer state (momentum, or Adam's moments).
    state: Vec<B::Buffer>,
    /// The sum of micro-batch gradients, when accumulating.
    accum: Option<B::Buffer>,
}

pub struct StepResult {
    /// Mean loss over the micro-batches, before the update.
    pub loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// The values SessionOptions::scalars names, each a mean over the micro-batches.
    pub scalars: Vec<(String, f64)>,
}

pub struct Session<B: Backend> {
    pub train: Executor<B>,
    /// The evaluation executor, planned on first use for the shapes of the evaluation batches
    /// (which need not be the training batches').
    eval: Option<(BatchShapes, Executor<B>)>,
    /// The model's forward graph and loss, unbound, with what evaluation binds it with.
    forward: Graph,
    variables: HashSet<ValueId>,
    disabled_passes: Vec<String>,
    params: Vec<Param<B>>,
    loss: ValueId,
    eval_loss: ValueId,
    inputs: BTreeMap<String, ValueId>,
    /// The scalar values a step reports (SessionOptions::scalars).
    scalars: Vec<(String, ValueId)>,
    /// Model FLOPs of one micro-batch's forward and backward pass (graph::flops).
    pub flops_per_batch: f64,
    /// The data-parallel group whose gradients, losses and evaluation losses are averaged
    /// with this rank's (None: this rank trains alone).
    data_parallel: Option<HostGroup>,
    /// Weight updates done.
    pub step: u64,
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
    /// Builds the training graph for batches shaped like `sample` and plans it on `backend`.
    pub fn new(
        backend: Arc<B>,
        model: &Model,
        sample: &BTreeMap<String, Tensor>,
        accumulation: usize,
        opts: &SessionOptions,
    ) -> Result<Session<B>> {
        let g = &model.graph;
        for (key, names) in [("frozenWeights", &opts.frozen), ("weightsToTrain", &opts.trainable)] {
            for f in names {
                if g.find(f).is_none_or(|v| !g.initializers.contains_key(&v)) {
                    return Err(Error::Config(format!("{key}: '{f}' is not a weight (initializer) of the model")));
                }
            }
        }
        // float32 initializers train; other float types (a float64 constant, say) stay as they are.
        let params: Vec<ValueId> = g
            .float_initializers()
            .into_iter()
            .filter(|&v| {
                let name = g.name_of(v);
                g.initializers[&v].dtype() == DType::F32
                    && !opts.frozen.iter().any(|f| f == name)
                    && (opts.trainable.is_empty() || opts.trainable.iter().any(|f| f == name))
            })
            .collect();
        if params.is_empty() {
            return Err(Error::Config("the model has no trainable weights (float32 initializers)".into()));
        }
        for (i, group) in opts.groups.iter().enumerate() {
            if let Some(p) = group
                .weights
                .iter()
                .find(|p| !params.iter().any(|&v| p.as_str() == "*" || g.name_of(v).contains(p.as_str())))
            {
                return Err(Error::Config(format!(
                    "optimizer.groups[{i}].weights: '{p}' matches no trainable weight of the model"
                )));
            }
        }
        let variables: HashSet<ValueId> = params.iter().copied().collect();
        let bindings = bindings_for(g, sample, &variables)?;

        // The training graph: forward (training mode) + backward, fused, planned.
        let mut train = bind(g, &bindings, true)?;
        autodiff::recompute::pin_dropout_seeds(&mut train);
        let n_forward = train.nodes.len();
        let grads = autodiff::gradients(&mut train, model.loss, &params)?;
        autodiff::recompute::apply(&mut train, n_forward, opts.recompute)?;
        let mut scalars = Vec::new();
        for name in &opts.scalars {
            let v = train.find(name).filter(|&v| train.meta(v).is_some_and(|m| m.numel() == 1)).ok_or_else(|| {
                Error::Config(format!("logging.scalars: '{name}' is not a scalar value of the training graph"))
            })?;
            scalars.push((name.clone(), v));
        }
        // Gradients are outputs too: the optimizer reads them after each run; so are the
        // reported scalars, which keeps fusion from folding them away.
        train.outputs =
            std::iter::once(model.loss).chain(grads.iter().copied()).chain(scalars.iter().map(|&(_, v)| v)).collect();
        fuse::run(&mut train, &opts.disabled_passes);
        let train = Executor::new(backend.clone(), train, &[])?;

        // Model FLOPs count on the forward graph as the model states it, before fusion.
        let mut forward = g.clone();
        forward.outputs = vec![model.loss];
        let flops_per_batch = crate::graph::flops::training(&bind(&forward, &bindings, false)?);

        let mut ps = Vec::new();
        for (&value, &grad) in params.iter().zip(&grads) {
            let meta = train.graph.meta(value).cloned().expect("bound");
            // Weight decay applies to matrices (and convolution kernels), not to biases and
            // normalization weights (the PyTorch/Megatron convention), unless name patterns say.
            let name = train.graph.name_of(value);
            let decays = if opts.no_decay.is_empty() {
                meta.shape.len() >= 2
            } else {
                !opts.no_decay.iter().any(|pat| name.contains(pat.as_str()))
            };
            let base = if decays { opts.update } else { opts.update.without_decay() };
            let group = opts.groups.iter().find(|gr| gr.matches(name));
            let update = group.map_or(base, |gr| base.with_group(gr));
            let lr_scale = group.and_then(|gr| gr.lr_scale).unwrap_or(1.0);
            let alloc = || backend.alloc(meta.bytes()).map_err(Error::Runtime);
            let state = (0..update.state_count()).map(|_| alloc()).collect::<Result<Vec<_>>>()?;
            let accum = if accumulation > 1 { Some(alloc()?) } else { None };
            ps.push(Param { value, grad, update, lr_scale, state, accum });
        }
        let inputs = train.graph.inputs.iter().map(|d| (train.graph.name_of(d.value).to_string(), d.value)).collect();
        Ok(Session {
            train,
            eval: None,
            forward,
            variables,
            disabled_passes: opts.disabled_passes.clone(),
            params: ps,
            loss: model.loss,
            eval_loss: model.loss,
            inputs,
            scalars,
            flops_per_batch,
            data_parallel: None,
            step: 0,
        })
    }

    /// Trains as one of the data-parallel replicas of `group`: weights start from its rank 0's
    /// (call after loading any checkpoint), and every update averages the replicas' gradients.
    pub fn join_data_parallel(&mut self, group: HostGroup) -> Result<()> {
        if group.size() > 1 {
            for p in &self.params {
                let arg = self.train.arg(p.value);
                self.train
                    .backend
                    .with_host_f32(arg, &mut |w| group.broadcast(w, 0).map_err(|e| e.to_string()))
                    .map_err(Error::Runtime)?;
            }
            self.data_parallel = Some(group);
        }
        Ok(())
    }

    /// Averages `values` over the data-parallel replicas (a no-op alone).
    fn average_over_replicas(&self, values: &mut [f64]) -> Result<()> {
        match &self.data_parallel {
            Some(group) => group.all_reduce(values, ReduceOp::Average),
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

    fn scalar(t: &Tensor) -> f64 {
        t.to_f64_vec().first().copied().unwrap_or(f64::NAN)
    }

    /// One weight update over `batches` (one per micro-batch). `lr` is this update's learning
    /// rate, `clip` the global grad-norm threshold (0 = off), `seed` varies dropout.
    pub fn step(&mut self, batches: &[BTreeMap<String, Tensor>], lr: f64, clip: f64, seed: u64) -> Result<StepResult> {
        let n = batches.len();
        let mut loss = 0.0;
        let mut scalars: Vec<(String, f64)> = self.scalars.iter().map(|(name, _)| (name.clone(), 0.0)).collect();
        for (k, batch) in batches.iter().enumerate() {
            Self::feed(&self.train, &self.inputs, batch)?;
            self.train.run(crate::rng::mix(seed ^ k as u64))?;
            loss += Self::scalar(&self.train.fetch(self.loss)?);
            for ((_, sum), &(_, v)) in scalars.iter_mut().zip(&self.scalars) {
                *sum += Self::scalar(&self.train.fetch(v)?) / n as f64;
            }
            if n > 1 {
                // Σ over micro-batches of grad/n: the gradient of the mean loss.
                for p in &self.params {
                    let g = self.train.arg(p.grad);
                    let acc =
                        Arg { buf: p.accum.as_ref().expect("allocated when accumulating"), offset: 0, meta: g.meta };
                    let keep = if k == 0 { 0.0 } else { 1.0 };
                    self.train.backend.accumulate(acc, keep, g, 1.0 / n as f32).map_err(Error::Runtime)?;
                }
            }
        }
        // Data parallelism: every replica's gradient becomes the replicas' mean, the gradient
        // of the loss over the global batch, so that the updates below agree everywhere.
        if let Some(group) = &self.data_parallel {
            for p in &self.params {
                let grad = self.grad_of(p);
                self.train
                    .backend
                    .with_host_f32(grad, &mut |g| group.all_reduce(g, ReduceOp::Average).map_err(|e| e.to_string()))
                    .map_err(Error::Runtime)?;
            }
        }
        let mut means: Vec<f64> = std::iter::once(loss / n as f64).chain(scalars.iter().map(|(_, v)| *v)).collect();
        self.average_over_replicas(&mut means)?;
        for ((_, v), mean) in scalars.iter_mut().zip(&means[1..]) {
            *v = *mean;
        }
        let mut sq = 0.0;
        for p in &self.params {
            sq += self.train.backend.sum_squares(self.grad_of(p)).map_err(Error::Runtime)?;
        }
        let grad_norm = sq.sqrt();
        // torch.nn.utils.clip_grad_norm_: scale by max/(norm+1e-6) when that is below 1.
        let grad_scale = if clip > 0.0 { (clip / (grad_norm + 1e-6)).min(1.0) } else { 1.0 };
        self.step += 1;
        for p in &self.params {
            let hyper = StepHyper { lr: (lr * p.lr_scale) as f32, step: self.step, grad_scale: grad_scale as f32 };
            let meta: &Meta = self.train.graph.meta(p.value).expect("bound");
            let state: Vec<Arg<B::Buffer>> = p.state.iter().map(|buf| Arg { buf, offset: 0, meta }).collect();
            self.train
                .backend
                .optimizer_step(&p.update, hyper, self.train.arg(p.value), self.grad_of(p), &state)
                .map_err(Error::Runtime)?;
        }
        Ok(StepResult { loss: means[0], grad_norm, scalars })
    }

    /// Where a parameter's gradient for the update is: the accumulator, or the graph's output.
    fn grad_of<'a>(&'a self, p: &'a Param<B>) -> Arg<'a, B::Buffer> {
        let g = self.train.arg(p.grad);
        match &p.accum {
            Some(buf) => Arg { buf, offset: 0, meta: g.meta },
            None => g,
        }
    }

    /// Mean loss of the forward graph (dropout off) over `batches`, with the current weights.
    pub fn evaluate(&mut self, batches: &[BTreeMap<String, Tensor>]) -> Result<f64> {
        let Some(first) = batches.first() else { return Ok(f64::NAN) };
        let shapes: BatchShapes = first.iter().map(|(k, t)| (k.clone(), t.shape().to_vec())).collect();
        if self.eval.as_ref().is_none_or(|(planned, _)| *planned != shapes) {
            // Forward + loss in inference mode (dropout off), fused like the training graph.
            let mut g = bind(&self.forward, &bindings_for(&self.forward, first, &self.variables)?, false)?;
            fuse::run(&mut g, &self.disabled_passes);
            self.eval = Some((shapes, Executor::new(self.train.backend.clone(), g, &[])?));
        }
        let eval = &mut self.eval.as_mut().expect("planned above").1;
        for p in &self.params {
            let w = self.train.fetch(p.value)?;
            eval.feed(p.value, &w)?;
        }
        let mut total = 0.0;
        for b in batches {
            Self::feed(eval, &self.inputs, b)?;
            eval.run(0)?;
            total += Self::scalar(&eval.fetch(self.eval_loss)?);
        }
        let mut mean = [total / batches.len() as f64];
        self.average_over_replicas(&mut mean)?;
        Ok(mean[0])
    }

    /// Trained weights whose names `select` picks, with the gradient of the last step (the
    /// averaged one when accumulating, before clipping).
    pub fn weights_and_gradients(&self, select: impl Fn(&str) -> bool) -> Result<Vec<(String, Tensor, Tensor)>> {
        let mut out = Vec::new();
        for p in &self.params {
            let name = self.train.graph.name_of(p.value);
            if select(name) {
                let grad = self.train.backend.download(self.grad_of(p)).map_err(Error::Runtime)?;
                out.push((name.to_string(), self.train.fetch(p.value)?, grad));
            }
        }
        Ok(out)
    }

    /// Names of the trained weights.
    pub fn weight_names(&self) -> Vec<String> {
        self.params.iter().map(|p| self.train.graph.name_of(p.value).to_string()).collect()
    }

    /// The current trainable weights by name.
    pub fn weights(&self) -> Result<BTreeMap<String, Tensor>> {
        self.params
            .iter()
            .map(|p| Ok((self.train.graph.name_of(p.value).to_string(), self.train.fetch(p.value)?)))
            .collect()
    }

    /// Everything an exact resume needs besides the data position: the weights by name, each
    /// weight's optimizer state as `optimizer/<name>/<k>`, and `optimizer/step`.
    pub fn state(&self) -> Result<BTreeMap<String, Tensor>> {
        let mut out = self.weights()?;
        for p in &self.params {
            let name = self.train.graph.name_of(p.value);
            let meta = self.train.graph.meta(p.value).expect("bound");
            for (k, buf) in p.state.iter().enumerate() {
                let t = self.train.backend.download(Arg { buf, offset: 0, meta }).map_err(Error::Runtime)?;
                out.insert(format!("{OPTIMIZER_PREFIX}{name}/{k}"), t);
            }
        }
        out.insert(format!("{OPTIMIZER_PREFIX}step"), Tensor::from_vec(&[1], vec![self.step as i64]));
        Ok(out)
    }

    /// Restores what `state` saved; `origin` names the checkpoint in errors.
    pub fn load_state(&mut self, state: &BTreeMap<String, Tensor>, origin: &str) -> Result<()> {
        let missing = |what: &str| Error::Corrupt(format!("{origin}: '{what}' is missing"));
        for p in &self.params {
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
                let key = format!("{OPTIMIZER_PREFIX}{name}/{k}");
                let t = state.get(&key).ok_or_else(|| missing(&key))?;
                if t.shape() != meta.shape {
                    return Err(Error::Corrupt(format!(
                        "{origin}: '{key}' has shape {:?}, not {:?}",
                        t.shape(),
                        meta.shape
                    )));
                }
                self.train.backend.upload(t, Arg { buf, offset: 0, meta: &meta }).map_err(Error::Runtime)?;
            }
        }
        let step =
            state.get(&format!("{OPTIMIZER_PREFIX}step")).and_then(|t| t.to_i64_vec()).and_then(|v| v.first().copied());
        self.step = step.ok_or_else(|| missing("optimizer/step"))? as u64;
        Ok(())
    }

    /// Planned bytes: the training arena, and persistent weights/inputs.
    pub fn memory(&self) -> (usize, usize) {
        (self.train.plan.arena_bytes, self.train.plan.persistent_bytes)
    }
}
