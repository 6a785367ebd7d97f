//! The inference model: the forward graph with trained weights, without the loss, labels,
//! gradients or optimizer state.

use crate::error::{Error, Result};
use crate::graph::ir::Graph;
use crate::graph::onnx_io::to_model;
use crate::models::Model;
use crate::tensor::Tensor;
use std::collections::BTreeMap;
use std::path::Path;

/// The forward graph of `model` with `weights` (by name) in place of its initial weights.
pub fn inference_graph(model: &Model, weights: &BTreeMap<String, Tensor>) -> Result<Graph> {
    let mut g = model.graph.clone();
    // A checkpoint also holds optimizer state, which inference does not need.
    for (name, t) in weights.iter().filter(|(n, _)| !n.starts_with(crate::session::OPTIMIZER_PREFIX)) {
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
    g.prune();
    Ok(g)
}

/// Writes the inference model to `path` (atomically: a temporary file, then a rename).
pub fn write(model: &Model, weights: &BTreeMap<String, Tensor>, path: &Path) -> Result<()> {
    let g = inference_graph(model, weights)?;
    let proto = to_model(&g, "tensorfleet");
    let tmp = path.with_extension("onnx.tmp");
    crate::onnx::save_model(&proto, &tmp)?;
    std::fs::rename(&tmp, path).map_err(|e| Error::Runtime(format!("{}: {e}", path.display())))
}
