//! One rank's pipeline stage: its part of the training graph, its boundary with its
//! neighbours, and a step's forward and backward passes over the micro-batches in the order of
//! its schedule (`pipeline` cuts the graph, `schedule` orders the work; the session trains the
//! stage).
//!
//! A stage's training graph is its forward part plus the backward pass of a stand-in loss: on
//! the last stage the model's loss; elsewhere Σ_v sum(v ⊙ dv) over the activations v it sends,
//! with dv the gradient the next stage returns for v (a graph input), whose gradient with
//! respect to v is exactly dv. Its outputs include the gradients of the activations it
//! received, which go back to the previous stage.
//!
//! A micro-batch's forward pass runs only the nodes that compute the activations to send, and
//! its backward pass runs the whole training graph, computing the forward part again: a stage
//! keeps only its received activations between the two (GPipe's re-materialization at stage
//! boundaries), at the cost of one more forward pass on every stage but the last.
//!
//! The messages between stages live in the backend's memory: a stage copies the values it
//! sends end to end into a message buffer and the values it receives out of one, and the
//! pipeline group carries the buffers (NCCL's send and receive on GPUs; host memory and MPI
//! elsewhere).

use super::pipeline;
use super::schedule::{self, Action};
use crate::autodiff::Builder;
use crate::backend::{Arg, Backend, Group};
use crate::comm::{Collective, HostGroup};
use crate::config::PipelineSchedule;
use crate::error::{Error, Result};
use crate::exec::optimizer::OptimizerState;
use crate::exec::Executor;
use crate::graph::ir::{Dim, Graph, InputDecl, Meta, ValueId};
use crate::op::{Binary, Op, Reduce};
use crate::tensor::{DType, Tensor};
use std::collections::BTreeMap;

/// Which pipeline stage a session trains, and how.
#[derive(Clone, Debug)]
pub struct PipelineOptions {
    pub stage: usize,
    pub stages: usize,
    /// parallelism.pipelineCuts; empty: balanced automatically.
    pub cuts: Vec<Vec<String>>,
    pub schedule: PipelineSchedule,
}

/// This rank's stage and its boundary.
pub struct StagePart {
    pub index: usize,
    pub count: usize,
    schedule: PipelineSchedule,
    /// Where the stages meet, as value names (the evaluation graph is cut at the same places).
    cuts: Vec<Vec<String>>,
    /// Activations from the previous stage (graph inputs), in message order.
    pub receives: Vec<ValueId>,
    /// The gradient of each received activation (None: the stage's loss does not depend on it,
    /// so zeros go back).
    input_grads: Vec<Option<ValueId>>,
    /// Activations for the next stage, in message order.
    pub sends: Vec<ValueId>,
    /// The gradients of `sends` that the next stage returns (graph inputs).
    send_grads: Vec<ValueId>,
    /// Nodes of the training graph a micro-batch's forward pass runs.
    forward_nodes: Vec<bool>,
    /// Trained weights held by more than one stage, by name: their gradients are summed.
    pub shared: Vec<(String, Meta)>,
    /// Every stage's trained weights that it is first to hold, by name (export gathers them).
    owned: Vec<Vec<(String, Meta)>>,
}

/// What `cut` gives the session: the stage's forward graph, its loss, its boundary, and the
/// trained weights each stage holds.
pub type Cut = (Graph, ValueId, Option<StagePart>, Vec<Vec<ValueId>>);

