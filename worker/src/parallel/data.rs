//! Data parallelism over whole replicas: every replica keeps the whole optimizer state, and the
//! replicas' gradients are averaged before the update (as PyTorch DDP does) — by one
//! all-reduce after the backward pass, or bucket by bucket while it runs (`overlap`) — or
//! combined by Adasum (`adasum`). Alone (no data group) the gradients are the rank's own.

use super::overlap::{CommSpan, Overlap};
use super::{GradientSync, Replicas};
use crate::backend::{Arg, Backend, Group};
use crate::comm::{ProcessGroup, ReduceOp};
use crate::error::Result;
use crate::exec::optimizer::{OptimizerState, StepValues};
use crate::exec::Executor;
use crate::tensor::Tensor;

/// Whole replicas, and how their gradients combine.
pub struct Replicated<B: Backend> {
    combine: Combine<B>,
}

enum Combine<B: Backend> {
    /// Averaged by one all-reduce after the backward pass.
    Average,
    /// Averaged in buckets while the last micro-batch's backward pass runs.
    Overlapped(Overlap),
    /// Adasum; under device collectives the partner's gradients arrive in these buffers (one
    /// per weight, allocated on the first step).
    Adasum(Vec<B::Buffer>),
}

impl<B: Backend> Replicated<B> {
    pub fn average() -> Replicated<B> {
        Replicated { combine: Combine::Average }
    }

    pub fn adasum() -> Replicated<B> {
        Replicated { combine: Combine::Adasum(Vec::new()) }
    }

    /// The average overlapping the backward pass where `group` can carry it: device collectives
    /// on a communication stream, host ones on a thread with a duplicate of the group. The
    /// stream only where the data group's is the one communicator (`tensor_ranks` is 1): NCCL
    /// can deadlock when two communicators' work runs at once on two streams (a tensor group's
    /// all-reduces beside the buckets), since nothing makes every rank launch them in one
    /// order. Elsewhere the plain average.
    pub fn overlapped(
        r: &Replicas<B>,
        group: &Group<B>,
        bucket_bytes: usize,
        tensor_ranks: usize,
    ) -> Result<Replicated<B>> {
        let carrier = match group.on_device() {
            true => (tensor_ranks == 1).then_some(None),
            false => group.detach().map(Some),
        };
        let Some(host) = carrier else { return Ok(Replicated::average()) };
        let o = Overlap::new(r.ex, r.optimizer, host, bucket_bytes)?;
        tracing::debug!(buckets = o.bucket_count(), "gradient all-reduce overlaps the backward pass");
        Ok(Replicated { combine: Combine::Overlapped(o) })
    }
}

impl<B: Backend> GradientSync<B> for Replicated<B> {
    fn run_last_overlapped(
        &mut self,
        ex: &mut Executor<B>,
        (optimizer, group): (&OptimizerState<B>, Option<&Group<B>>),
        seed: u64,
        n: usize,
    ) -> Result<bool> {
        let (Combine::Overlapped(overlap), Some(group)) = (&mut self.combine, group) else { return Ok(false) };
        // Each bucket's all-reduce starts as soon as the backward pass has finished its
        // gradients; this micro-batch's are added to the accumulated ones first.
        let scale = (n > 1).then_some(1.0 / n as f32);
        let params = &optimizer.params;
        ex.run_observed(seed, |_| true, &mut |ex, node| overlap.node_done(ex, params, group, node, scale))?;
        overlap.finish(ex, params, group)?;
        Ok(true)
    }

    fn micro_batch_done(&mut self, r: &Replicas<B>, k: usize, n: usize) -> Result<()> {
        r.optimizer.accumulate(r.ex, k, n)
    }

    fn reduce(&mut self, r: &Replicas<B>) -> Result<()> {
        let Some(group) = r.group else { return Ok(()) };
        match &mut self.combine {
            Combine::Average => group.all_reduce_values(&r.ex.backend, &r.optimizer.gradients(r.ex), ReduceOp::Average),
            Combine::Overlapped(_) => Ok(()), // reduced during the backward pass
            Combine::Adasum(theirs) => adasum(r, group, theirs),
        }
    }

    fn sum_squares(&self, r: &Replicas<B>) -> Result<f64> {
        r.optimizer.sum_squares(r.ex)
    }

    fn update(&mut self, r: &Replicas<B>, values: StepValues) -> Result<()> {
        r.optimizer.update(r.ex, values)
    }

    fn gradient(&self, r: &Replicas<B>, i: usize) -> Result<Tensor> {
        Ok(r.ex.backend.download(r.optimizer.params[i].gradient(r.ex))?)
    }

    fn comm_spans(&self) -> &[CommSpan] {
        match &self.combine {
            Combine::Overlapped(o) => &o.spans,
            _ => &[],
        }
    }
}

/// Replaces every gradient with the Adasum of the replicas' (see `parallel::adasum`): with
/// device collectives, exchanged by them and combined by the backend, without a wait;
/// otherwise in host memory over MPI.
fn adasum<B: Backend>(r: &Replicas<B>, group: &Group<B>, theirs: &mut Vec<B::Buffer>) -> Result<()> {
    let backend = &*r.ex.backend;
    let mine = r.optimizer.gradients(r.ex);
    if group.on_device() {
        if theirs.is_empty() {
            *theirs = mine.iter().map(|g| Ok(backend.alloc(g.meta.bytes())?)).collect::<Result<_>>()?;
        }
        let theirs: Vec<Arg<B::Buffer>> =
            theirs.iter().zip(&mine).map(|(buf, g)| Arg { buf, offset: 0, meta: g.meta }).collect();
        return super::adasum::recursive_doubling(group.size(), group.rank(), |partner, mine_is_lower| {
            for (m, t) in mine.iter().zip(&theirs) {
                group.send_recv_values(backend, *m, partner, *t, partner)?;
            }
            Ok(backend.adasum(&mine, &theirs, mine_is_lower)?)
        });
    }
    let mut grads: Vec<Vec<f32>> = mine.iter().map(|&g| crate::backend::read_f32(backend, g)).collect::<Result<_>>()?;
    let mut views: Vec<&mut [f32]> = grads.iter_mut().map(|g| &mut g[..]).collect();
    super::adasum::all_reduce(&**group, &mut views)?;
    for (&g, values) in mine.iter().zip(&grads) {
        crate::backend::write_f32(backend, g, values)?;
    }
    Ok(())
}
