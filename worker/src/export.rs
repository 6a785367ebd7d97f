//! The inference model: the forward graph with trained weights, without the loss, labels,
//! gradients or optimizer state.

use crate::error::{Error, Result};
use crate::graph::infer::{bind, Bindings};
use crate::graph::ir::{Dim, Graph, ValueId};
use crate::graph::onnx_io::to_model;
use crate::models::Model;
use crate::op::Op;
use crate::tensor::DType;
use crate::tensor::Tensor;
use std::collections::BTreeMap;
use std::path::Path;

/// The forward graph of `model` with `weights` (by name) in place of its initial weights.
pub fn inference_graph(model: &Model, weights: &BTreeMap<String, Tensor>) -> Result<Graph> {
    let mut g = model.graph.clone();
    // A checkpoint also holds optimizer state, which inference does not need.
    for (name, t) in weights.iter().filter(|(n, _)| !n.starts_with(crate::checkpoint::keys::OPTIMIZER_PREFIX)) {
        let v = g
            .find(name)
            .filter(|v| g.initializers.contains_key(v))
            .ok_or_else(|| Error::Corrupt(format!("weight '{name}' is not an initializer of the model")))?;
        if g.initializers[&v].shape() != t.shape() {
            return Err(Error::Corrupt(format!(
                "weight '{name}' has shape {:?}; the model's is {:?}",
                t.shape(),
                g.initializers[&v].shape()
            )));
        }
        g.initializers.insert(v, t.clone());
    }
    g.outputs = model.outputs.clone();
    g.inputs.retain(|d| !model.label_inputs.contains(&d.value));
    remove_dropout(&mut g);
    g.prune();
    g.output_types = output_types(&g);
    Ok(g)
}

/// Refuses `weights` (a checkpoint's, from `origin`) that lack a parameter training updates
/// (chosen by the run's weightsToTrain `trainable` and frozenWeights `frozen`): the export would
/// hold that weight's untrained initial value.
pub fn check_trained(
    model: &Model,
    weights: &BTreeMap<String, Tensor>,
    trainable: &[String],
    frozen: &[String],
    origin: &str,
) -> Result<()> {
    let (params, _) = crate::session::trained_weights(&model.graph, trainable, frozen)?;
    match params.iter().map(|&v| model.graph.name_of(v)).find(|name| !weights.contains_key(*name)) {
        Some(name) => Err(Error::Corrupt(format!(
            "{origin}: the trained weight '{name}' is missing (the export would hold its untrained initial value)"
        ))),
        None => Ok(()),
    }
}

/// Dropout is the identity in inference: its readers read its input instead.
fn remove_dropout(g: &mut Graph) {
    let mut replace: BTreeMap<ValueId, ValueId> = BTreeMap::new();
    g.nodes.retain(|n| match (&n.op, n.input(0), n.output(0)) {
        (Op::Dropout { .. }, Some(x), Some(y)) => {
            replace.insert(y, x);
            false
        }
        _ => true,
    });
    let resolve = |mut v: ValueId| {
        while let Some(&x) = replace.get(&v) {
            v = x;
        }
        v
    };
    for n in &mut g.nodes {
        for i in n.inputs.iter_mut().flatten() {
            *i = resolve(*i);
        }
    }
    for o in &mut g.outputs {
        *o = resolve(*o);
    }
}

/// Output types for the saved model: the graph is bound twice, with every named input dim at
/// 2 and then at 3; an output dim that follows them is symbolic, one that does not is fixed.
fn output_types(g: &Graph) -> BTreeMap<ValueId, (DType, Vec<Dim>)> {
    let bound_at = |n: usize| {
        let mut b = Bindings::default();
        for d in &g.inputs {
            for dim in &d.dims {
                if let Dim::Named(name) = dim {
                    b.dims.insert(name.clone(), n);
                }
            }
        }
        bind(g, &b, false).ok()
    };
    let (Some(two), Some(three)) = (bound_at(2), bound_at(3)) else { return g.output_types.clone() };
    let mut out = BTreeMap::new();
    for &o in &g.outputs {
        let (Some(a), Some(b)) = (two.meta(o), three.meta(o)) else { continue };
        let dims = a
            .shape
            .iter()
            .zip(&b.shape)
            .enumerate()
            .map(|(i, (&x, &y))| if x == y { Dim::Fixed(x) } else { Dim::Named(format!("{}_dim{i}", g.name_of(o))) })
            .collect();
        out.insert(o, (a.dtype, dims));
    }
    out
}

/// The model with its loss attached, as training starts (ONNX Runtime's "model with loss
/// function"): the forward graph, the label inputs, and the loss as the first output.
pub fn loss_graph(model: &Model) -> Result<Graph> {
    let forward = inference_graph(model, &BTreeMap::new())?;
    let mut g = model.graph.clone();
    g.outputs = std::iter::once(model.loss).chain(model.outputs.iter().copied()).collect();
    // The forward outputs keep their value ids in the inference graph, and so their types.
    g.output_types.extend(forward.output_types);
    g.output_types.entry(model.loss).or_insert((DType::F32, vec![]));
    Ok(g)
}

/// Writes the inference model to `path` (atomically: a new file, then a rename; only a regular
/// file is replaced).
pub fn write(model: &Model, weights: &BTreeMap<String, Tensor>, path: &Path) -> Result<()> {
    write_graph(&inference_graph(model, weights)?, path)
}

/// Writes any graph as an ONNX model (atomically), e.g. the model with its loss or the
/// training graph for inspection; internal ops are in the tensorfleet domain.
pub fn write_graph(g: &Graph, path: &Path) -> Result<()> {
    crate::onnx::save_model(&to_model(g, "tensorfleet"), path)
}
