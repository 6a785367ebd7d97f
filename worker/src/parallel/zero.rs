//! ZeRO's partition of the training state among the data-parallel ranks (Rajbhandari et al.,
//! stages 1 and 2, as DeepSpeed lays them out).
//!
//! The weights, in the optimizer state's order, are laid end to end as one flat f32 vector of `total`
//! elements, padded to `ranks · shard` so that every rank owns an equal, contiguous `shard`:
//!
//! ```text
//!   flat:  | w0 ........ | w1 .... | w2 ............... |pad|
//!   owner: |   rank 0        |   rank 1       |  rank 2    |
//! ```
//!
//! A rank's shard cuts across weights, so what it owns is a list of pieces (a weight, a range of
//! its elements, and where that range sits in the shard). Updates are element-wise (SGD, Adam,
//! AdamW), so a piece updates like the whole weight would; LAMB, whose trust ratio needs a
//! whole weight's norms, is refused with ZeRO (as DeepSpeed's ZeRO refuses it).
//!
//! A step ([`Sharded`]): the gradients are laid end to end and reduce-scattered (averaged), so
//! each replica holds the mean gradient of its shard only; the global norm sums the shards'
//! squares; each replica updates its shard of the weights with its shard of the optimizer
//! state; the updated shards are all-gathered into every replica's whole weights. Stage 1
//! reduce-scatters once per step, after accumulating whole gradients; stage 2 reduce-scatters
//! each micro-batch's gradient at once and accumulates only its shard, keeping no whole
//! accumulation buffers. (The executor's arena still holds one micro-batch's whole gradient
//! while the backward pass runs.)
//!
//! Everything stays in the backend's memory: the flat vector is a device buffer that the
//! gradients are copied into and the updated shards gathered into, and the collectives are the
//! data group's (NCCL's reduce-scatter and all-gather on GPUs; through host memory and MPI
//! elsewhere).

use super::{GradientSync, Replicas, StatePiece, SyncOptions};
use crate::backend::{Arg, Backend, Slot};
use crate::comm::{Collective, ReduceOp};
use crate::error::{Error, Result};
use crate::exec::optimizer::{update_in_groups, StepValues};
use crate::graph::ir::Meta;
use crate::optim::Update;
use crate::tensor::{DType, Tensor};

/// A contiguous range of one weight's (flattened) elements inside a rank's shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Index of the weight in the optimizer state's order.
    pub weight: usize,
    /// First element of the range within the weight.
    pub start: usize,
    pub len: usize,
    /// Where the range starts within the shard.
    pub at: usize,
}

/// Where every weight sits in the flat vector, and each rank's shard of it.
#[derive(Clone, Debug)]
pub struct FlatLayout {
    /// Element offset of each weight in the flat vector.
    pub offsets: Vec<usize>,
    /// Elements of each weight.
    pub lens: Vec<usize>,
    /// Elements of all weights, unpadded.
    pub total: usize,
    /// Elements each rank owns (the last rank's shard ends in padding).
    pub shard: usize,
    pub ranks: usize,
}

impl FlatLayout {
    pub fn new(lens: &[usize], ranks: usize) -> FlatLayout {
        let mut offsets = Vec::with_capacity(lens.len());
        let mut total = 0;
        for &n in lens {
            offsets.push(total);
            total += n;
        }
        FlatLayout { offsets, lens: lens.to_vec(), total, shard: total.div_ceil(ranks.max(1)), ranks: ranks.max(1) }
    }

    /// Elements of the padded flat vector: what reduce-scatter and all-gather move.
    pub fn padded(&self) -> usize {
        self.shard * self.ranks
    }

    /// The pieces of `rank`'s shard, in flat order.
    pub fn pieces(&self, rank: usize) -> Vec<Piece> {
        let (lo, hi) = (rank * self.shard, ((rank + 1) * self.shard).min(self.total));
        let mut out = Vec::new();
        for (w, (&off, &n)) in self.offsets.iter().zip(&self.lens).enumerate() {
            let (a, b) = (off.max(lo), (off + n).min(hi));
            if a < b {
                out.push(Piece { weight: w, start: a - off, len: b - a, at: a - lo });
            }
        }
        out
    }
}

