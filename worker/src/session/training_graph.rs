//! The graph a session trains, built without a backend: the model bound to the batch shapes
//! (training mode, dropout seeds pinned), sharded for tensor parallelism, cut to this rank's
//! pipeline stage, passed through the forward fusions and mixed precision's casts,
//! differentiated (with recomputation), fused, and each trained weight given its gradient and
//! update rule. `Session::new` plans it on a backend and allocates what the weights need beside it.

use super::{bindings_for, buffers, forward_passes, SessionOptions};
use crate::autodiff;
use crate::error::{Error, Result};
use crate::graph::fuse;
use crate::graph::infer::{bind, Bindings};
use crate::graph::ir::{Graph, Meta, ValueId};
use crate::models::Model;
use crate::optim::Update;
use crate::parallel::stage::{self, StagePart};
use crate::parallel::tensor::TensorSplit;
use crate::tensor::{DType, Tensor};
use std::collections::{BTreeMap, HashSet};

/// A weight this rank trains: its value, its gradient in the training graph, its update rule and
/// its learning-rate scale (optimizer.groups[].lrScale).
#[derive(Clone, Debug)]
pub struct TrainedWeight {
    pub value: ValueId,
    pub grad: ValueId,
    pub update: Update,
    pub lr_scale: f64,
}

/// The training graph of one rank, and what running it needs to know about it.
pub struct TrainingGraph {
    /// Forward and backward, fused; its outputs are the loss, the gradients (the weights', then
    /// the received activations'), the reported scalars, the activations a stage sends and the
    /// new running statistics.
    pub graph: Graph,
    pub loss: ValueId,
    pub weights: Vec<TrainedWeight>,
    /// The gradients of the activations this pipeline stage received, in their order.
    pub input_grads: Vec<Option<ValueId>>,
    /// This rank's pipeline stage (its boundary, planned once the graph has an executor).
    pub(super) stage: Option<StagePart>,
    /// The weights each stage holds (one entry without a pipeline).
    pub stage_weights: Vec<Vec<ValueId>>,
    /// How tensor parallelism divided each split weight.
    pub splits: BTreeMap<String, TensorSplit>,
    /// BatchNormalization's running statistics, updated by every training forward pass.
    pub(super) running: Vec<buffers::RunningStatistic>,
    /// The values that change from step to step (weights, running statistics): never folded.
    pub variables: HashSet<ValueId>,
    /// The whole model's trained weights by name (of every stage), for validation and export.
    pub all_weights: Vec<(String, Meta)>,
    /// The scalar values a step reports (SessionOptions::scalars) that this graph computes.
    pub scalars: Vec<(String, ValueId)>,
    /// fp16's loss scale, fed to this input each step.
    pub loss_scale_input: Option<ValueId>,
    /// What the session allocates beside the plan (optimizer state, accumulators), in bytes,
    /// counted with the plan before anything is allocated.
    pub state_bytes: usize,
    /// The model's forward graph, unbound, with BatchNormalization in inference mode: what
    /// evaluation binds.
    pub forward: Graph,
    /// Model FLOPs of one micro-batch's forward and backward pass (graph::flops).
    pub flops_per_batch: f64,
    /// The batch's inputs by name.
    pub inputs: BTreeMap<String, ValueId>,
}

