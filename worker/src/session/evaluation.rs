//! Evaluation's graph: the model's forward pass and loss in inference mode (dropout off), bound
//! and planned for the shapes of the evaluation batches (which need not be the training
//! batches'), sharded, cut, fused and cast as the training graph was.

use super::{bindings_for, forward_passes, TensorPlace};
use crate::backend::{Backend, Group};
use crate::error::Result;
use crate::exec::Executor;
use crate::graph::fuse;
use crate::graph::infer::bind;
use crate::graph::ir::{Graph, ValueId};
use crate::parallel::stage::StagePart;
use crate::tensor::{DType, Tensor};
use std::collections::{BTreeMap, HashSet};
use std::rc::Rc;
use std::sync::Arc;

/// The shape of each input of a batch, by name.
type BatchShapes = BTreeMap<String, Vec<usize>>;

pub(super) struct Evaluation<B: Backend> {
    /// The model's forward graph and loss, unbound, with what binding them needs.
    forward: Graph,
    pub loss: ValueId,
    variables: HashSet<ValueId>,
    /// The training graph's choices it repeats: fusion passes left out, mixed precision.
    disabled_passes: Vec<String>,
    half: Option<DType>,
    /// The executor planned for the last shapes evaluated.
    planned: Option<(BatchShapes, Executor<B>)>,
}

/// Where this rank's part of the model lies: its tensor-parallel place, its pipeline stage and
/// the tensor group its all-reduces run over.
pub(super) struct Part<'a, B: Backend> {
    pub tensor: Option<TensorPlace>,
    pub stage: Option<&'a StagePart>,
    pub tensor_group: Option<Rc<Group<B>>>,
}

impl<B: Backend> Evaluation<B> {
    pub fn new(
        (forward, loss): (Graph, ValueId),
        variables: HashSet<ValueId>,
        disabled_passes: Vec<String>,
        half: Option<DType>,
    ) -> Evaluation<B> {
        Evaluation { forward, loss, variables, disabled_passes, half, planned: None }
    }

    /// The executor for batches shaped like `first`, planned on `backend` for this rank's
    /// `part` when the shapes differ from the last ones.
    pub fn executor(
        &mut self,
        backend: &Arc<B>,
        first: &BTreeMap<String, Tensor>,
        part: Part<'_, B>,
    ) -> Result<&mut Executor<B>> {
        let shapes: BatchShapes = first.iter().map(|(k, t)| (k.clone(), t.shape().to_vec())).collect();
        if self.planned.as_ref().is_none_or(|(planned, _)| *planned != shapes) {
            let mut g = bind(&self.forward, &bindings_for(&self.forward, first, &self.variables)?, false)?;
            if let Some(t) = part.tensor {
                crate::parallel::tensor::shard(&mut g, self.loss, t.rank, t.size)?;
            }
            if let Some(stage) = part.stage {
                g = stage.eval_graph(g, self.loss)?;
            }
            let sends = part.stage.map_or(&[][..], |p| &p.sends[..]);
            forward_passes(&mut g, self.loss, sends, &self.disabled_passes, self.half, &self.variables)?;
            fuse::run(&mut g, &self.disabled_passes);
            let mut ex = Executor::new(backend.clone(), g, &[])?;
            ex.tensor_group = part.tensor_group;
            self.planned = Some((shapes, ex));
        }
        Ok(&mut self.planned.as_mut().expect("planned above").1)
    }
}
