//! ZeRO stages 1 and 2 in a session: the data-parallel replicas split the optimizer state (and,
//! at stage 2, the accumulated gradient) by `parallel::zero::FlatLayout`.
//!
//! A step: the gradients are laid end to end and reduce-scattered (averaged), so each replica
//! holds the mean gradient of its shard only; the global norm sums the shards' squares; each
//! replica updates its shard of the weights with its shard of the optimizer state; the
//! updated shards are all-gathered into every replica's whole weights. Stage 1 reduce-scatters
//! once per step, after accumulating whole gradients; stage 2 reduce-scatters each
//! micro-batch's gradient at once and accumulates only its shard, keeping no whole
//! accumulation buffers. (The executor's arena still holds one micro-batch's whole gradient
//! while the backward pass runs.)
//!
//! Everything stays in the backend's memory: the flat vector is a device buffer that the
//! gradients are copied into and the updated shards gathered into, and the collectives are the
//! data group's (NCCL's reduce-scatter and all-gather on GPUs; through host memory and MPI
//! elsewhere).

use super::{optimizer_state, Session};
use crate::backend::{Arg, Backend, Slot};
use crate::checkpoint::keys;
use crate::comm::ReduceOp;
use crate::error::{Error, Result};
use crate::graph::ir::Meta;
use crate::optim::Update;
use crate::parallel::zero::{FlatLayout, Piece};
use crate::tensor::{DType, Tensor};
use std::collections::BTreeMap;

/// This replica's shard of the training state.
pub(super) struct Shard<B: Backend> {
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
    /// The whole mean gradient (flat), kept when the session reports gradients.
    reported: Option<Vec<f32>>,
}

/// Bytes [`Shard::new`] allocates on the replica of `replicas` whose pieces hold the most
/// optimizer state, for weights of `lens` elements keeping `counts` state tensors each: that
/// state, the padded flat vector, and the shard's gradient and part.
pub(super) fn largest_shard_bytes(lens: &[usize], counts: &[usize], replicas: usize) -> usize {
    let layout = FlatLayout::new(lens, replicas);
    let state = |rank| layout.pieces(rank).iter().map(|p| counts[p.weight] * p.len).sum::<usize>();
    let largest = (0..layout.ranks).map(state).max().unwrap_or(0);
    largest.saturating_add(layout.padded()).saturating_add(2 * layout.shard).saturating_mul(4)
}

impl<B: Backend> Shard<B> {
    /// The shard of replica `rank` of `ranks` for `session`'s weights, its optimizer state
    /// allocated (zeroed, as a fresh optimizer's).
    pub fn new(session: &Session<B>, ranks: usize, rank: usize) -> Result<Shard<B>> {
        if session.params.iter().any(|p| matches!(p.update, Update::Lamb { .. })) {
            return Err(Error::Config(
                "parallelism.zero: LAMB's trust ratio needs each weight whole, which ZeRO splits; use adam, adamw \
                 or sgd with ZeRO, or parallelism.zero: 0"
                    .into(),
            ));
        }
        let lens: Vec<usize> =
            session.params.iter().map(|p| session.train.graph.meta(p.value).expect("bound").numel()).collect();
        let layout = FlatLayout::new(&lens, ranks);
        let pieces = layout.pieces(rank);
        let backend = &session.train.backend;
        let metas: Vec<Meta> = pieces.iter().map(|p| Meta::new(DType::F32, &[p.len])).collect();
        let mut state = Vec::with_capacity(pieces.len());
        for (piece, meta) in pieces.iter().zip(&metas) {
            let count = session.params[piece.weight].update.state_count();
            state.push((0..count).map(|_| Ok(backend.alloc(meta.bytes())?)).collect::<Result<_>>()?);
        }
        let alloc = |elements: usize| backend.alloc(elements * 4);
        let (flat, grad, part) = (alloc(layout.padded())?, alloc(layout.shard)?, alloc(layout.shard)?);
        let (flat_meta, shard_meta) =
            (Meta::new(DType::F32, &[layout.padded()]), Meta::new(DType::F32, &[layout.shard]));
        Ok(Shard { layout, rank, pieces, metas, state, flat, grad, part, flat_meta, shard_meta, reported: None })
    }