impl TrainingGraph {
    /// The training graph of `model` for batches shaped like `sample`, over `accumulation`
    /// micro-batches: the whole model's, or the stage's that `opts.pipeline` names.
    pub fn build(
        model: &Model,
        sample: &BTreeMap<String, Tensor>,
        accumulation: usize,
        opts: &SessionOptions,
    ) -> Result<TrainingGraph> {
        let g = &model.graph;
        let (params, tracked) = checked_weights(g, opts)?;
        // Values that change from step to step: never folded into their readers.
        let variables: HashSet<ValueId> = params.iter().chain(&tracked).copied().collect();
        let bindings = bindings_for(g, sample, &variables)?;
        let RankGraph { graph: mut train, loss, part, stage_weights, splits, running, all_weights } =
            RankGraph::build(model, &bindings, &params, &tracked, opts)?;
        let held: Vec<ValueId> = params.iter().copied().filter(|v| train.initializers.contains_key(v)).collect();
        if held.is_empty() {
            return Err(Error::Config(format!(
                "pipeline stage {} holds no trainable weight; move parallelism.pipelineCuts",
                opts.pipeline.as_ref().map_or(0, |p| p.stage)
            )));
        }
        let updated: Vec<ValueId> = running.iter().map(|r| r.updated).collect();
        let sends: Vec<ValueId> = part.as_ref().map_or(vec![], |p| p.sends.clone());
        let kept: Vec<ValueId> = sends.iter().chain(&updated).copied().collect();
        forward_passes(&mut train, loss, &kept, &opts.disabled_passes, opts.half, &variables)?;
        let loss_scale_input = loss_scale_input(&mut train, part.as_ref(), opts);
        let receives: Vec<ValueId> = part.as_ref().map_or(vec![], |p| p.receives.clone());
        let (grads, input_grads) = differentiate(&mut train, loss, &held, &receives, loss_scale_input, opts)?;
        let scalars = reported_scalars(&train, part.is_some(), opts)?;
        // Gradients are outputs too: the optimizer reads them after each run; so are the
        // reported scalars, the activations a stage sends and the new running statistics,
        // which keeps fusion from folding them away.
        train.outputs = std::iter::once(loss)
            .chain(grads.iter().copied())
            .chain(input_grads.iter().flatten().copied())
            .chain(scalars.iter().map(|&(_, v)| v))
            .chain(sends.iter().copied())
            .chain(updated.iter().copied())
            .collect();
        fuse::run(&mut train, &opts.disabled_passes);
        let updates: Vec<(Update, f64)> = held.iter().map(|&v| weight_update(opts, &train, v)).collect();
        let state_bytes = state_bytes(opts, &train, &held, &updates, accumulation);
        // Model FLOPs count on the whole forward graph as the model states it, before fusion.
        // Evaluation runs it with BatchNormalization in inference mode.
        let mut forward = g.clone();
        forward.outputs = vec![model.loss];
        crate::models::inference_batch_norm(&mut forward);
        let flops_per_batch = crate::graph::flops::training(&bind(&forward, &bindings, false)?);
        // Batch inputs only: a stage's received activations and their gradients are fed apart.
        let inputs = train
            .inputs
            .iter()
            .filter(|d| g.inputs.iter().any(|m| m.value == d.value))
            .map(|d| (train.name_of(d.value).to_string(), d.value))
            .collect();
        let weights = held
            .iter()
            .zip(grads)
            .zip(updates)
            .map(|((&value, grad), (update, lr_scale))| TrainedWeight { value, grad, update, lr_scale })
            .collect();
        Ok(TrainingGraph {
            graph: train,
            loss,
            weights,
            input_grads,
            stage: part,
            stage_weights,
            splits,
            running,
            variables,
            all_weights,
            scalars,
            loss_scale_input,
            state_bytes,
            forward,
            flops_per_batch,
            inputs,
        })
    }
}

