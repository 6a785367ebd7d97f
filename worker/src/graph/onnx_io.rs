//! ONNX `ModelProto` ⇄ graph IR.

use super::ir::{Dim, Graph, ValueId};
use crate::error::{Error, Result};
use crate::onnx::proto::{
    attribute_proto::AttributeType, tensor_shape_proto, type_proto, AttributeProto, GraphProto, ModelProto, NodeProto,
    OperatorSetIdProto, TensorShapeProto, TypeProto, ValueInfoProto,
};
use crate::onnx::tensor::{tensor_from_proto, tensor_to_proto};
use crate::op::{AttrValue, Attrs, Op, SUPPORTED_ONNX_OPS, TF_DOMAIN};
use crate::tensor::DType;
use std::collections::{BTreeMap, BTreeSet};

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
    let inlined = crate::onnx::functions::inlined_graph(model, origin)?;
    let gp = match &inlined {
        Some(g) => g,
        None => model.graph.as_ref().ok_or_else(|| Error::Corrupt(format!("{origin}: the model has no graph")))?,
    };
    check_supported(gp, origin)?;
    let mut g = Graph::new(gp.name(), opset);
    for t in &gp.initializer {
        let tensor = tensor_from_proto(t, &format!("{origin}: initializer '{}'", t.name()))?;
        g.add_initializer(t.name(), tensor);
    }
    g.declared_buffers = declared_buffers(gp, &g);
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
        let name = node_name(n, i);
        let describe = format!("{origin}: node '{name}' ({})", n.op_type());
        let mut attrs = Attrs { origin: describe.clone(), ..Default::default() };
        for a in &n.attribute {
            if let Some(v) = attr_value(a, &describe)? {
                attrs.map.insert(a.name().to_string(), v);
            }
        }
        let op = Op::from_onnx(n.op_type(), n.domain(), &attrs, opset)?;
        check_arity(n, opset, &describe)?;
        let inputs = n.input.iter().map(|s| (!s.is_empty()).then(|| g.value(s))).collect();
        let outputs = n.output.iter().map(|s| (!s.is_empty()).then(|| g.value(s))).collect();
        g.nodes.push(super::ir::Node { name, op, inputs, outputs });
    }
    for vi in &gp.output {
        let v = g.find(vi.name()).ok_or_else(|| {
            Error::Corrupt(format!("{origin}: graph output '{}' is not produced by any node or initializer", vi.name()))
        })?;
        // Sequences live only inside the graph (binding resolves them into their tensors).
        if let Some(TypeProto { value: Some(type_proto::Value::SequenceType(_)), .. }) = &vi.r#type {
            return Err(Error::Unsupported(format!(
                "{origin}: graph output '{}' is a sequence; graph outputs must be tensors",
                vi.name()
            )));
        }
        g.outputs.push(v);
        if let Some(t) = vi.r#type.as_ref().and_then(dims_of) {
            g.output_types.insert(v, t);
        }
    }
    check_defined(&g, origin)?;
    Ok(g)
}

/// A node of the default domain gives the inputs its op's schema requires and no more than it
/// takes (`onnx_input_arity`): the engine's own ops of [`TF_DOMAIN`] are checked where they are
/// made.
fn check_arity(n: &NodeProto, opset: i64, describe: &str) -> Result<()> {
    if !matches!(n.domain(), "" | "ai.onnx") {
        return Ok(());
    }
    let Some((required, most)) = crate::op::onnx_input_arity(n.op_type(), opset) else { return Ok(()) };
    if let Some(k) = (0..required).find(|&k| n.input.get(k).is_none_or(|s| s.is_empty())) {
        return Err(Error::Corrupt(format!(
            "{describe}: input {k} is missing: it needs {required} inputs, {} given",
            n.input.iter().filter(|s| !s.is_empty()).count()
        )));
    }
    match most {
        Some(most) if n.input.len() > most => {
            Err(Error::Corrupt(format!("{describe}: {} inputs given; it takes at most {most}", n.input.len())))
        }
        _ => Ok(()),
    }
}

