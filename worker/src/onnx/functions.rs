//! Model-local functions (`ModelProto.functions`), inlined: every node that calls one (its
//! domain, op type and overload name a function) becomes the function's body, as ONNX Runtime
//! inlines them when it loads a model. PyTorch writes functions for modules exported with
//! `export_modules_as_functions`, and for custom ops defined in onnxscript.
//!
//! In the inlined body, the function's formal inputs and outputs are the call's actual values
//! (an omitted optional input stays omitted), every other value is renamed under the calling
//! node's name so that two calls never share one, and an attribute that refers to one of the
//! function's (`ref_attr_name`) takes the call's value, else the function's default, else is
//! left out, as the spec says.

use super::proto::{AttributeProto, FunctionProto, GraphProto, ModelProto, NodeProto};
use crate::error::{Error, Result};
use std::collections::HashMap;

/// Calls nested deeper than this are taken for recursion, which ONNX forbids.
const MAX_DEPTH: usize = 64;

/// `model`'s main graph with every function call inlined (the graph itself when it calls none).
pub fn inlined_graph(model: &ModelProto, origin: &str) -> Result<Option<GraphProto>> {
    let Some(graph) = model.graph.as_ref() else { return Ok(None) };
    if model.functions.is_empty() {
        return Ok(None);
    }
    let by_key: HashMap<(&str, &str, &str), &FunctionProto> =
        model.functions.iter().map(|f| ((f.domain(), f.name(), f.overload()), f)).collect();
    let model_opset = super::default_opset(model);
    for f in &model.functions {
        let default = f.opset_import.iter().find(|o| matches!(o.domain(), "" | "ai.onnx"));
        if let Some(version) = default.map(|o| o.version()).filter(|&v| v != model_opset) {
            return Err(Error::Unsupported(format!(
                "{origin}: function '{}' imports opset {version} of the default domain, the model {model_opset}; \
                 export the model and its functions at one opset",
                f.name()
            )));
        }
    }
    let mut nodes = graph.node.clone();
    for _ in 0..MAX_DEPTH {
        let mut expanded = Vec::with_capacity(nodes.len());
        let mut calls = 0;
        for (index, node) in nodes.into_iter().enumerate() {
            match by_key.get(&(node.domain(), node.op_type(), node.overload())) {
                Some(f) => {
                    calls += 1;
                    expanded.extend(inline_call(f, &node, index, origin)?);
                }
                None => expanded.push(node),
            }
        }
        nodes = expanded;
        if calls == 0 {
            return Ok(Some(GraphProto { node: nodes, ..graph.clone() }));
        }
    }
    Err(Error::Corrupt(format!("{origin}: function calls nest more than {MAX_DEPTH} deep (a function calls itself?)")))
}

/// The body of `f` for the call `call` (the `index`-th node of its graph).
fn inline_call(f: &FunctionProto, call: &NodeProto, index: usize, origin: &str) -> Result<Vec<NodeProto>> {
    let caller = if call.name().is_empty() { format!("{}_{index}", call.op_type()) } else { call.name().to_string() };
    if call.input.len() > f.input.len() || call.output.len() > f.output.len() {
        return Err(Error::Corrupt(format!(
            "{origin}: node '{caller}' calls function '{}' with {} inputs and {} outputs; it takes {} and gives {}",
            f.name(),
            call.input.len(),
            call.output.len(),
            f.input.len(),
            f.output.len()
        )));
    }
    // Formal name -> actual name; an omitted input or output maps to "".
    let mut names: HashMap<&str, String> = HashMap::new();
    for (k, formal) in f.input.iter().enumerate() {
        names.insert(formal, call.input.get(k).cloned().unwrap_or_default());
    }
    for (k, formal) in f.output.iter().enumerate() {
        names.insert(formal, call.output.get(k).cloned().unwrap_or_default());
    }
    let rename = |v: &str| -> String {
        match names.get(v) {
            _ if v.is_empty() => String::new(),
            Some(actual) => actual.clone(),
            None => format!("{caller}/{v}"),
        }
    };
    let given: HashMap<&str, &AttributeProto> = call.attribute.iter().map(|a| (a.name(), a)).collect();
    let defaults: HashMap<&str, &AttributeProto> = f.attribute_proto.iter().map(|a| (a.name(), a)).collect();
    let mut body = Vec::with_capacity(f.node.len());
    for (k, node) in f.node.iter().enumerate() {
        let mut n = node.clone();
        n.name = Some(format!(
            "{caller}/{}",
            if node.name().is_empty() { format!("{}_{k}", node.op_type()) } else { node.name().to_string() }
        ));
        n.input = node.input.iter().map(|v| rename(v)).collect();
        n.output = node.output.iter().map(|v| rename(v)).collect();
        n.attribute = node
            .attribute
            .iter()
            .filter_map(|a| {
                if a.ref_attr_name().is_empty() {
                    return Some(a.clone());
                }
                let source = given.get(a.ref_attr_name()).or_else(|| defaults.get(a.ref_attr_name()))?;
                Some(AttributeProto { name: a.name.clone(), ref_attr_name: None, ..(*source).clone() })
            })
            .collect();
        body.push(n);
    }
    Ok(body)
}