/// The weights that train (and the running statistics that training forward passes update),
/// checked: finite, some at all, every parameter group matching one, and no running statistics
/// under a pipeline.
fn checked_weights(g: &Graph, opts: &SessionOptions) -> Result<(Vec<ValueId>, HashSet<ValueId>)> {
    let (params, tracked) = trained_weights(g, &opts.trainable, &opts.frozen)?;
    // A NaN or infinite weight makes every loss NaN from the first step on: damaged data.
    // (Constants may hold infinities, as attention masks do; they are not weights.)
    if let Some(&v) = params.iter().find(|&&v| g.initializers[&v].first_non_finite().is_some()) {
        return Err(Error::Corrupt(format!("the model's weight '{}' holds NaN or infinite values", g.name_of(v))));
    }
    if !tracked.is_empty() && opts.pipeline.is_some() {
        return Err(Error::Config(format!(
            "parallelism.pipeline: the model's {} BatchNormalization running statistics are not updated across \
             pipeline stages yet; train without pipeline parallelism, or list them in frozenWeights to keep them as \
             they are",
            tracked.len()
        )));
    }
    if params.is_empty() {
        return Err(Error::Config(
            "the model has no trainable weights: no float32 initializer that a gradient reaches (running \
             statistics and constants do not train) is left by frozenWeights / weightsToTrain"
                .into(),
        ));
    }
    for (i, group) in opts.groups.iter().enumerate() {
        let matches = |p: &String| params.iter().any(|&v| p.as_str() == "*" || g.name_of(v).contains(p.as_str()));
        if let Some(p) = group.weights.iter().find(|p| !matches(p)) {
            return Err(Error::Config(format!(
                "optimizer.groups[{i}].weights: '{p}' matches no trainable weight of the model"
            )));
        }
    }
    Ok((params, tracked))
}

/// This rank's forward graph: bound in training mode, split by tensor parallelism, cut to its
/// pipeline stage.
struct RankGraph {
    graph: Graph,
    loss: ValueId,
    part: Option<StagePart>,
    stage_weights: Vec<Vec<ValueId>>,
    splits: BTreeMap<String, TensorSplit>,
    running: Vec<buffers::RunningStatistic>,
    all_weights: Vec<(String, Meta)>,
}

impl RankGraph {
    fn build(
        model: &Model,
        bindings: &Bindings,
        params: &[ValueId],
        tracked: &HashSet<ValueId>,
        opts: &SessionOptions,
    ) -> Result<RankGraph> {
        let g = &model.graph;
        // The forward graph in training mode (BatchNormalization too, whatever the export
        // says), each dropout with its own seed (so that a recomputed clone, or a pipeline
        // stage's second forward pass, draws the same mask).
        let mut bound = bind(&buffers::training_form(g, tracked), bindings, true)?;
        check_loss(&bound, model.loss)?;
        let running = buffers::running_statistics(&bound, tracked)?;
        autodiff::recompute::pin_dropout_seeds(&mut bound);
        let all_weights: Vec<(String, Meta)> =
            params.iter().map(|&v| (g.name_of(v).to_string(), bound.meta(v).cloned().expect("bound"))).collect();
        // Tensor parallelism splits the whole forward graph, before a pipeline cuts it.
        let mut pipeline = opts.pipeline.clone();
        let mut splits = BTreeMap::new();
        if let Some(t) = opts.tensor {
            // Balanced cuts are chosen on the unsplit graph, so that every tensor-parallel rank
            // cuts alike (an uneven vocabulary split makes the ranks' FLOPs differ).
            if let Some(p) = pipeline.as_mut().filter(|p| p.cuts.is_empty()) {
                p.cuts = crate::parallel::pipeline::balanced_cuts(&bound, model.loss, p.stages, params)?;
            }
            splits = crate::parallel::tensor::shard(&mut bound, model.loss, t.rank, t.size)?;
        }
        // This rank's part: the whole graph, or a stage with its boundary.
        let (graph, loss, part, stage_weights) = match &pipeline {
            None => (bound, model.loss, None, vec![params.to_vec()]),
            Some(p) => stage::cut(bound, model.loss, p, params)?,
        };
        Ok(RankGraph { graph, loss, part, stage_weights, splits, running, all_weights })
    }
}

/// fp16: the loss's gradient is the loss scale, fed each step to a new input of `train` (the
/// last stage's loss is the model's; the other stages' backward passes start from gradients
/// already scaled).
fn loss_scale_input(train: &mut Graph, part: Option<&StagePart>, opts: &SessionOptions) -> Option<ValueId> {
    (opts.loss_scaler.is_some() && part.is_none_or(|p| p.is_last())).then(|| {
        let v = train.fresh("loss_scale");
        let name = train.name_of(v).to_string();
        train.add_input(&name, DType::F32, vec![]);
        train.values[v].meta = Some(Meta::new(DType::F32, &[]));
        v
    })
}