    /// Σ g² over the pieces of weights this stage counts (see `Param::owner`).
    pub fn sum_squares(&self, session: &Session<B>) -> Result<f64> {
        let pieces: Vec<Arg<B::Buffer>> = (0..self.pieces.len())
            .filter(|&i| session.params[self.pieces[i].weight].owner)
            .map(|i| Arg { buf: &self.grad, offset: self.pieces[i].at * 4, meta: &self.metas[i] })
            .collect();
        Ok(session.train.backend.sum_squares(&pieces)?)
    }

    /// The flat vector from element `at`, as `meta` says (f32).
    fn flat_arg<'a>(&'a self, at: usize, meta: &'a Meta) -> Arg<'a, B::Buffer> {
        Arg { buf: &self.flat, offset: at * 4, meta }
    }

    /// Weight `i`'s gradient of the last step, from the whole gradient kept for reporting.
    pub fn reported_gradient(&self, i: usize, meta: &Meta) -> Result<Tensor> {
        let flat = self.reported.as_ref().ok_or_else(|| {
            Error::Runtime("under ZeRO a session reports gradients only when asked to keep them".into())
        })?;
        let at = self.layout.offsets[i];
        Ok(Tensor::from_vec(&meta.shape, flat[at..at + self.layout.lens[i]].to_vec()))
    }

    /// The optimizer state of this replica's pieces, as `optimizer/<name>/<k>@<first element>`
    /// (pieces of weights an earlier stage holds too are that stage's to write).
    pub fn state_pieces(&self, session: &Session<B>) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for (i, piece) in self.pieces.iter().enumerate() {
            let p = &session.params[piece.weight];
            if !p.owner {
                continue;
            }
            let name = session.train.graph.name_of(p.value);
            for (k, buf) in self.state[i].iter().enumerate() {
                let t = session.train.backend.download(Arg { buf, offset: 0, meta: &self.metas[i] });
                out.push((keys::piece_key(&keys::optimizer_key(name, k), piece.start), t?));
            }
        }
        Ok(out)
    }

    /// Takes this replica's pieces of the optimizer state out of an assembled checkpoint state.
    pub fn load(&mut self, session: &Session<B>, state: &BTreeMap<String, Tensor>, origin: &str) -> Result<()> {
        for (i, piece) in self.pieces.iter().enumerate() {
            let p = &session.params[piece.weight];
            let name = session.train.graph.name_of(p.value);
            let meta = session.train.graph.meta(p.value).expect("bound");
            for (k, buf) in self.state[i].iter().enumerate() {
                let whole = optimizer_state(state, name, k, meta, origin)?;
                let part = whole.as_slice::<f32>()[piece.start..piece.start + piece.len].to_vec();
                let t = Tensor::from_vec(&[piece.len], part);
                session.train.backend.upload(&t, Arg { buf, offset: 0, meta: &self.metas[i] })?;
            }
        }
        Ok(())
    }
}

impl<B: Backend> Session<B> {
    fn shard(&self) -> &Shard<B> {
        self.zero.as_ref().expect("ZeRO is on")
    }

