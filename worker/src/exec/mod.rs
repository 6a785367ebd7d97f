//! Running a bound graph on a backend: the plan ([`plan`]) and the executor that owns the
//! device memory it describes.

pub mod optimizer;
pub mod plan;

use crate::backend::{Arg, Backend, Group, Scratch};
use crate::error::{Error, Result};
use crate::graph::ir::{Graph, Meta, ValueId};
use crate::op::Op;
use crate::tensor::Tensor;
use plan::{Place, Plan};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub struct Executor<B: Backend> {
    pub backend: Arc<B>,
    pub graph: Graph,
    pub plan: Plan,
    arena: B::Buffer,
    persistent: HashMap<ValueId, B::Buffer>,
    /// When Some, every run appends the timing of each op it launches (the runner turns them
    /// into a Chrome trace); None costs nothing.
    pub profile: Option<Vec<OpTiming>>,
    /// The tensor-parallel group that the graph's `AllReduce` ops reduce over (tensor
    /// parallelism's collectives run between the kernels, in graph order, on every rank).
    pub tensor_group: Option<Rc<Group<B>>>,
}

/// One op's launch, timed to completion (the backend is synchronized after it).
#[derive(Clone, Debug)]
pub struct OpTiming {
    /// Index into the graph's nodes.
    pub node: usize,
    pub start: Instant,
    pub duration: Duration,
}

/// Refuses a plan larger than the memory the device offers, before any of it is allocated: the
/// configuration decided its size, so the error (exit 2) names the keys that shrink it, with
/// the bytes needed and available. A plan that fits may still meet a full device later (other
/// processes, fragmentation): that allocation fails as the device's error, worth a retry.
fn fits<B: Backend>(backend: &B, plan: &Plan, state_bytes: usize) -> Result<()> {
    let needed = plan.arena_bytes.saturating_add(plan.persistent_bytes).saturating_add(state_bytes);
    match backend.memory_available() {
        Some(available) if needed > available => Err(Error::Config(format!(
            "batchSize: the run needs {needed} bytes on {} ({} for activations and the kernels' scratch, {} for \
             weights and their gradients, {state_bytes} for the optimizer's state) and {available} are available; \
             lower batchSize (or the model's seqLen), set recompute, or spread the model over more ranks \
             (parallelism.zero, parallelism.tensor, parallelism.pipeline)",
            backend.name(),
            plan.arena_bytes,
            plan.persistent_bytes,
        ))),
        _ => Ok(()),
    }
}

/// The scratch bytes node `i`'s launch asks `backend` for, with the node's metas.
fn scratch_of<B: Backend>(backend: &B, g: &Graph, i: usize) -> usize {
    let node = &g.nodes[i];
    let ins: Vec<Option<&Meta>> = node.inputs.iter().map(|x| x.and_then(|v| g.meta(v))).collect();
    let outs: Vec<&Meta> = node.outputs.iter().flatten().filter_map(|&v| g.meta(v)).collect();
    backend.scratch_bytes(&node.op, &ins, &outs)
}

impl<B: Backend> Executor<B> {
    /// Allocates the plan's memory and uploads the initializers. `keep` as in [`plan::plan`].
    pub fn new(backend: Arc<B>, graph: Graph, keep: &[ValueId]) -> Result<Executor<B>> {
        Self::with_state(backend, graph, keep, 0)
    }

    /// As [`Executor::new`], for a run that allocates `state_bytes` more after it (a training
    /// session's optimizer state): the plan and that state must fit together, checked before
    /// anything is allocated.
    pub fn with_state(backend: Arc<B>, graph: Graph, keep: &[ValueId], state_bytes: usize) -> Result<Executor<B>> {
        let plan = plan::plan(&graph, keep, |i| scratch_of(backend.as_ref(), &graph, i));
        fits(backend.as_ref(), &plan, state_bytes)?;
        let arena = backend.alloc(plan.arena_bytes)?;
        let mut persistent = HashMap::new();
        for (v, place) in plan.places.iter().enumerate() {
            if *place == Place::Persistent && plan.root[v] == v {
                let bytes = graph.meta(v).map_or(0, |m| m.bytes());
                persistent.insert(v, backend.alloc(bytes)?);
            }
        }
        let ex = Executor { backend, graph, plan, arena, persistent, profile: None, tensor_group: None };
        for (v, t) in &ex.graph.initializers {
            ex.backend.upload(t, ex.arg(*v))?;
        }
        Ok(ex)
    }

