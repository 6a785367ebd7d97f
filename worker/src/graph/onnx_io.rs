//! ONNX `ModelProto` ⇄ graph IR.

use super::ir::{Dim, Graph};
use super::op::{AttrValue, Attrs, Op, TF_DOMAIN};
use crate::error::{Error, Result};
use crate::onnx::proto::{
    attribute_proto::AttributeType, tensor_shape_proto, type_proto, AttributeProto, GraphProto, ModelProto, NodeProto,
    OperatorSetIdProto, TensorShapeProto, TypeProto, ValueInfoProto,
};
use crate::onnx::tensor::{tensor_from_proto, tensor_to_proto};
use crate::tensor::DType;

/// The opset the builtin models and exports are written with (Gelu needs 20).
pub const EXPORT_OPSET: i64 = 20;

fn attr_value(a: &AttributeProto, origin: &str) -> Result<Option<AttrValue>> {
    let name = a.name();
    let kind = a.r#type.and_then(|t| AttributeType::try_from(t).ok());
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    Ok(Some(match kind {
        Some(AttributeType::Float) => AttrValue::Float(a.f()),
        Some(AttributeType::Int) => AttrValue::Int(a.i()),
        Some(AttributeType::String) => AttrValue::Str(text(a.s())),
        Some(AttributeType::Tensor) => {
            let t =
                a.t.as_ref().ok_or_else(|| Error::Corrupt(format!("{origin}: attribute '{name}' has no tensor")))?;
            AttrValue::Tensor(tensor_from_proto(t, &format!("{origin}: attribute '{name}'"))?)
        }
        Some(AttributeType::Floats) => AttrValue::Floats(a.floats.clone()),
        Some(AttributeType::Ints) => AttrValue::Ints(a.ints.clone()),
        Some(AttributeType::Strings) => AttrValue::Strings(a.strings.iter().map(|s| text(s)).collect()),
        // Subgraphs and sparse or type attributes belong to ops we do not run; the op's parser
        // rejects the node with its own message.
        _ => return Ok(None),
    }))
}

fn dims_of(t: &TypeProto) -> Option<(DType, Vec<Dim>)> {
    let Some(type_proto::Value::TensorType(tt)) = &t.value else { return None };
    let dtype = DType::from_onnx(tt.elem_type())?;
    let dims = tt
        .shape
        .as_ref()
        .map(|s| {
            s.dim
                .iter()
                .map(|d| match &d.value {
                    Some(tensor_shape_proto::dimension::Value::DimValue(v)) if *v >= 0 => Dim::Fixed(*v as usize),
                    Some(tensor_shape_proto::dimension::Value::DimParam(p)) if !p.is_empty() => Dim::Named(p.clone()),
                    _ => Dim::Unknown,
                })
                .collect()
        })
        .unwrap_or_default();
    Some((dtype, dims))
}

/// Converts a loaded model; `origin` (the file) prefixes every message.
pub fn from_model(model: &ModelProto, origin: &str) -> Result<Graph> {
    let opset = crate::onnx::default_opset(model);
    let gp = model.graph.as_ref().ok_or_else(|| Error::Corrupt(format!("{origin}: the model has no graph")))?;
    let mut g = Graph::new(gp.name(), opset);
    for t in &gp.initializer {
        let tensor = tensor_from_proto(t, &format!("{origin}: initializer '{}'", t.name()))?;
        g.add_initializer(t.name(), tensor);
    }
    for vi in &gp.input {
        let v = g.value(vi.name());
        if g.initializers.contains_key(&v) {
            continue;
        }
        let (dtype, dims) = vi.r#type.as_ref().and_then(dims_of).ok_or_else(|| {
            Error::Corrupt(format!("{origin}: graph input '{}' is not a tensor of a supported type", vi.name()))
        })?;
        g.add_input(vi.name(), dtype, dims);
    }
    for (i, n) in gp.node.iter().enumerate() {
        let name = if n.name().is_empty() { format!("{}_{i}", n.op_type()) } else { n.name().to_string() };
        let describe = format!("{origin}: node '{name}' ({})", n.op_type());
        let mut attrs = Attrs { origin: describe.clone(), ..Default::default() };
        for a in &n.attribute {
            if let Some(v) = attr_value(a, &describe)? {
                attrs.map.insert(a.name().to_string(), v);
            }
        }
        let op = Op::from_onnx(n.op_type(), n.domain(), &attrs, opset)?;
        let inputs = n.input.iter().map(|s| (!s.is_empty()).then(|| g.value(s))).collect();
        let outputs = n.output.iter().map(|s| (!s.is_empty()).then(|| g.value(s))).collect();
        g.nodes.push(super::ir::Node { name, op, inputs, outputs });
    }
    for vi in &gp.output {
        let v = g.find(vi.name()).ok_or_else(|| {
            Error::Corrupt(format!("{origin}: graph output '{}' is not produced by any node or initializer", vi.name()))
        })?;
        g.outputs.push(v);
        if let Some(t) = vi.r#type.as_ref().and_then(dims_of) {
            g.output_types.insert(v, t);
        }
    }
    check_defined(&g, origin)?;
    Ok(g)
}

