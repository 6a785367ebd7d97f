//! The optimizer state: every trained weight of an executor's graph with its gradient, its
//! update rule and the device buffers the update keeps beside it (momentum or Adam's moments,
//! and the gradient summed over micro-batches). How the replicas' gradients are combined before
//! the update, and who updates what, is `parallel`'s (`GradientSync`); this is one rank's
//! whole-weight state and the update over it.

use super::Executor;
use crate::backend::{Arg, Backend, Slot};
use crate::error::Result;
use crate::graph::ir::{Meta, ValueId};
use crate::optim::{StepHyper, Update};
use crate::tensor::Tensor;
use std::collections::BTreeMap;

/// A trained weight and its device-side companions.
pub struct Param<B: Backend> {
    pub value: ValueId,
    pub grad: ValueId,
    pub update: Update,
    /// Multiplies the scheduled learning rate (optimizer.groups[].lrScale).
    pub lr_scale: f64,
    /// Optimizer state (momentum, or Adam's moments); empty where ZeRO keeps a shard of it.
    pub state: Vec<B::Buffer>,
    /// The sum of micro-batch gradients, when accumulating whole gradients.
    pub accum: Option<B::Buffer>,
    /// This stage is the first that holds the weight (it sends it for export).
    pub first_stage: bool,
    /// This rank counts the weight in the gradient norm and writes it to checkpoints: its first
    /// stage does, on tensor-parallel rank 0 unless the weight is split (then every rank writes
    /// its slice).
    pub owner: bool,
}

impl<B: Backend> Param<B> {
    /// Where the update reads the gradient: the accumulator, or the graph's output.
    pub fn gradient<'a>(&'a self, ex: &'a Executor<B>) -> Arg<'a, B::Buffer> {
        let g = ex.arg(self.grad);
        match &self.accum {
            Some(buf) => Arg { buf, offset: 0, meta: g.meta },
            None => g,
        }
    }

    /// The weight's shape and type.
    pub fn meta<'a>(&self, ex: &'a Executor<B>) -> &'a Meta {
        ex.graph.meta(self.value).expect("a trained weight is bound")
    }
}

/// One rank's trained weights, in the training graph's order.
pub struct OptimizerState<B: Backend> {
    pub params: Vec<Param<B>>,
}

/// The update's step-wide values: the scheduled learning rate, the step number (1 for the
/// first update) and what multiplies every gradient (clipping, the loss scale divided out).
#[derive(Clone, Copy, Debug)]
pub struct StepValues {
    pub lr: f64,
    pub step: u64,
    pub grad_scale: f64,
}

impl<B: Backend> OptimizerState<B> {
    /// Adds micro-batch `k` of `n`'s gradients, divided by `n`, to the accumulated ones: the
    /// gradient of the mean loss (nothing to do for a single micro-batch).
    pub fn accumulate(&self, ex: &Executor<B>, k: usize, n: usize) -> Result<()> {
        if n == 1 {
            return Ok(());
        }
        for p in &self.params {
            let g = ex.arg(p.grad);
            let acc = Arg { buf: p.accum.as_ref().expect("allocated when accumulating"), offset: 0, meta: g.meta };
            let keep = if k == 0 { 0.0 } else { 1.0 };
            ex.backend.accumulate(acc, keep, g, 1.0 / n as f32)?;
        }
        Ok(())
    }

    /// Updates every whole weight with its gradient and state.
    pub fn update(&self, ex: &Executor<B>, values: StepValues) -> Result<()> {
        let slots = self.params.iter().map(|p| {
            let meta = p.meta(ex);
            let state = p.state.iter().map(|buf| Arg { buf, offset: 0, meta }).collect();
            (p, Slot { param: ex.arg(p.value), grad: p.gradient(ex), state })
        });
        update_in_groups(&*ex.backend, values, slots)
    }

    /// Σ g² over the gradients of the weights this rank counts (`Param::owner`).
    pub fn sum_squares(&self, ex: &Executor<B>) -> Result<f64> {
        let grads: Vec<Arg<B::Buffer>> = self.params.iter().filter(|p| p.owner).map(|p| p.gradient(ex)).collect();
        Ok(ex.backend.sum_squares(&grads)?)
    }

    /// Every weight by name, as it is now.
    pub fn weights(&self, ex: &Executor<B>) -> Result<BTreeMap<String, Tensor>> {
        self.params.iter().map(|p| Ok((ex.graph.name_of(p.value).to_string(), ex.fetch(p.value)?))).collect()
    }

    /// Every weight's gradient as the update reads it.
    pub fn gradients<'a>(&'a self, ex: &'a Executor<B>) -> Vec<Arg<'a, B::Buffer>> {
        self.params.iter().map(|p| p.gradient(ex)).collect()
    }
}

/// Updates every slot (a weight, or ZeRO's piece of one) by parameter group: the weights that
/// share an update rule and a learning-rate scale go to the backend together (one launch on a
/// GPU).
pub fn update_in_groups<'a, B: Backend + 'a>(
    backend: &B,
    values: StepValues,
    slots: impl IntoIterator<Item = (&'a Param<B>, Slot<'a, B::Buffer>)>,
) -> Result<()> {
    // Each group with its first weight, which says the group's update and scale.
    let mut groups: Vec<(&Param<B>, Vec<_>)> = Vec::new();
    for (p, slot) in slots {
        match groups.iter_mut().find(|(first, _)| first.update == p.update && first.lr_scale == p.lr_scale) {
            Some((_, group)) => group.push(slot),
            None => groups.push((p, vec![slot])),
        }
    }
    for (first, group) in &groups {
        let hyper = StepHyper {
            lr: (values.lr * first.lr_scale) as f32,
            step: values.step,
            grad_scale: values.grad_scale as f32,
        };
        backend.optimizer_step(&first.update, hyper, group)?;
    }
    Ok(())
}
