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

use super::{optimizer_state, read_f32, write_f32, Session, OPTIMIZER_PREFIX};
use crate::backend::{Arg, Backend, Slot};
use crate::comm::{Collective, ProcessGroup, ReduceOp};
use crate::error::{Error, Result};
use crate::graph::ir::Meta;
use crate::optim::Update;
use crate::parallel::zero::{FlatLayout, Piece};
use crate::tensor::{DType, Tensor};
use std::collections::BTreeMap;

/// This replica's shard of the training state.
pub(super) struct Shard<B: Backend> {
    layout: FlatLayout,
    pieces: Vec<Piece>,
    /// f32 [len] of each piece.
    metas: Vec<Meta>,
    /// The optimizer state of each piece.
    state: Vec<Vec<B::Buffer>>,
    /// This replica's shard of the step's mean gradient (f32 [layout.shard]).
    grad: Vec<f32>,
    /// The same on the device, where the optimizer reads it.
    grad_device: B::Buffer,
    /// The whole mean gradient (flat), kept when the session reports gradients.
    reported: Option<Vec<f32>>,
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
            state.push((0..count).map(|_| backend.alloc(meta.bytes()).map_err(Error::Runtime)).collect::<Result<_>>()?);
        }
        let grad_device = backend.alloc(layout.shard * 4).map_err(Error::Runtime)?;
        Ok(Shard { grad: vec![0.0; layout.shard], layout, pieces, metas, state, grad_device, reported: None })
    }

    /// Σ g² over the pieces of weights this stage counts (see `Param::owner`).
    pub fn sum_squares(&self, params: &[super::Param<B>]) -> f64 {
        self.pieces
            .iter()
            .filter(|p| params[p.weight].owner)
            .flat_map(|p| &self.grad[p.at..p.at + p.len])
            .map(|&g| (g as f64) * (g as f64))
            .sum()
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
                out.push((format!("{OPTIMIZER_PREFIX}{name}/{k}@{}", piece.start), t.map_err(Error::Runtime)?));
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
                session
                    .train
                    .backend
                    .upload(&t, Arg { buf, offset: 0, meta: &self.metas[i] })
                    .map_err(Error::Runtime)?;
            }
        }
        Ok(())
    }
}

impl<B: Backend> Session<B> {
    fn shard(&self) -> &Shard<B> {
        self.zero.as_ref().expect("ZeRO is on")
    }

    /// Every weight's current gradient (accumulated, or this micro-batch's), laid end to end.
    fn flat_gradients(&self) -> Result<Vec<f32>> {
        let layout = &self.shard().layout;
        let mut flat = vec![0f32; layout.padded()];
        for (i, p) in self.params.iter().enumerate() {
            let dst = &mut flat[layout.offsets[i]..layout.offsets[i] + layout.lens[i]];
            read_f32(&*self.train.backend, self.grad_of(p), dst)?;
        }
        Ok(flat)
    }

    /// The replicas' mean of `flat`, this replica's shard of it.
    fn reduce_scatter_mean(&self, flat: &[f32]) -> Result<Vec<f32>> {
        let shard = self.shard().layout.shard;
        match &self.data_parallel {
            Some(group) => {
                let mut out = vec![0f32; shard];
                group.reduce_scatter(flat, &mut out[..], ReduceOp::Average)?;
                Ok(out)
            }
            None => Ok(flat[..shard].to_vec()),
        }
    }

    /// ZeRO-1: the accumulated gradients become this replica's shard of their mean.
    pub(super) fn reduce_scatter_gradients(&mut self) -> Result<()> {
        let flat = self.flat_gradients()?;
        let grad = self.reduce_scatter_mean(&flat)?;
        self.zero.as_mut().expect("ZeRO is on").grad = grad;
        Ok(())
    }

    /// ZeRO-2, after micro-batch `k` of `n`: its mean gradient's shard, divided by `n`, added
    /// to the step's.
    pub(super) fn accumulate_gradient_shard(&mut self, k: usize, n: usize) -> Result<()> {
        let flat = self.flat_gradients()?;
        let part = self.reduce_scatter_mean(&flat)?;
        let z = self.zero.as_mut().expect("ZeRO is on");
        let scale = 1.0 / n as f32;
        let keep = if k == 0 { 0.0 } else { 1.0 };
        for (acc, g) in z.grad.iter_mut().zip(part) {
            *acc = if keep == 0.0 { g * scale } else { *acc * keep + g * scale };
        }
        Ok(())
    }

    /// Updates this replica's shard of the weights, then gathers every replica's shard into
    /// the whole weights.
    pub(super) fn update_shard(&mut self, lr: f64, grad_scale: f64) -> Result<()> {
        let z = self.shard();
        let backend = &self.train.backend;
        let shard_meta = Meta::new(DType::F32, &[z.layout.shard]);
        let grad = Tensor::from_vec(&[z.layout.shard], z.grad.clone());
        backend.upload(&grad, Arg { buf: &z.grad_device, offset: 0, meta: &shard_meta }).map_err(Error::Runtime)?;
        // This shard's piece of each weight it holds a piece of.
        let slot = |i: usize| {
            let piece = &z.pieces[i];
            let p = &self.params[piece.weight];
            let meta = &z.metas[i];
            let w = self.train.arg(p.value);
            let param = Arg { buf: w.buf, offset: w.offset + piece.start * 4, meta };
            let grad = Arg { buf: &z.grad_device, offset: piece.at * 4, meta };
            let state = z.state[i].iter().map(|buf| Arg { buf, offset: 0, meta }).collect();
            (p, Slot { param, grad, state })
        };
        super::update_in_groups(&**backend, (lr, self.step, grad_scale), (0..z.pieces.len()).map(slot))?;
        let mut mine = vec![0f32; z.layout.shard];
        for (i, piece) in z.pieces.iter().enumerate() {
            read_f32(&**backend, slot(i).1.param, &mut mine[piece.at..piece.at + piece.len])?;
        }
        let whole = self.all_gather(&mine)?;
        for (i, p) in self.params.iter().enumerate() {
            let src = &whole[z.layout.offsets[i]..z.layout.offsets[i] + z.layout.lens[i]];
            write_f32(&**backend, self.train.arg(p.value), src)?;
        }
        if self.report_gradients {
            let reported = self.all_gather(&z.grad)?;
            self.zero.as_mut().expect("ZeRO is on").reported = Some(reported);
        }
        Ok(())
    }

    /// Every replica's shard, end to end.
    fn all_gather(&self, mine: &[f32]) -> Result<Vec<f32>> {
        match &self.data_parallel {
            Some(group) => {
                let mut whole = vec![0f32; mine.len() * group.size()];
                group.all_gather(mine, &mut whole[..])?;
                Ok(whole)
            }
            None => Ok(mine.to_vec()),
        }
    }
}