/// The graph, loss and boundary of stage `opts.stage` of `bound` (the forward graph in
/// training mode), and the trained weights (of `params`) each stage holds.
pub fn cut(bound: Graph, loss: ValueId, opts: &PipelineOptions, params: &[ValueId]) -> Result<Cut> {
    let cuts = if opts.cuts.is_empty() {
        pipeline::balanced_cuts(&bound, loss, opts.stages, params)?
    } else {
        opts.cuts.clone()
    };
    let mut stages = pipeline::split(&bound, loss, &cuts)?;
    if stages.len() != opts.stages {
        return Err(Error::Config(format!(
            "parallelism.pipelineCuts make {} stages, but parallelism.pipeline is {}",
            stages.len(),
            opts.stages
        )));
    }
    let held: Vec<Vec<ValueId>> = stages
        .iter()
        .map(|s| params.iter().copied().filter(|v| s.graph.initializers.contains_key(v)).collect())
        .collect();
    let meta = |v: ValueId| bound.meta(v).cloned().expect("bound");
    let named = |v: ValueId| (bound.name_of(v).to_string(), meta(v));
    let first_holder = |v: ValueId| held.iter().position(|h| h.contains(&v));
    let shared =
        params.iter().copied().filter(|v| held.iter().filter(|h| h.contains(v)).count() > 1).map(named).collect();
    let owned = (0..stages.len())
        .map(|s| held[s].iter().copied().filter(|&v| first_holder(v) == Some(s)).map(named).collect())
        .collect();
    let stage = stages.swap_remove(opts.stage);
    let mut g = stage.graph;
    let mut send_grads = Vec::new();
    let stage_loss = if let Some(last) = stage.loss {
        last
    } else {
        // The stand-in loss Σ_v sum(v ⊙ dv).
        let mut b = Builder { g: &mut g };
        let mut total: Option<ValueId> = None;
        for &v in &stage.sends {
            let m = b.meta(v);
            let dv = b.g.fresh(&format!("{}:grad_from_next_stage", b.g.name_of(v)));
            b.g.values[dv].meta = Some(m.clone());
            let dims = m.shape.iter().map(|&d| Dim::Fixed(d)).collect();
            b.g.inputs.push(InputDecl { value: dv, dtype: DType::F32, dims });
            let name = b.g.name_of(dv).to_string();
            let dot = b.emit1(&format!("{name}.mul"), Op::Binary(Binary::Mul), &[v, dv])?;
            let axes = Some((0..m.shape.len() as i64).collect());
            let reduce = Op::ReduceOp { kind: Reduce::Sum, axes, keepdims: false, noop_with_empty_axes: false };
            let sum = b.emit1(&format!("{name}.sum"), reduce, &[dot])?;
            total = Some(match total {
                None => sum,
                Some(t) => b.emit1(&format!("{name}.total"), Op::Binary(Binary::Add), &[t, sum])?,
            });
            send_grads.push(dv);
        }
        total.ok_or_else(|| {
            Error::Config(format!("pipeline stage {} sends nothing to the next stage; move the cuts", opts.stage))
        })?
    };
    let part = StagePart {
        index: opts.stage,
        count: opts.stages,
        schedule: opts.schedule,
        cuts,
        receives: stage.receives,
        input_grads: vec![],
        sends: stage.sends,
        send_grads,
        forward_nodes: vec![],
        shared,
        owned,
    };
    Ok((g, stage_loss, Some(part), held))
}

/// One message's buffer: `len` f32 in the backend's memory, zeroed.
fn message<B: Backend>(ex: &Executor<B>, len: usize) -> Result<B::Buffer> {
    Ok(ex.backend.alloc(len * 4)?)
}

/// The whole of a message buffer, as one value.
fn whole<'a, B: Backend>(buf: &'a B::Buffer, meta: &'a Meta) -> Arg<'a, B::Buffer> {
    Arg { buf, offset: 0, meta }
}

/// Each value's place in a message: its f32 elements, end to end. Messages carry f32 only
/// (the activations at a cut keep their type under mixed precision, and that type is f32).
fn places<'a>(g: &'a Graph, values: &[ValueId]) -> Result<Vec<(usize, &'a Meta)>> {
    let mut at = 0;
    values
        .iter()
        .map(|&v| {
            let meta = g.meta(v).expect("bound");
            if meta.dtype != DType::F32 {
                return Err(Error::Runtime(format!(
                    "pipeline messages carry f32; '{}' at a stage boundary is {}",
                    g.name_of(v),
                    meta.dtype
                )));
            }
            let place = (at, meta);
            at += meta.numel();
            Ok(place)
        })
        .collect()
}