/// The backward pass: each of `held`'s gradients (every one must reach the loss), and those of
/// the activations a stage `receives`; then recomputation's rewrite of the forward values.
fn differentiate(
    train: &mut Graph,
    loss: ValueId,
    held: &[ValueId],
    receives: &[ValueId],
    loss_scale_input: Option<ValueId>,
    opts: &SessionOptions,
) -> Result<(Vec<ValueId>, Vec<Option<ValueId>>)> {
    let n_forward = train.nodes.len();
    let wrt: Vec<ValueId> = held.iter().chain(receives).copied().collect();
    let mut all_grads = autodiff::gradients_of(train, loss, &wrt, loss_scale_input)?;
    let input_grads = all_grads.split_off(held.len());
    let unreached = |p: ValueId| {
        Error::Config(format!("weight '{}' does not affect the loss; freeze it or remove it", train.name_of(p)))
    };
    let grads: Vec<ValueId> =
        held.iter().zip(all_grads).map(|(&p, dp)| dp.ok_or_else(|| unreached(p))).collect::<Result<_>>()?;
    autodiff::recompute::apply(train, n_forward, opts.recompute)?;
    Ok((grads, input_grads))
}

/// The values logging.scalars names, as this graph computes them: a pipeline stage reports the
/// scalars it computes, the others come from other stages (a stage's graph knows every forward
/// value's name, and its own backward values).
fn reported_scalars(train: &Graph, staged: bool, opts: &SessionOptions) -> Result<Vec<(String, ValueId)>> {
    let computed = train.producers();
    let mut scalars = Vec::new();
    for name in &opts.scalars {
        let v = train.find(name).filter(|&v| train.meta(v).is_some_and(|m| m.numel() == 1)).ok_or_else(|| {
            Error::Config(format!("logging.scalars: '{name}' is not a scalar value of the training graph"))
        })?;
        if !staged || computed.get(v).is_some_and(|p| p.is_some()) {
            scalars.push((name.clone(), v));
        }
    }
    Ok(scalars)
}

/// Weight `value`'s update rule and learning-rate scale: weight decay applies to matrices (and
/// convolution kernels), not to biases and normalization weights (the PyTorch/Megatron
/// convention), unless name patterns say; a parameter group's keys override the optimizer's.
fn weight_update(opts: &SessionOptions, g: &Graph, value: ValueId) -> (Update, f64) {
    let name = g.name_of(value);
    let decays = if opts.no_decay.is_empty() {
        g.meta(value).is_some_and(|m| m.shape.len() >= 2)
    } else {
        !opts.no_decay.iter().any(|pat| name.contains(pat.as_str()))
    };
    let base = if decays { opts.update } else { opts.update.without_decay() };
    let group = opts.groups.iter().find(|gr| gr.matches(name));
    let update = group.map_or(base, |gr| base.with_group(gr));
    (update, group.and_then(|gr| gr.lr_scale).unwrap_or(1.0))
}

/// What a session allocates beside its executor's plan, counted with the plan before anything
/// is allocated: each weight's optimizer state and gradient accumulator, or under ZeRO the
/// largest replica's shard of them (allocated in `join`).
fn state_bytes(
    opts: &SessionOptions,
    g: &Graph,
    held: &[ValueId],
    updates: &[(Update, f64)],
    accumulation: usize,
) -> usize {
    let whole: usize = held
        .iter()
        .zip(updates)
        .map(|(&v, (update, _))| {
            let (state, accum) = crate::parallel::zero::whole_buffers(opts.zero, update, accumulation);
            (state + usize::from(accum)).saturating_mul(g.meta(v).map_or(0, Meta::bytes))
        })
        .fold(0, usize::saturating_add);
    if opts.zero == 0 {
        return whole;
    }
    let lens: Vec<usize> = held.iter().map(|&v| g.meta(v).map_or(0, Meta::numel)).collect();
    let counts: Vec<usize> = updates.iter().map(|(u, _)| u.state_count()).collect();
    whole.saturating_add(crate::parallel::zero::largest_shard_bytes(&lens, &counts, opts.data_replicas))
}