/// The buffers of a weight's shape a rank allocates beside it at ZeRO stage `zero` (0: off):
/// how many optimizer state tensors (none under ZeRO, whose shard of them [`Sharded::new`]
/// allocates when the replicas are known), and whether a gradient accumulator (not at stage 2,
/// which accumulates only its shard: `Sharded` reads `Param::gradient`, which would be a stale
/// accumulator if one were allocated).
pub fn whole_buffers(zero: u8, update: &Update, accumulation: usize) -> (usize, bool) {
    let state = if zero > 0 { 0 } else { update.state_count() };
    (state, accumulation > 1 && zero < 2)
}

/// Bytes [`Sharded::new`] allocates on the replica of `replicas` whose pieces hold the most
/// optimizer state, for weights of `lens` elements keeping `counts` state tensors each: that
/// state, the padded flat vector, and the shard's gradient and part.
pub fn largest_shard_bytes(lens: &[usize], counts: &[usize], replicas: usize) -> usize {
    let layout = FlatLayout::new(lens, replicas);
    let state = |rank| layout.pieces(rank).iter().map(|p| counts[p.weight] * p.len).sum::<usize>();
    let largest = (0..layout.ranks).map(state).max().unwrap_or(0);
    largest.saturating_add(layout.padded()).saturating_add(2 * layout.shard).saturating_mul(4)
}

/// This replica's shard of the training state, and how it steps.
pub struct Sharded<B: Backend> {
    /// ZeRO stage: 1 or 2.
    stage: u8,
    layout: FlatLayout,
    /// This replica's place among the data-parallel replicas.
    rank: usize,
    pieces: Vec<Piece>,
    /// f32 [len] of each piece.
    metas: Vec<Meta>,
    /// The optimizer state of each piece.
    state: Vec<Vec<B::Buffer>>,
    /// The flat vector (f32 [layout.padded()]): the gradients laid end to end for the
    /// reduce-scatter, then the updated shards gathered. Its padding stays zero.
    flat: B::Buffer,
    /// This replica's shard of the step's mean gradient (f32 [layout.shard]), which the
    /// optimizer reads.
    grad: B::Buffer,
    /// ZeRO-2: one micro-batch's shard, before it is added to `grad`.
    part: B::Buffer,
    /// f32 [layout.padded()] and f32 [layout.shard]: the flat vector's meta and a shard's.
    flat_meta: Meta,
    shard_meta: Meta,
    /// The whole mean gradient (flat), kept after each update when `report_gradients`.
    report_gradients: bool,
    reported: Option<Vec<f32>>,
}

impl<B: Backend> Sharded<B> {
    /// The shard of replica `rank` of `ranks` for the weights of `r`, its optimizer state
    /// allocated (zeroed, as a fresh optimizer's).
    pub fn new(r: &Replicas<B>, opts: &SyncOptions, ranks: usize, rank: usize) -> Result<Sharded<B>> {
        let params = &r.optimizer.params;
        if params.iter().any(|p| matches!(p.update, Update::Lamb { .. })) {
            return Err(Error::Config(
                "parallelism.zero: LAMB's trust ratio needs each weight whole, which ZeRO splits; use adam, adamw \
                 or sgd with ZeRO, or parallelism.zero: 0"
                    .into(),
            ));
        }
        let lens: Vec<usize> = params.iter().map(|p| p.meta(r.ex).numel()).collect();
        let layout = FlatLayout::new(&lens, ranks);
        let pieces = layout.pieces(rank);
        let backend = &r.ex.backend;
        let metas: Vec<Meta> = pieces.iter().map(|p| Meta::new(DType::F32, &[p.len])).collect();
        let mut state = Vec::with_capacity(pieces.len());
        for (piece, meta) in pieces.iter().zip(&metas) {
            let count = params[piece.weight].update.state_count();
            state.push((0..count).map(|_| Ok(backend.alloc(meta.bytes())?)).collect::<Result<_>>()?);
        }
        let alloc = |elements: usize| backend.alloc(elements * 4);
        let (flat, grad, part) = (alloc(layout.padded())?, alloc(layout.shard)?, alloc(layout.shard)?);
        let (flat_meta, shard_meta) =
            (Meta::new(DType::F32, &[layout.padded()]), Meta::new(DType::F32, &[layout.shard]));
        Ok(Sharded {
            stage: opts.zero,
            layout,
            rank,
            pieces,
            metas,
            state,
            flat,
            grad,
            part,
            flat_meta,
            shard_meta,
            report_gradients: opts.report_gradients,
            reported: None,
        })
    }