/// Copies `values` into the message `into`, end to end (on the device). A None leaves its place
/// as it is: zero, since nothing else writes it.
fn pack<B: Backend>(ex: &Executor<B>, values: &[Option<ValueId>], like: &[ValueId], into: &B::Buffer) -> Result<()> {
    for (v, (at, meta)) in values.iter().zip(places(&ex.graph, like)?) {
        if let Some(v) = v {
            let dst = Arg { buf: into, offset: at * 4, meta };
            ex.backend.accumulate(dst, 0.0, ex.arg(*v), 1.0)?;
        }
    }
    Ok(())
}

/// Copies the message `from` into the graph inputs `values` (on the device).
fn unpack<B: Backend>(ex: &Executor<B>, values: &[ValueId], from: &B::Buffer) -> Result<()> {
    for (&v, (at, meta)) in values.iter().zip(places(&ex.graph, values)?) {
        let src = Arg { buf: from, offset: at * 4, meta };
        ex.backend.accumulate(ex.arg(v), 0.0, src, 1.0)?;
    }
    Ok(())
}

fn message_len(g: &Graph, values: &[ValueId]) -> usize {
    values.iter().map(|&v| g.meta(v).expect("bound").numel()).sum()
}

impl StagePart {
    pub fn is_last(&self) -> bool {
        self.index + 1 == self.count
    }

    /// Records what the planned training graph computes: the gradients of the received
    /// activations, and the nodes a forward pass runs.
    pub fn plan(&mut self, train: &Executor<impl Backend>, input_grads: Vec<Option<ValueId>>) {
        self.input_grads = input_grads;
        self.forward_nodes = train.nodes_computing(&self.sends);
    }

    /// This stage's part of the evaluation graph (bound in inference mode), cut where the
    /// training graph was.
    pub fn eval_graph(&self, bound: Graph, loss: ValueId) -> Result<Graph> {
        Ok(pipeline::split(&bound, loss, &self.cuts)?.swap_remove(self.index).graph)
    }

    /// Feeds the previous stage's activations into `ex` (nothing on the first stage).
    pub fn recv_activations<B: Backend>(&self, ex: &Executor<B>, group: &Group<B>) -> Result<()> {
        if self.index > 0 {
            let meta = Meta::new(DType::F32, &[message_len(&ex.graph, &self.receives)]);
            let flat = message(ex, meta.numel())?;
            group.recv_value(&ex.backend, whole::<B>(&flat, &meta), self.index - 1)?;
            unpack(ex, &self.receives, &flat)?;
        }
        Ok(())
    }

    /// Sends the activations `ex` computed to the next stage (nothing on the last stage).
    pub fn send_activations<B: Backend>(&self, ex: &Executor<B>, group: &Group<B>) -> Result<()> {
        if !self.is_last() {
            let meta = Meta::new(DType::F32, &[message_len(&ex.graph, &self.sends)]);
            let flat = message(ex, meta.numel())?;
            let sends: Vec<Option<ValueId>> = self.sends.iter().map(|&v| Some(v)).collect();
            pack(ex, &sends, &self.sends, &flat)?;
            group.send_value(&ex.backend, whole::<B>(&flat, &meta), self.index + 1)?;
        }
        Ok(())
    }

    /// Collects every stage's trained weights on stage 0 (this stage's are those of
    /// `optimizer` in `ex`): each later stage sends the weights it is first to hold, in order.
    pub fn gather_weights<B: Backend>(
        &self,
        ex: &Executor<B>,
        optimizer: &OptimizerState<B>,
        group: &HostGroup,
    ) -> Result<Option<BTreeMap<String, Tensor>>> {
        if self.index > 0 {
            for p in optimizer.params.iter().filter(|p| p.first_stage) {
                let w = ex.fetch(p.value)?;
                group.send(w.as_slice::<f32>(), 0)?;
            }
            return Ok(None);
        }
        let mut out = optimizer.weights(ex)?;
        for (s, weights) in self.owned.iter().enumerate().skip(1) {
            for (name, meta) in weights {
                let mut buf = vec![0f32; meta.numel()];
                group.recv(&mut buf[..], s)?;
                out.insert(name.clone(), Tensor::from_vec(&meta.shape, buf));
            }
        }
        Ok(Some(out))
    }

