//! A training session: a model bound to the batch shapes, differentiated, fused and planned
//! on a backend, with the optimizer state beside it. `step` runs one weight update over the
//! micro-batches of gradient accumulation; `evaluate` runs the forward graph with dropout off.

use crate::autodiff;
use crate::backend::{Arg, Backend, StepHyper};
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
    /// Weights whose name contains one of these get no weight decay; empty: rank below 2.
    pub no_decay: Vec<String>,
}

/// A trainable weight and its device-side companions.
struct Param<B: Backend> {
    value: ValueId,
    grad: ValueId,
    update: Update,
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
}

pub struct Session<B: Backend> {
    pub train: Executor<B>,
    eval: Option<Executor<B>>,
    eval_graph: Graph,
    params: Vec<Param<B>>,
    loss: ValueId,
    eval_loss: ValueId,
    inputs: BTreeMap<String, ValueId>,
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
        for f in &opts.frozen {
            if g.find(f).is_none_or(|v| !g.initializers.contains_key(&v)) {
                return Err(Error::Config(format!("frozenWeights: '{f}' is not a weight (initializer) of the model")));
            }
        }
        // float32 initializers train; other float types (a float64 constant, say) stay as they are.
        let params: Vec<ValueId> = g
            .float_initializers()
            .into_iter()
            .filter(|&v| g.initializers[&v].dtype() == DType::F32 && !opts.frozen.iter().any(|f| f == g.name_of(v)))
            .collect();
        if params.is_empty() {
            return Err(Error::Config("the model has no trainable weights (float32 initializers)".into()));
        }
        let variables: HashSet<ValueId> = params.iter().copied().collect();
        let bindings = bindings_for(g, sample, &variables)?;

        // The training graph: forward (training mode) + backward, fused, planned.
        let mut train = bind(g, &bindings, true)?;
        let grads = autodiff::gradients(&mut train, model.loss, &params)?;
        // Gradients are outputs too: the optimizer reads them after each run.
        train.outputs = std::iter::once(model.loss).chain(grads.iter().copied()).collect();
        fuse::run(&mut train, &opts.disabled_passes);
        let train = Executor::new(backend.clone(), train, &[])?;

        // The evaluation graph: forward + loss in inference mode; planned on first use.
        let mut eval_graph = bind(g, &bindings, false)?;
        eval_graph.outputs = vec![model.loss];
        fuse::run(&mut eval_graph, &opts.disabled_passes);

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
            let update = if decays { opts.update } else { opts.update.without_decay() };
            let alloc = || backend.alloc(meta.bytes()).map_err(Error::Runtime);
            let state = (0..update.state_count()).map(|_| alloc()).collect::<Result<Vec<_>>>()?;
            let accum = if accumulation > 1 { Some(alloc()?) } else { None };
            ps.push(Param { value, grad, update, state, accum });
        }
        let inputs = train.graph.inputs.iter().map(|d| (train.graph.name_of(d.value).to_string(), d.value)).collect();
        Ok(Session {
            train,
            eval: None,
            eval_graph,
            params: ps,
            loss: model.loss,
            eval_loss: model.loss,
            inputs,
            step: 0,
        })
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
        for (k, batch) in batches.iter().enumerate() {
            Self::feed(&self.train, &self.inputs, batch)?;
            self.train.run(crate::rng::mix(seed ^ k as u64))?;
            loss += Self::scalar(&self.train.fetch(self.loss)?);
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
        let mut sq = 0.0;
        for p in &self.params {
            sq += self.train.backend.sum_squares(self.grad_of(p)).map_err(Error::Runtime)?;
        }
        let grad_norm = sq.sqrt();
        // torch.nn.utils.clip_grad_norm_: scale by max/(norm+1e-6) when that is below 1.
        let grad_scale = if clip > 0.0 { (clip / (grad_norm + 1e-6)).min(1.0) } else { 1.0 };
        self.step += 1;
        let hyper = StepHyper { lr: lr as f32, step: self.step, grad_scale: grad_scale as f32 };
        for p in &self.params {
            let meta: &Meta = self.train.graph.meta(p.value).expect("bound");
            let state: Vec<Arg<B::Buffer>> = p.state.iter().map(|buf| Arg { buf, offset: 0, meta }).collect();
            self.train
                .backend
                .optimizer_step(&p.update, hyper, self.train.arg(p.value), self.grad_of(p), &state)
                .map_err(Error::Runtime)?;
        }
        Ok(StepResult { loss: loss / n as f64, grad_norm })
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
        if self.eval.is_none() {
            let keep = [];
            self.eval = Some(Executor::new(self.train.backend.clone(), self.eval_graph.clone(), &keep)?);
        }
        let eval = self.eval.as_mut().expect("created above");
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
        Ok(total / batches.len().max(1) as f64)
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