/// Every node input must come from an input, an initializer or an earlier node.
fn check_defined(g: &Graph, origin: &str) -> Result<()> {
    let mut known = vec![false; g.values.len()];
    for d in &g.inputs {
        known[d.value] = true;
    }
    for v in g.initializers.keys() {
        known[*v] = true;
    }
    for n in &g.nodes {
        for i in n.inputs.iter().flatten() {
            if !known[*i] {
                return Err(Error::Corrupt(format!(
                    "{origin}: {}: input '{}' is not defined before use (the graph must be topologically sorted)",
                    n.describe(),
                    g.name_of(*i)
                )));
            }
        }
        for o in n.outputs.iter().flatten() {
            known[*o] = true;
        }
    }
    Ok(())
}

fn attr_proto(name: &str, v: &AttrValue) -> AttributeProto {
    let mut a = AttributeProto { name: Some(name.to_string()), ..Default::default() };
    let kind = match v {
        AttrValue::Float(f) => {
            a.f = Some(*f);
            AttributeType::Float
        }
        AttrValue::Int(i) => {
            a.i = Some(*i);
            AttributeType::Int
        }
        AttrValue::Str(s) => {
            a.s = Some(s.as_bytes().to_vec());
            AttributeType::String
        }
        AttrValue::Tensor(t) => {
            a.t = Some(tensor_to_proto("", t));
            AttributeType::Tensor
        }
        AttrValue::Floats(f) => {
            a.floats = f.clone();
            AttributeType::Floats
        }
        AttrValue::Ints(i) => {
            a.ints = i.clone();
            AttributeType::Ints
        }
        AttrValue::Strings(s) => {
            a.strings = s.iter().map(|x| x.as_bytes().to_vec()).collect();
            AttributeType::Strings
        }
    };
    a.r#type = Some(kind as i32);
    a
}

fn value_info(name: &str, dtype: DType, dims: &[Dim]) -> ValueInfoProto {
    use tensor_shape_proto::{dimension::Value, Dimension};
    let dim = dims
        .iter()
        .map(|d| Dimension {
            value: match d {
                Dim::Fixed(n) => Some(Value::DimValue(*n as i64)),
                Dim::Named(s) => Some(Value::DimParam(s.clone())),
                Dim::Unknown => None,
            },
            ..Default::default()
        })
        .collect();
    ValueInfoProto {
        name: Some(name.to_string()),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: Some(dtype.onnx_code()),
                shape: Some(TensorShapeProto { dim }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Writes a graph as a model. Internal ops go to the tensorfleet domain; outputs carry the
/// types inference gave them (symbolic dims of inputs stay symbolic).
pub fn to_model(g: &Graph, producer: &str) -> ModelProto {
    let mut uses_internal = false;
    // Operands kept as attributes here are inputs in ONNX: one initializer per node and operand.
    let mut operands = Vec::new();
    let node = g
        .nodes
        .iter()
        .map(|n| {
            let (op_type, domain) = n.op.onnx_name();
            uses_internal |= domain == TF_DOMAIN;
            let name_of = |v: &Option<usize>| v.map_or(String::new(), |v| g.name_of(v).to_string());
            let mut input: Vec<String> = n.inputs.iter().map(name_of).collect();
            if input.len() == 1 {
                for (k, t) in n.op.operand_inputs().iter().enumerate() {
                    let name = format!("{}.operand{}", n.name, k + 1);
                    operands.push(tensor_to_proto(&name, t));
                    input.push(name);
                }
            }
            NodeProto {
                input,
                output: n.outputs.iter().map(name_of).collect(),
                name: Some(n.name.clone()),
                op_type: Some(op_type.to_string()),
                domain: (!domain.is_empty()).then(|| domain.to_string()),
                attribute: n.op.onnx_attrs().iter().map(|(k, v)| attr_proto(k, v)).collect(),
                ..Default::default()
            }
        })
        .collect();
    let input = g.inputs.iter().map(|d| value_info(g.name_of(d.value), d.dtype, &d.dims)).collect();
    let output = g
        .outputs
        .iter()
        .map(|&v| match (g.output_types.get(&v), g.meta(v)) {
            (Some((dtype, dims)), _) => value_info(g.name_of(v), *dtype, dims),
            (None, Some(m)) => {
                let dims: Vec<Dim> = m.shape.iter().map(|&d| Dim::Fixed(d)).collect();
                value_info(g.name_of(v), m.dtype, &dims)
            }
            (None, None) => ValueInfoProto { name: Some(g.name_of(v).to_string()), ..Default::default() },
        })
        .collect();
    let initializer = g.initializers.iter().map(|(v, t)| tensor_to_proto(g.name_of(*v), t)).chain(operands).collect();
    let mut opset_import = vec![OperatorSetIdProto { domain: Some(String::new()), version: Some(g.opset.max(13)) }];
    if uses_internal {
        opset_import.push(OperatorSetIdProto { domain: Some(TF_DOMAIN.to_string()), version: Some(1) });
    }
    ModelProto {
        ir_version: Some(if g.opset >= 21 { 10 } else { 9 }),
        opset_import,
        producer_name: Some(producer.to_string()),
        producer_version: Some(env!("CARGO_PKG_VERSION").to_string()),
        graph: Some(GraphProto { node, name: Some(g.name.clone()), initializer, input, output, ..Default::default() }),
        ..Default::default()
    }
}