    /// One step's forward and backward passes of `n` micro-batches on this stage, in the
    /// schedule's order, exchanging activations and their gradients over `group` through
    /// `messages` (allocated on the first step and kept). `feed(ex, mb)` gives the executor
    /// micro-batch `mb`'s data; `done(ex, mb)` follows the run that computed its gradients.
    pub fn run_step<B: Backend>(
        &self,
        ex: &mut Executor<B>,
        group: &Group<B>,
        messages: &mut Vec<Messages<B>>,
        (n, seed): (usize, u64),
        feed: &dyn Fn(&Executor<B>, usize) -> Result<()>,
        done: &mut dyn FnMut(&Executor<B>, usize) -> Result<()>,
    ) -> Result<()> {
        let (prev, next) = (self.index.wrapping_sub(1), self.index + 1);
        let ins = Meta::new(DType::F32, &[message_len(&ex.graph, &self.receives)]);
        let outs = Meta::new(DType::F32, &[message_len(&ex.graph, &self.sends)]);
        while messages.len() < n {
            let (acts, grads_out) = (message(ex, ins.numel())?, message(ex, ins.numel())?);
            let (outs, grads_in) = (message(ex, outs.numel())?, message(ex, outs.numel())?);
            messages.push(Messages { acts, outs, grads_in, grads_out });
        }
        let backend = ex.backend.clone();
        let m = |mb: usize| &messages[mb];
        for action in schedule::actions(self.schedule, self.index, self.count, n) {
            match action {
                Action::RecvForward(mb) => group.recv_value(&backend, whole::<B>(&m(mb).acts, &ins), prev)?,
                Action::Forward(mb) => {
                    let m = m(mb);
                    feed(ex, mb)?;
                    unpack(ex, &self.receives, &m.acts)?;
                    let seed = crate::rng::mix(seed ^ mb as u64);
                    if self.is_last() {
                        // The loss is here: forward and backward in one run.
                        ex.run(seed)?;
                        done(ex, mb)?;
                        pack(ex, &self.input_grads, &self.receives, &m.grads_out)?;
                    } else {
                        let nodes = &self.forward_nodes;
                        ex.run_where(seed, |i| nodes[i])?;
                        let sends: Vec<Option<ValueId>> = self.sends.iter().map(|&v| Some(v)).collect();
                        pack(ex, &sends, &self.sends, &m.outs)?;
                    }
                }
                Action::SendForward(mb) => group.send_value(&backend, whole::<B>(&m(mb).outs, &outs), next)?,
                Action::RecvBackward(mb) => group.recv_value(&backend, whole::<B>(&m(mb).grads_in, &outs), next)?,
                Action::Backward(mb) => {
                    let m = m(mb);
                    if !self.is_last() {
                        feed(ex, mb)?;
                        unpack(ex, &self.receives, &m.acts)?;
                        unpack(ex, &self.send_grads, &m.grads_in)?;
                        ex.run(crate::rng::mix(seed ^ mb as u64))?;
                        done(ex, mb)?;
                        if self.index > 0 {
                            pack(ex, &self.input_grads, &self.receives, &m.grads_out)?;
                        }
                    }
                }
                Action::SendBackward(mb) => group.send_value(&backend, whole::<B>(&m(mb).grads_out, &ins), prev)?,
                Action::SendForwardRecvBackward { send, recv } => group.send_recv_values(
                    &backend,
                    whole::<B>(&m(send).outs, &outs),
                    next,
                    whole::<B>(&m(recv).grads_in, &outs),
                    next,
                )?,
                Action::SendBackwardRecvForward { send, recv } => group.send_recv_values(
                    &backend,
                    whole::<B>(&m(send).grads_out, &ins),
                    prev,
                    whole::<B>(&m(recv).acts, &ins),
                    prev,
                )?,
            }
        }
        Ok(())
    }
}

/// One micro-batch's messages on a stage, in the backend's memory (f32, kept across steps):
/// the activations received (kept for its backward pass), the activations sent, the gradients
/// received for them, and the gradients sent back.
pub struct Messages<B: Backend> {
    acts: B::Buffer,
    outs: B::Buffer,
    grads_in: B::Buffer,
    grads_out: B::Buffer,
}
