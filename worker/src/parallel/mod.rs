//! How the ranks of a layout share one model's training (DESIGN.md, "Parallelism"): each
//! scheme's plan, and the data-parallel schemes' per-step execution behind one trait.
//!
//! - `data`: the replicas' gradients averaged (one all-reduce after the backward pass, or in
//!   buckets during it: `overlap`) or combined by Adasum (`adasum`'s schedule).
//! - `zero`: ZeRO stages 1 and 2, the optimizer state (and gradients) split among the replicas.
//! - `pipeline`: the forward graph cut into pipeline stages (balanced cuts, or the user's);
//!   `schedule`: the order of a stage's forward and backward passes and its messages (1F1B,
//!   GPipe); `stage`: one rank's stage, its boundary and a step's passes in that order.
//! - `tensor`: Megatron's tensor parallelism as a pass over the bound forward graph (column- and
//!   row-parallel pairs, vocab-parallel embedding and cross-entropy) and `TensorSplit`, how a
//!   weight is divided among the tensor-parallel ranks.
//!
//! A session chooses its [`GradientSync`] once, when it joins its groups ([`choose`]), and its
//! step calls it at four points: after each micro-batch, after the last, for the gradient norm
//! and for the update. Nothing in a step branches on how the replicas combine their gradients.

pub mod adasum;
pub mod data;
pub mod overlap;
pub mod pipeline;
pub mod schedule;
pub mod stage;
pub mod tensor;
pub mod zero;

pub use overlap::CommSpan;

use crate::backend::{Backend, Group};
use crate::error::{Error, Result};
use crate::exec::optimizer::{OptimizerState, StepValues};
use crate::exec::Executor;
use crate::tensor::Tensor;

/// What a gradient sync works on: the executor that computed this rank's gradients, its
/// optimizer state, and its data-parallel group (None: the rank trains alone).
pub struct Replicas<'a, B: Backend> {
    pub ex: &'a Executor<B>,
    pub optimizer: &'a OptimizerState<B>,
    pub group: Option<&'a Group<B>>,
}

/// A piece of optimizer state a rank writes beside the whole ones: state `k` of weight
/// `weight` (an index into the optimizer state), from element `start` of the flat tensor.
pub struct StatePiece {
    pub weight: usize,
    pub k: usize,
    pub start: usize,
    pub value: Tensor,
}

/// How the data-parallel replicas' gradients become one update (DESIGN.md, "Parallelism").
pub trait GradientSync<B: Backend> {
    /// Runs the step's last micro-batch (of `n`) with its communication overlapping the
    /// backward pass, and reduces its gradients; false where this sync does not overlap (the
    /// caller runs the micro-batch and calls `micro_batch_done`).
    fn run_last_overlapped(
        &mut self,
        _ex: &mut Executor<B>,
        _on: (&OptimizerState<B>, Option<&Group<B>>),
        _seed: u64,
        _n: usize,
    ) -> Result<bool> {
        Ok(false)
    }

    /// Micro-batch `k` of `n` has run its backward pass: its gradients join the step's.
    fn micro_batch_done(&mut self, r: &Replicas<B>, k: usize, n: usize) -> Result<()>;

    /// Every micro-batch has run: the gradients become the replicas' combination, the
    /// gradient of the loss over the global batch, so that the updates agree everywhere.
    fn reduce(&mut self, r: &Replicas<B>) -> Result<()>;

    /// Σ g² of the global gradients this rank counts (every weight once over the replicas'
    /// shards; the caller sums over stages and tensor-parallel ranks).
    fn sum_squares(&self, r: &Replicas<B>) -> Result<f64>;

    /// Updates the weights, leaving every replica with the same ones.
    fn update(&mut self, r: &Replicas<B>, values: StepValues) -> Result<()>;

    /// Weight `i`'s gradient as the last update read it (before `grad_scale`).
    fn gradient(&self, r: &Replicas<B>, i: usize) -> Result<Tensor>;

    /// The optimizer state this rank keeps in pieces rather than in `Param::state`.
    fn state_pieces(&self, _r: &Replicas<B>) -> Result<Vec<StatePiece>> {
        Ok(Vec::new())
    }

    /// Takes this rank's pieces of the optimizer state from `whole(weight, k)`, state `k` of a
    /// weight as a whole checkpoint holds it.
    fn load_pieces(&mut self, _r: &Replicas<B>, _whole: &dyn Fn(usize, usize) -> Result<Tensor>) -> Result<()> {
        Ok(())
    }

    /// The gradient all-reduces of the last step as they overlapped the backward pass.
    fn comm_spans(&self) -> &[CommSpan] {
        &[]
    }
}

/// What decides a rank's gradient sync (parallelism.*).
#[derive(Clone, Debug)]
pub struct SyncOptions {
    /// ZeRO stage: 0, 1 (optimizer state split) or 2 (gradients too).
    pub zero: u8,
    pub adasum: bool,
    /// Bytes per overlapped all-reduce bucket (parallelism.bucketMb).
    pub bucket_bytes: usize,
    /// ZeRO keeps the whole mean gradient for `gradient` (an all-gather per step).
    pub report_gradients: bool,
}

/// The gradient sync of replica `rank` of `size` (`r.group`: None alone). `pipelined`: the rank
/// trains a pipeline stage, whose backward passes interleave with its neighbours', so its
/// replicas all-reduce after the schedule. `tensor_ranks`: the tensor-parallel group's size.
pub fn choose<B: Backend>(
    opts: &SyncOptions,
    r: &Replicas<B>,
    (size, rank): (usize, usize),
    pipelined: bool,
    tensor_ranks: usize,
) -> Result<Box<dyn GradientSync<B>>> {
    if opts.zero > 0 {
        return Ok(Box::new(zero::Sharded::new(r, opts, size, rank)?));
    }
    if opts.adasum {
        if !size.is_power_of_two() {
            return Err(Error::Config(format!(
                "parallelism.adasum: Adasum combines replicas in pairs, so parallelism.data must be a power of two, \
                 not {size}"
            )));
        }
        return Ok(Box::new(data::Replicated::adasum()));
    }
    match r.group {
        Some(group) if !pipelined => {
            Ok(Box::new(data::Replicated::overlapped(r, group, opts.bucket_bytes, tensor_ranks)?))
        }
        _ => Ok(Box::new(data::Replicated::average())),
    }
}