    /// Where value `v` lives on the device.
    pub fn arg(&self, v: ValueId) -> Arg<'_, B::Buffer> {
        let meta = self.graph.values[v].meta.as_ref().expect("bound graphs give every value a meta");
        let root = self.plan.root[v];
        match self.plan.places[v] {
            Place::Persistent => Arg { buf: &self.persistent[&root], offset: 0, meta },
            Place::Arena(offset) => Arg { buf: &self.arena, offset, meta },
            Place::Nowhere => panic!("value '{}' has no place in the plan", self.graph.name_of(v)),
        }
    }

    /// Copies a host tensor into graph input (or initializer) `v`.
    pub fn feed(&self, v: ValueId, t: &Tensor) -> Result<()> {
        let meta = self
            .graph
            .meta(v)
            .ok_or_else(|| Error::Runtime(format!("value '{}' has no meta", self.graph.name_of(v))))?;
        if meta.dtype != t.dtype() || meta.shape != t.shape() {
            return Err(Error::Config(format!(
                "input '{}' expects {}{:?} but was given {}{:?}",
                self.graph.name_of(v),
                meta.dtype,
                meta.shape,
                t.dtype(),
                t.shape()
            )));
        }
        Ok(self.backend.upload(t, self.arg(v))?)
    }

    pub fn fetch(&self, v: ValueId) -> Result<Tensor> {
        Ok(self.backend.download(self.arg(v))?)
    }

    /// Runs every step once. `seed` varies random ops (dropout) from run to run.
    pub fn run(&mut self, seed: u64) -> Result<()> {
        self.run_where(seed, |_| true)
    }

    /// The nodes that compute `values`: the part of the graph a pipeline stage runs to produce
    /// its activations for the next stage, ahead of its backward pass.
    pub fn nodes_computing(&self, values: &[ValueId]) -> Vec<bool> {
        let producers = self.graph.producers();
        let mut needed = vec![false; self.graph.nodes.len()];
        let mut stack: Vec<ValueId> = values.to_vec();
        while let Some(v) = stack.pop() {
            if let Some(n) = producers[v] {
                if !needed[n] {
                    needed[n] = true;
                    stack.extend(self.graph.nodes[n].inputs.iter().flatten().copied());
                }
            }
        }
        needed
    }

    /// Runs the steps of the nodes `selected` picks, in plan order.
    pub fn run_where(&mut self, seed: u64, selected: impl Fn(usize) -> bool) -> Result<()> {
        self.run_observed(seed, selected, &mut |_, _| Ok(()))
    }

    /// Like `run_where`, calling `after(self, node)` once each node's step has run: where the
    /// data-parallel gradient all-reduce starts on the gradients the backward pass has
    /// finished, while it goes on.
    pub fn run_observed(
        &mut self,
        seed: u64,
        selected: impl Fn(usize) -> bool,
        after: &mut dyn FnMut(&Executor<B>, usize) -> Result<()>,
    ) -> Result<()> {
        let profiling = self.profile.is_some();
        let mut times = Vec::new();
        for &i in self.plan.steps.iter().filter(|&&i| selected(i)) {
            let node = &self.graph.nodes[i];
            let seeded;
            let op = match &node.op {
                Op::Dropout { ratio, training, seed: s } if *training => {
                    seeded = Op::Dropout {
                        ratio: *ratio,
                        training: true,
                        // The node's own seed (autodiff::recompute::pin_dropout_seeds makes
                        // it unique) and the run's: a recomputed clone draws the same mask.
                        seed: crate::rng::mix(seed ^ crate::rng::mix(*s)),
                    };
                    &seeded
                }
                op => op,
            };
            let inputs: Vec<Option<Arg<B::Buffer>>> = node.inputs.iter().map(|x| x.map(|v| self.arg(v))).collect();
            let outputs: Vec<Arg<B::Buffer>> = node
                .outputs
                .iter()
                .map(|o| match o {
                    Some(v) if self.plan.places[*v] != Place::Nowhere => Ok(self.arg(*v)),
                    _ => Err(Error::Runtime(format!("{}: an output has no place in the plan", node.describe()))),
                })
                .collect::<Result<_>>()?;
            let t0 = profiling.then(Instant::now);
            let scratch = self.plan.scratch[i].map(|(offset, bytes)| Scratch { buf: &self.arena, offset, bytes });
            self.backend.launch(op, &inputs, &outputs, scratch).map_err(|e| Error::from(e.at(node.describe())))?;
            if let Op::AllReduce { op } = op {
                // The backend copied the value into place; the group reduces it there.
                let group = self.tensor_group.as_ref().ok_or_else(|| {
                    Error::Runtime(format!("{}: the executor has no tensor-parallel group", node.describe()))
                })?;
                group.all_reduce_values(&self.backend, &outputs[..1], *op)?;
            }
            if let Some(t0) = t0 {
                self.backend.synchronize()?;
                times.push(OpTiming { node: i, start: t0, duration: t0.elapsed() });
            }
            after(self, i)?;
        }
        if let Some(profile) = &mut self.profile {
            profile.extend(times);
        }
        Ok(())
    }
}