/// A node's name in the graph and in messages: its own, or `OpType_index` when it has none.
/// The dynamo exporter annotates each lifted module state's value_info with what
/// torch.export called it: `PARAMETER`, `BUFFER` (BatchNorm's running statistics, RoPE's
/// `inv_freq`, HF's `position_ids`) or `CONSTANT_TENSOR`. The initializers it calls anything
/// but a parameter.
fn declared_buffers(gp: &GraphProto, g: &Graph) -> BTreeSet<ValueId> {
    const KIND: &str = "pkg.torch.export.graph_signature.InputSpec.kind";
    let annotated = gp.value_info.iter().chain(&gp.input);
    annotated
        .filter(|vi| {
            vi.metadata_props.iter().any(|p| p.key() == KIND && matches!(p.value(), "BUFFER" | "CONSTANT_TENSOR"))
        })
        .filter_map(|vi| g.find(vi.name()))
        .filter(|v| g.initializers.contains_key(v))
        .collect()
}

fn node_name(n: &NodeProto, index: usize) -> String {
    if n.name().is_empty() {
        format!("{}_{index}", n.op_type())
    } else {
        n.name().to_string()
    }
}

/// Refuses a graph with operators the engine does not run, naming all of them at once (with
/// their node counts and first nodes), so that a model exported from PyTorch shows every gap in
/// one try. Ops of [`TF_DOMAIN`] are the engine's own and pass. Subgraphs are not looked into:
/// the ops that hold them (If, Loop, Scan) are themselves not run.
fn check_supported(gp: &GraphProto, origin: &str) -> Result<()> {
    // (op type, domain) -> (nodes, the first node's name); sorted by op type.
    let mut unsupported: BTreeMap<(&str, &str), (usize, String)> = BTreeMap::new();
    for (i, n) in gp.node.iter().enumerate() {
        let domain = if n.domain() == "ai.onnx" { "" } else { n.domain() };
        let supported = match domain {
            "" => SUPPORTED_ONNX_OPS.contains(&n.op_type()),
            d => d == TF_DOMAIN,
        };
        if !supported {
            unsupported.entry((n.op_type(), domain)).or_insert_with(|| (0, node_name(n, i))).0 += 1;
        }
    }
    if unsupported.is_empty() {
        return Ok(());
    }
    let s = |count: usize| if count == 1 { "" } else { "s" };
    let listed: Vec<String> = unsupported
        .iter()
        .map(|((op, domain), (count, first))| {
            let domain = if domain.is_empty() { String::new() } else { format!(" of domain '{domain}'") };
            format!("{op}{domain} ({count} node{}, first '{first}')", s(*count))
        })
        .collect();
    let count = unsupported.len();
    Err(Error::Unsupported(format!(
        "{origin}: {count} operator{} {} not supported: {}; supported: {}",
        s(count),
        if count == 1 { "is" } else { "are" },
        listed.join(", "),
        SUPPORTED_ONNX_OPS.join(", ")
    )))
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
    // Operands go out as inputs, as opset 18 takes all of them (a reduction's axes were an
    // attribute of every reduction but ReduceSum before it): a graph read at an older opset
    // is written at 18, whose other changes only add optional inputs and attributes.
    let mut opset_import = vec![OperatorSetIdProto { domain: Some(String::new()), version: Some(g.opset.max(18)) }];
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

#[cfg(test)]
mod tests {
    use super::*;

    fn node(op_type: &str, domain: &str, name: &str) -> NodeProto {
        NodeProto {
            op_type: Some(op_type.into()),
            domain: (!domain.is_empty()).then(|| domain.into()),
            name: Some(name.into()),
            ..Default::default()
        }
    }

    /// A node missing a required input, or giving more than its op takes, is refused naming it
    /// (a LayerNormalization without its scale reached the gradient rule, which panicked); an
    /// optional input left out by an empty name in the middle passes.
    #[test]
    fn nodes_are_held_to_their_ops_input_counts() {
        let with = |op: &str, inputs: &[&str]| NodeProto {
            input: inputs.iter().map(|s| s.to_string()).collect(),
            ..node(op, "", "n")
        };
        let refused = |n: NodeProto, opset: i64| check_arity(&n, opset, "m.onnx: node 'n'").unwrap_err().to_string();
        assert_eq!(
            refused(with("LayerNormalization", &["x"]), 17),
            "m.onnx: node 'n': input 1 is missing: it needs 2 inputs, 1 given"
        );
        assert_eq!(
            refused(with("Where", &["c", "", "y"]), 17),
            "m.onnx: node 'n': input 1 is missing: it needs 3 inputs, 2 given"
        );
        assert_eq!(refused(with("Relu", &["x", "x"]), 17), "m.onnx: node 'n': 2 inputs given; it takes at most 1");
        assert_eq!(
            refused(with("Slice", &["x", "s"]), 13),
            "m.onnx: node 'n': input 2 is missing: it needs 3 inputs, 2 given"
        );
        check_arity(&with("Slice", &["x"]), 9, "").expect("Slice's starts and ends are attributes before opset 10");
        check_arity(&with("Clip", &["x", "", "max"]), 13, "").expect("Clip without min");
        check_arity(&with("Concat", &["a", "b", "c", "d"]), 13, "").expect("variadic");
        check_arity(&with("Attention", &[]), 13, "").expect("not an op of the default domain's schema here");
        for op in SUPPORTED_ONNX_OPS {
            assert!(crate::op::onnx_input_arity(op, 21).is_some(), "{op} has no input arity");
        }
    }

    #[test]
    fn every_unsupported_operator_is_named_at_once_with_its_count_and_first_node() {
        let gp = GraphProto {
            node: vec![
                node("Relu", "", "relu"),
                node("Foo", "", "/attn/Foo"),
                node("FusedMatMul", TF_DOMAIN, "fused"),
                node("Bar", "ai.onnx", "bar_a"),
                node("Foo", "ai.onnx", "/attn/Foo_1"),
                node("Gelu", "com.microsoft", "ms_gelu"),
                node("Bar", "", ""),
                node("Foo", "", "/attn/Foo_2"),
            ],
            ..Default::default()
        };
        let e = check_supported(&gp, "model.onnx").unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)), "{e:?}");
        assert_eq!(e.exit_code(), 2);
        let text = e.to_string();
        let listed = "model.onnx: 3 operators are not supported: Bar (2 nodes, first 'bar_a'), \
                      Foo (3 nodes, first '/attn/Foo'), Gelu of domain 'com.microsoft' (1 node, first 'ms_gelu'); \
                      supported: ";
        assert!(text.starts_with(listed), "{text}");
        assert!(text.contains(&SUPPORTED_ONNX_OPS.join(", ")), "{text}");

        let one = GraphProto { node: vec![node("Baz", "", "")], ..Default::default() };
        let text = check_supported(&one, "m.onnx").unwrap_err().to_string();
        assert!(text.starts_with("m.onnx: 1 operator is not supported: Baz (1 node, first 'Baz_0'); "), "{text}");
    }

    #[test]
    fn supported_and_internal_operators_pass() {
        let mut gp = GraphProto { node: vec![node("FusedMatMul", TF_DOMAIN, "fused")], ..Default::default() };
        gp.node.extend(SUPPORTED_ONNX_OPS.iter().map(|op| node(op, "", op)));
        gp.node.extend(SUPPORTED_ONNX_OPS.iter().map(|op| node(op, "ai.onnx", op)));
        check_supported(&gp, "model.onnx").unwrap();
    }

    /// TopK and Einsum are written out when a graph is bound, but the model keeps them: an
    /// export writes them back as the loader reads them.
    #[test]
    fn top_k_and_einsum_are_written_as_they_are_read() {
        use crate::tensor::Tensor;
        let mut g = Graph::new("t", 13);
        let x = g.add_input("x", DType::F32, vec![Dim::Fixed(3), Dim::Fixed(4)]);
        let k = g.add_initializer("k", Tensor::from_vec(&[1], vec![2i64]));
        let top = g.add_node("topk", Op::TopK { axis: 0, largest: false, sorted: true }, &[x, k], 2);
        let y = g.op1("einsum", Op::Einsum { equation: "ij, ij -> j".into() }, &[top[0], top[0]]);
        g.outputs = vec![y, top[1]];
        let back = from_model(&to_model(&g, "test"), "t.onnx").unwrap();
        let ops: Vec<&Op> = back.nodes.iter().map(|n| &n.op).collect();
        assert_eq!(ops, [&g.nodes[0].op, &g.nodes[1].op]);
        assert_eq!(back.nodes[0].inputs.len(), 2, "K stays an input");
    }
}