    /// The flat vector from element `at`, as `meta` says (f32).
    fn flat_arg<'a>(&'a self, at: usize, meta: &'a Meta) -> Arg<'a, B::Buffer> {
        Arg { buf: &self.flat, offset: at * 4, meta }
    }

    fn shard_arg<'a>(&'a self, buf: &'a B::Buffer) -> Arg<'a, B::Buffer> {
        Arg { buf, offset: 0, meta: &self.shard_meta }
    }

    /// This replica's shard of the replicas' mean of every weight's current gradient
    /// (accumulated, or this micro-batch's), into `into` (`grad` or `part`).
    fn reduce_scatter_mean(&self, r: &Replicas<B>, into: &B::Buffer) -> Result<()> {
        let backend = &*r.ex.backend;
        for (i, g) in r.optimizer.gradients(r.ex).into_iter().enumerate() {
            backend.accumulate(self.flat_arg(self.layout.offsets[i], g.meta), 0.0, g, 1.0)?;
        }
        let recv = self.shard_arg(into);
        match r.group {
            Some(group) => {
                group.reduce_scatter_values(backend, self.flat_arg(0, &self.flat_meta), recv, ReduceOp::Average)
            }
            None => Ok(backend.accumulate(recv, 0.0, self.flat_arg(0, &self.shard_meta), 1.0)?),
        }
    }

    /// The whole mean gradient, gathered from every replica's shard, kept for `gradient`.
    fn keep_whole_gradient(&mut self, r: &Replicas<B>) -> Result<()> {
        let backend = &*r.ex.backend;
        let (padded, shard) = (&self.flat_meta, &self.shard_meta);
        let grad = self.shard_arg(&self.grad);
        match r.group {
            Some(group) => group.all_gather_values(backend, grad, self.flat_arg(0, padded))?,
            None => backend.accumulate(self.flat_arg(0, shard), 0.0, grad, 1.0)?,
        }
        let reported = backend.download(self.flat_arg(0, padded))?;
        self.reported = Some(reported.as_slice::<f32>().to_vec());
        Ok(())
    }
}

impl<B: Backend> GradientSync<B> for Sharded<B> {
    /// Stage 1 accumulates whole gradients; stage 2 reduce-scatters each micro-batch's at once
    /// and adds only its shard, divided by `n`, to the step's (as DeepSpeed's stage 2 does).
    fn micro_batch_done(&mut self, r: &Replicas<B>, k: usize, n: usize) -> Result<()> {
        if self.stage < 2 {
            return r.optimizer.accumulate(r.ex, k, n);
        }
        self.reduce_scatter_mean(r, &self.part)?;
        let keep = if k == 0 { 0.0 } else { 1.0 };
        let (grad, part) = (self.shard_arg(&self.grad), self.shard_arg(&self.part));
        Ok(r.ex.backend.accumulate(grad, keep, part, 1.0 / n as f32)?)
    }

    fn reduce(&mut self, r: &Replicas<B>) -> Result<()> {
        match self.stage {
            1 => self.reduce_scatter_mean(r, &self.grad),
            _ => Ok(()), // stage 2 reduced each micro-batch already
        }
    }

    /// Σ g² over the pieces of weights this rank counts (see `Param::owner`), summed over the
    /// replicas' shards.
    fn sum_squares(&self, r: &Replicas<B>) -> Result<f64> {
        let pieces: Vec<Arg<B::Buffer>> = (0..self.pieces.len())
            .filter(|&i| r.optimizer.params[self.pieces[i].weight].owner)
            .map(|i| Arg { buf: &self.grad, offset: self.pieces[i].at * 4, meta: &self.metas[i] })
            .collect();
        let mut sq = [r.ex.backend.sum_squares(&pieces)?];
        if let Some(group) = r.group {
            group.all_reduce(&mut sq[..], ReduceOp::Sum)?;
        }
        Ok(sq[0])
    }