    /// This replica's shard of the replicas' mean of every weight's current gradient
    /// (accumulated, or this micro-batch's), into `into` (the shard's `grad` or `part`).
    fn reduce_scatter_mean(&self, into: impl Fn(&Shard<B>) -> &B::Buffer) -> Result<()> {
        let z = self.shard();
        let backend = &*self.train.backend;
        for (i, p) in self.params.iter().enumerate() {
            let g = self.grad_of(p);
            backend.accumulate(z.flat_arg(z.layout.offsets[i], g.meta), 0.0, g, 1.0)?;
        }
        let (padded, shard) = (&z.flat_meta, &z.shard_meta);
        let recv = Arg { buf: into(z), offset: 0, meta: shard };
        match &self.data_parallel {
            Some(group) => group.reduce_scatter_values(backend, z.flat_arg(0, padded), recv, ReduceOp::Average),
            None => Ok(backend.accumulate(recv, 0.0, z.flat_arg(0, shard), 1.0)?),
        }
    }

    /// ZeRO-1: the accumulated gradients become this replica's shard of their mean.
    pub(super) fn reduce_scatter_gradients(&mut self) -> Result<()> {
        self.reduce_scatter_mean(|z| &z.grad)
    }

    /// ZeRO-2, after micro-batch `k` of `n`: its mean gradient's shard, divided by `n`, added
    /// to the step's.
    pub(super) fn accumulate_gradient_shard(&mut self, k: usize, n: usize) -> Result<()> {
        self.reduce_scatter_mean(|z| &z.part)?;
        let z = self.shard();
        let shard = &z.shard_meta;
        let (grad, part) = (Arg { buf: &z.grad, offset: 0, meta: shard }, Arg { buf: &z.part, offset: 0, meta: shard });
        let keep = if k == 0 { 0.0 } else { 1.0 };
        Ok(self.train.backend.accumulate(grad, keep, part, 1.0 / n as f32)?)
    }

    /// Updates this replica's shard of the weights, then gathers every replica's shard into
    /// the whole weights.
    pub(super) fn update_shard(&mut self, lr: f64, grad_scale: f64) -> Result<()> {
        let z = self.shard();
        let backend = &*self.train.backend;
        // This shard's piece of each weight it holds a piece of.
        let slot = |i: usize| {
            let piece = &z.pieces[i];
            let p = &self.params[piece.weight];
            let meta = &z.metas[i];
            let w = self.train.arg(p.value);
            let param = Arg { buf: w.buf, offset: w.offset + piece.start * 4, meta };
            let grad = Arg { buf: &z.grad, offset: piece.at * 4, meta };
            let state = z.state[i].iter().map(|buf| Arg { buf, offset: 0, meta }).collect();
            (p, Slot { param, grad, state })
        };
        super::update_in_groups(backend, (lr, self.step, grad_scale), (0..z.pieces.len()).map(slot))?;
        // The updated pieces go to this replica's part of the flat vector, every replica's
        // parts to every replica, and the flat vector back into the weights.
        let mine = z.rank * z.layout.shard;
        for (i, piece) in z.pieces.iter().enumerate() {
            let dst = z.flat_arg(mine + piece.at, &z.metas[i]);
            backend.accumulate(dst, 0.0, slot(i).1.param, 1.0)?;
        }
        let (padded, shard) = (&z.flat_meta, &z.shard_meta);
        if let Some(group) = &self.data_parallel {
            group.all_gather_values(backend, z.flat_arg(mine, shard), z.flat_arg(0, padded))?;
        }
        for (i, p) in self.params.iter().enumerate() {
            let w = self.train.arg(p.value);
            backend.accumulate(w, 0.0, z.flat_arg(z.layout.offsets[i], w.meta), 1.0)?;
        }
        if self.report_gradients {
            let grad = Arg { buf: &z.grad, offset: 0, meta: shard };
            if let Some(group) = &self.data_parallel {
                group.all_gather_values(backend, grad, z.flat_arg(0, padded))?;
            } else {
                backend.accumulate(z.flat_arg(0, shard), 0.0, grad, 1.0)?;
            }
            let reported = backend.download(z.flat_arg(0, padded))?;
            self.zero.as_mut().expect("ZeRO is on").reported = Some(reported.as_slice::<f32>().to_vec());
        }
        Ok(())
    }
}