/// The backward pass starts from the loss with a gradient of 1, so the loss must be one float
/// number: a tensor there (a model's logits named as its loss, without a `type` to attach one)
/// would train the sum of its elements, silently.
fn check_loss(bound: &Graph, loss: ValueId) -> Result<()> {
    let meta = bound.meta(loss).expect("bound graphs give every value a meta");
    if meta.dtype.is_float() && meta.shape.iter().product::<usize>() == 1 {
        return Ok(());
    }
    Err(Error::Config(format!(
        "model.onnx.loss.output: '{}' is {} {:?}, not one number: name the output that is the model's loss, \
         or give loss.type (softmaxCrossEntropy, mse) to attach a loss to this one",
        bound.name_of(loss),
        meta.dtype,
        meta.shape
    )))
}

/// What trains in `g`, by the weightsToTrain (`trainable`) and frozenWeights (`frozen`) lists:
/// the parameters, and the running statistics that training forward passes update. Training
/// and `export` (which needs every parameter from the checkpoint) choose alike here.
pub fn trained_weights(g: &Graph, trainable: &[String], frozen: &[String]) -> Result<(Vec<ValueId>, HashSet<ValueId>)> {
    for (key, names) in [("frozenWeights", frozen), ("weightsToTrain", trainable)] {
        for f in names {
            if g.find(f).is_none_or(|v| !g.initializers.contains_key(&v)) {
                return Err(Error::Config(format!("{key}: '{f}' is not a weight (initializer) of the model")));
            }
        }
    }
    // What trains: the float32 initializers that are parameters by how the graph reads them
    // (`buffers::roles`: not BatchNormalization's running statistics, not constants an
    // exporter lifted into initializers), unless frozenWeights lists them; weightsToTrain,
    // when given, names exactly what trains. Other float types (a float64 constant, say)
    // stay as they are. The running statistics no list names are updated by every training
    // forward pass, as PyTorch's are.
    let roles = buffers::roles(g);
    let role = |v: ValueId| roles.get(&v).copied();
    let listed = |names: &[String], v: ValueId| names.iter().any(|f| f == g.name_of(v));
    let f32_initializers = || g.float_initializers().into_iter().filter(|v| g.initializers[v].dtype() == DType::F32);
    let params: Vec<ValueId> = f32_initializers()
        .filter(|&v| {
            let chosen =
                if trainable.is_empty() { role(v) == Some(buffers::Role::Parameter) } else { listed(trainable, v) };
            chosen && !listed(frozen, v)
        })
        .collect();
    let tracked: HashSet<ValueId> = f32_initializers()
        .filter(|&v| role(v) == Some(buffers::Role::RunningStatistic) && !listed(frozen, v) && !listed(trainable, v))
        .collect();
    tracing::debug!(
        parameters = params.len(),
        running_statistics = tracked.len(),
        constants = roles.values().filter(|&&r| r == buffers::Role::Constant).count(),
        "float initializers by role"
    );
    Ok((params, tracked))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Gpt2Config, ModelSpec, PipelineSchedule};
    use crate::op::Op;
    use crate::session::{PipelineOptions, TensorPlace};

    fn gpt2() -> Model {
        let config = Gpt2Config { layers: 2, heads: 2, embed: 32, seq_len: 16, vocab: 64, ..Default::default() };
        crate::models::load(&ModelSpec { gpt2: Some(config), ..Default::default() }, 1).unwrap()
    }

    fn sample() -> BTreeMap<String, Tensor> {
        let ids = |k: i64| Tensor::from_vec(&[2, 16], (0..32).map(|i| (i * 5 + k) % 64).collect());
        [("input_ids".to_string(), ids(0)), ("labels".to_string(), ids(1))].into_iter().collect()
    }

    fn adamw() -> SessionOptions {
        SessionOptions::new(Update::Adam { beta1: 0.9, beta2: 0.95, epsilon: 1e-8, weight_decay: 0.1, decoupled: true })
    }

    /// With no backend at all: the loss and then every weight's gradient (shaped like the
    /// weight) are outputs, the attention is fused each way, and the state counted beside the
    /// plan is Adam's two moments and the accumulator of each weight.
    #[test]
    fn the_whole_models_graph_is_built_without_a_backend() {
        let model = gpt2();
        let t = TrainingGraph::build(&model, &sample(), 2, &adamw()).unwrap();
        let g = &t.graph;
        assert_eq!(g.outputs[0], t.loss);
        assert_eq!(t.weights.len(), t.all_weights.len(), "one stage trains every weight");
        for (k, w) in t.weights.iter().enumerate() {
            assert_eq!(g.outputs[1 + k], w.grad, "{}", g.name_of(w.value));
            assert_eq!(g.meta(w.grad).map(|m| &m.shape), g.meta(w.value).map(|m| &m.shape));
        }
        let count = |pick: fn(&Op) -> bool| g.nodes.iter().filter(|n| pick(&n.op)).count();
        assert_eq!(count(|op| matches!(op, Op::Attention { .. })), 2);
        assert_eq!(count(|op| matches!(op, Op::AttentionGrad { .. })), 2);
        let weight_bytes: usize = t.weights.iter().map(|w| g.meta(w.value).unwrap().bytes()).sum();
        assert_eq!(t.state_bytes, 3 * weight_bytes);
        assert!(t.flops_per_batch > 0.0);
        assert_eq!(t.inputs.keys().collect::<Vec<_>>(), ["input_ids", "labels"]);
    }

    /// Two pipeline stages under two tensor-parallel ranks: each stage trains its own weights
    /// (together every weight; only the tied embedding on both, which the first stage's
    /// embedding and the last's LM head read), and the split weights are this rank's slices.
    #[test]
    fn each_stage_of_a_split_model_trains_its_own_slices() {
        let model = gpt2();
        let mut trained = Vec::new();
        for stage in 0..2 {
            let pipeline = PipelineOptions { stage, stages: 2, cuts: vec![], schedule: PipelineSchedule::default() };
            let tensor = Some(TensorPlace { rank: 1, size: 2 });
            let opts = SessionOptions { pipeline: Some(pipeline), tensor, ..adamw() };
            let t = TrainingGraph::build(&model, &sample(), 1, &opts).unwrap();
            assert_eq!(t.stage_weights.len(), 2);
            assert!(!t.splits.is_empty(), "tensor parallelism split some weights");
            for w in &t.weights {
                let name = t.graph.name_of(w.value).to_string();
                let whole = &t.all_weights.iter().find(|(n, _)| *n == name).unwrap().1;
                let mine = t.graph.meta(w.value).unwrap();
                let split = t.splits.contains_key(&name);
                assert_eq!(mine.numel() * if split { 2 } else { 1 }, whole.numel(), "{name}");
                trained.push(name);
            }
        }
        trained.sort();
        let twice: Vec<&String> = trained.windows(2).filter(|p| p[0] == p[1]).map(|p| &p[0]).collect();
        assert_eq!(twice, ["wte"]);
        trained.dedup();
        let (params, _) = trained_weights(&model.graph, &[], &[]).unwrap();
        let mut all: Vec<String> = params.iter().map(|&v| model.graph.name_of(v).to_string()).collect();
        all.sort();
        assert_eq!(trained, all);
    }
}