    /// Updates this replica's shard of the weights, then gathers every replica's shard into
    /// the whole weights.
    fn update(&mut self, r: &Replicas<B>, values: StepValues) -> Result<()> {
        let backend = &*r.ex.backend;
        // This shard's piece of each weight it holds a piece of.
        let slot = |i: usize| {
            let piece = &self.pieces[i];
            let p = &r.optimizer.params[piece.weight];
            let meta = &self.metas[i];
            let w = r.ex.arg(p.value);
            let param = Arg { buf: w.buf, offset: w.offset + piece.start * 4, meta };
            let grad = Arg { buf: &self.grad, offset: piece.at * 4, meta };
            let state = self.state[i].iter().map(|buf| Arg { buf, offset: 0, meta }).collect();
            (p, Slot { param, grad, state })
        };
        update_in_groups(backend, values, (0..self.pieces.len()).map(slot))?;
        // The updated pieces go to this replica's part of the flat vector, every replica's
        // parts to every replica, and the flat vector back into the weights.
        let mine = self.rank * self.layout.shard;
        for (i, piece) in self.pieces.iter().enumerate() {
            let dst = self.flat_arg(mine + piece.at, &self.metas[i]);
            backend.accumulate(dst, 0.0, slot(i).1.param, 1.0)?;
        }
        if let Some(group) = r.group {
            group.all_gather_values(
                backend,
                self.flat_arg(mine, &self.shard_meta),
                self.flat_arg(0, &self.flat_meta),
            )?;
        }
        for (i, p) in r.optimizer.params.iter().enumerate() {
            let w = r.ex.arg(p.value);
            backend.accumulate(w, 0.0, self.flat_arg(self.layout.offsets[i], w.meta), 1.0)?;
        }
        if self.report_gradients {
            self.keep_whole_gradient(r)?;
        }
        Ok(())
    }

    /// Weight `i`'s gradient of the last step, from the whole gradient kept for reporting.
    fn gradient(&self, r: &Replicas<B>, i: usize) -> Result<Tensor> {
        let flat = self.reported.as_ref().ok_or_else(|| {
            Error::Runtime("under ZeRO a session reports gradients only when asked to keep them".into())
        })?;
        let at = self.layout.offsets[i];
        let shape = &r.optimizer.params[i].meta(r.ex).shape;
        Ok(Tensor::from_vec(shape, flat[at..at + self.layout.lens[i]].to_vec()))
    }

    /// The optimizer state of this replica's pieces (pieces of weights an earlier stage holds
    /// too are that stage's to write).
    fn state_pieces(&self, r: &Replicas<B>) -> Result<Vec<StatePiece>> {
        let mut out = Vec::new();
        for (i, piece) in self.pieces.iter().enumerate() {
            if !r.optimizer.params[piece.weight].owner {
                continue;
            }
            for (k, buf) in self.state[i].iter().enumerate() {
                let value = r.ex.backend.download(Arg { buf, offset: 0, meta: &self.metas[i] })?;
                out.push(StatePiece { weight: piece.weight, k, start: piece.start, value });
            }
        }
        Ok(out)
    }

    fn load_pieces(&mut self, r: &Replicas<B>, whole: &dyn Fn(usize, usize) -> Result<Tensor>) -> Result<()> {
        for (i, piece) in self.pieces.iter().enumerate() {
            for (k, buf) in self.state[i].iter().enumerate() {
                let whole = whole(piece.weight, k)?;
                let part = whole.as_slice::<f32>()[piece.start..piece.start + piece.len].to_vec();
                let t = Tensor::from_vec(&[piece.len], part);
                r.ex.backend.upload(&t, Arg { buf, offset: 0, meta: &self.metas[i] })?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every element of every weight is owned by exactly one rank, at the place the flat
    /// layout says, for many weight sizes and rank counts.
    #[test]
    fn shards_cover_every_element_once() {
        let cases: &[&[usize]] = &[&[1], &[7, 3, 12], &[5, 5, 5, 5], &[100], &[1, 1, 1], &[64, 1, 33, 2, 9]];
        for lens in cases {
            for ranks in 1..=5 {
                let l = FlatLayout::new(lens, ranks);
                assert!(l.padded() >= l.total && l.padded() - l.total < ranks);
                let mut seen: Vec<Vec<usize>> = lens.iter().map(|&n| vec![0; n]).collect();
                for r in 0..ranks {
                    let mut at = 0;
                    for p in l.pieces(r) {
                        assert_eq!(p.at, at, "pieces of rank {r} are contiguous in its shard");
                        at += p.len;
                        assert_eq!(l.offsets[p.weight] + p.start, r * l.shard + p.at);
                        for count in &mut seen[p.weight][p.start..p.start + p.len] {
                            *count += 1;
                        }
                    }
                    assert!(at <= l.shard);
                }
                assert!(seen.iter().flatten().all(|&c| c == 1), "{lens:?} over {ranks} ranks");
            }
        }
    }
}
