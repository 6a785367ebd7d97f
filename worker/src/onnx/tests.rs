//! Whole-model tests: round trips through files, external data, the fixtures that the `onnx`
//! Python package wrote (`worker/tests/data/onnx`, made by `make_fixtures.py` there), error
//! messages, and damaged files.

use super::proto::attribute_proto::AttributeType;
use super::proto::simple_sharded_dim_proto::Dim;
use super::proto::type_proto;
use super::*;
use crate::tensor::{DType, Tensor};
use half::{bf16, f16};
use std::fs;
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/onnx").join(name)
}

/// A fresh directory of its own under the system's temporary one, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(test: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("tensorfleet-onnx-{test}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn node(op_type: &str, name: &str, input: &[&str], output: &[&str]) -> NodeProto {
    NodeProto {
        op_type: Some(op_type.into()),
        name: Some(name.into()),
        input: input.iter().map(|s| s.to_string()).collect(),
        output: output.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

fn attribute(name: &str, kind: AttributeType) -> AttributeProto {
    let mut a = AttributeProto { name: Some(name.into()), ..Default::default() };
    a.set_type(kind);
    a
}

fn tensor_attribute(name: &str, t: TensorProto) -> AttributeProto {
    AttributeProto { t: Some(t), ..attribute(name, AttributeType::Tensor) }
}

fn graph_attribute(name: &str, g: GraphProto) -> AttributeProto {
    AttributeProto { g: Some(g), ..attribute(name, AttributeType::Graph) }
}

fn float_input(name: &str, dims: &[i64]) -> ValueInfoProto {
    use proto::tensor_shape_proto::{dimension, Dimension};
    let dim =
        dims.iter().map(|&d| Dimension { value: Some(dimension::Value::DimValue(d)), ..Default::default() }).collect();
    ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: Some(1),
                shape: Some(TensorShapeProto { dim }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn ramp(n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|i| i as f32 * scale).collect()
}

/// Y = X·W + B, an If whose then-branch has its own initializer, a Constant; ending with its
/// single default-domain opset import, so that every shorter prefix of its encoding is invalid.
fn small_model() -> ModelProto {
    let then_branch = GraphProto {
        name: Some("then".into()),
        node: vec![node("Identity", "then_id", &["W2"], &["T"])],
        initializer: vec![tensor_to_proto("W2", &Tensor::from_vec(&[32], ramp(32, -1.0)))],
        output: vec![float_input("T", &[32])],
        ..Default::default()
    };
    let else_branch = GraphProto {
        name: Some("else".into()),
        node: vec![NodeProto {
            attribute: vec![tensor_attribute("value", tensor_to_proto("", &Tensor::from_vec(&[32], vec![0.0f32; 32])))],
            ..node("Constant", "else_const", &[], &["E"])
        }],
        output: vec![float_input("E", &[32])],
        ..Default::default()
    };
    let graph = GraphProto {
        name: Some("small".into()),
        node: vec![
            node("MatMul", "matmul", &["X", "W"], &["XW"]),
            node("Add", "add", &["XW", "B"], &["Y"]),
            NodeProto {
                attribute: vec![
                    graph_attribute("then_branch", then_branch),
                    graph_attribute("else_branch", else_branch),
                ],
                ..node("If", "if", &["C"], &["Z"])
            },
            NodeProto {
                attribute: vec![tensor_attribute(
                    "value",
                    tensor_to_proto("", &Tensor::from_vec(&[2], vec![7i64, -7])),
                )],
                ..node("Constant", "shape", &[], &["S"])
            },
        ],
        initializer: vec![
            tensor_to_proto("W", &Tensor::from_vec(&[16, 16], ramp(256, 0.5))),
            tensor_to_proto("B", &Tensor::from_vec(&[16], vec![0.25f32; 16])),
        ],
        input: vec![float_input("X", &[1, 16])],
        output: vec![float_input("Y", &[1, 16])],
        ..Default::default()
    };
    ModelProto {
        ir_version: Some(10),
        producer_name: Some("tensorfleet-test".into()),
        graph: Some(graph),
        opset_import: vec![OperatorSetIdProto { domain: Some(String::new()), version: Some(17) }],
        ..Default::default()
    }
}

/// `small_model` with everything a model may carry besides its graph.
fn full_model() -> ModelProto {
    let algorithm = GraphProto {
        name: Some("algorithm".into()),
        node: vec![node("Sub", "update", &["W", "lr"], &["W_new"])],
        initializer: vec![tensor_to_proto("lr", &Tensor::scalar(0.1f32))],
        ..Default::default()
    };
    let entry = |k: &str, v: &str| StringStringEntryProto { key: Some(k.into()), value: Some(v.into()) };
    ModelProto {
        doc_string: Some("a test model".into()),
        metadata_props: vec![entry("author", "tests")],
        training_info: vec![TrainingInfoProto {
            algorithm: Some(algorithm),
            update_binding: vec![entry("W", "W_new")],
            ..Default::default()
        }],
        functions: vec![FunctionProto {
            name: Some("Square".into()),
            domain: Some("test".into()),
            input: vec!["a".into()],
            output: vec!["b".into()],
            node: vec![node("Mul", "mul", &["a", "a"], &["b"])],
            ..Default::default()
        }],
        ..small_model()
    }
}

fn initializer<'a>(g: &'a GraphProto, name: &str) -> &'a TensorProto {
    g.initializer.iter().find(|t| t.name() == name).unwrap()
}

fn value(g: &GraphProto, name: &str) -> Tensor {
    tensor_from_proto(initializer(g, name), "test").unwrap()
}

fn subgraph<'a>(g: &'a GraphProto, node: &str, attr: &str) -> &'a GraphProto {
    let n = g.node.iter().find(|n| n.name() == node).unwrap();
    n.attribute.iter().find(|a| a.name() == attr).unwrap().g.as_ref().unwrap()
}

fn location(t: &TensorProto) -> Vec<(&str, &str)> {
    t.external_data.iter().map(|e| (e.key(), e.value())).collect()
}

fn message(r: Result<ModelProto, Error>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => {
            assert!(matches!(e, Error::Corrupt(_)), "not Corrupt: {e}");
            e.to_string()
        }
    }
}

#[test]
fn model_built_in_rust_round_trips_through_a_file() {
    let dir = Scratch::new("round-trip");
    let model = full_model();
    save_model(&model, &dir.path("m.onnx")).unwrap();
    let loaded = load_model(&dir.path("m.onnx")).unwrap();
    assert_eq!(loaded, model);
    assert_eq!(default_opset(&loaded), 17);
    let left: Vec<_> = std::fs::read_dir(dir.path("")).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left, ["m.onnx"], "no temporary file is left");
    let graph = loaded.graph.as_ref().unwrap();
    assert_eq!(value(graph, "W").as_slice::<f32>(), &ramp(256, 0.5)[..]);
}

#[test]
fn external_data_moves_big_initializers_and_loads_back() {
    let dir = Scratch::new("external");
    let model = full_model();
    let path = dir.path("m.onnx");
    save_model_with_external_data(&model, &path, 100).unwrap();

    // W (1024 bytes) of the main graph and W2 (128 bytes) of the If branch move, in that order;
    // B (64 bytes), the Constants and training_info stay.
    assert_eq!(fs::metadata(dir.path("m.onnx.data")).unwrap().len(), 1024 + 128);
    let stored = decode_model(&fs::read(&path).unwrap(), "m.onnx").unwrap();
    let graph = stored.graph.as_ref().unwrap();
    let w = initializer(graph, "W");
    assert_eq!((w.data_location(), w.raw_data.as_ref()), (DataLocation::External, None));
    assert_eq!(location(w), [("location", "m.onnx.data"), ("offset", "0"), ("length", "1024")]);
    let w2 = initializer(subgraph(graph, "if", "then_branch"), "W2");
    assert_eq!(location(w2), [("location", "m.onnx.data"), ("offset", "1024"), ("length", "128")]);
    assert_eq!(initializer(graph, "B").raw_data.as_ref().map(Vec::len), Some(64));
    assert!(subgraph(graph, "if", "else_branch").node[0].attribute[0].t.as_ref().unwrap().raw_data.is_some());
    assert_eq!(stored.training_info, model.training_info);

    assert_eq!(load_model(&path).unwrap(), model);

    // Nothing reaches the threshold: no side file, as with onnx.
    let path = dir.path("inline.onnx");
    save_model_with_external_data(&model, &path, 1 << 20).unwrap();
    assert!(!dir.path("inline.onnx.data").exists());
    assert_eq!(load_model(&path).unwrap(), model);
}

#[test]
fn loads_external_data_written_by_onnx_and_writes_the_same_layout() {
    let model = load_model(&fixture("external/model.onnx")).unwrap();
    let graph = model.graph.as_ref().unwrap();
    assert_eq!(value(graph, "W").as_slice::<f32>(), &ramp(128, 0.5)[..]);
    assert_eq!(value(graph, "B").as_slice::<f32>(), &[0.25; 8]);
    let w2 = value(subgraph(graph, "if", "then_branch"), "W2");
    assert_eq!(w2.as_slice::<f32>(), &(0..64).map(|i| i as f32 - 32.0).collect::<Vec<_>>()[..]);
    assert!(initializer(graph, "W").external_data.is_empty());

    // onnx's threshold counts 33 bytes of Python object header: its 128 is our 95.
    let dir = Scratch::new("external-layout");
    save_model_with_external_data(&model, &dir.path("model.onnx"), 95).unwrap();
    for name in ["model.onnx", "model.onnx.data"] {
        let ours = fs::read(dir.path(name)).unwrap();
        assert!(ours == fs::read(fixture(&format!("external/{name}"))).unwrap(), "{name} differs");
    }
}

#[test]
fn loads_raw_and_typed_initializers_written_by_onnx() {
    let model = load_model(&fixture("typed_and_raw.onnx")).unwrap();
    assert_eq!((model.ir_version(), default_opset(&model)), (11, 17));
    let g = model.graph.as_ref().unwrap();
    assert!(initializer(g, "W").raw_data.is_some() && !initializer(g, "B").float_data.is_empty());
    let w = value(g, "W");
    assert_eq!((w.shape(), w.as_slice::<f32>()), (&[3, 2][..], &ramp(6, 0.5)[..]));
    assert_eq!(value(g, "B").as_slice::<f32>(), &[0.25, -1.0]);
    assert_eq!(value(g, "i64").as_slice::<i64>(), &[-1, 0, 1 << 40]);
    assert_eq!(value(g, "i64_raw").as_slice::<i64>(), &[5, -5]);
    assert_eq!(value(g, "i32").as_slice::<i32>(), &[-7, i32::MAX]);
    assert_eq!(value(g, "i16").as_slice::<i16>(), &[-300, 300]);
    assert_eq!(value(g, "i8").as_slice::<i8>(), &[-128, 127]);
    assert_eq!(value(g, "u16").as_slice::<u16>(), &[65535]);
    assert_eq!(value(g, "u8").as_slice::<u8>(), &[0, 255]);
    let b = value(g, "bool");
    assert_eq!((b.dtype(), b.bytes()), (DType::Bool, &[1u8, 0, 1][..]));
    assert_eq!(value(g, "f16").as_slice::<f16>(), &[f16::from_f32(1.5), f16::from_f32(-2.0)]);
    assert_eq!(value(g, "bf16").as_slice::<bf16>(), &[bf16::from_f32(1.5), bf16::from_f32(-2.0)]);
    assert_eq!(value(g, "f64").as_slice::<f64>(), &[0.1, -1e300]);
    assert_eq!(value(g, "u32").as_slice::<u32>(), &[4_000_000_000]);
    assert_eq!(value(g, "u64").as_slice::<u64>(), &[u64::MAX]);
}

#[test]
fn training_info_is_kept_when_resaving() {
    let model = load_model(&fixture("training_info.onnx")).unwrap();
    let [info] = &model.training_info[..] else { panic!("one training_info expected") };
    assert_eq!(info.initialization.as_ref().unwrap().node[0].op_type(), "RandomNormal");
    let algorithm = info.algorithm.as_ref().unwrap();
    assert_eq!(value(algorithm, "lr").as_slice::<f32>(), &[0.1]);
    assert_eq!(location_pairs(&info.update_binding), [("W", "W_new")]);
    assert_eq!(location_pairs(&info.initialization_binding), [("W", "W_init")]);

    let dir = Scratch::new("training-info");
    save_model(&model, &dir.path("m.onnx")).unwrap();
    assert_eq!(fs::read(dir.path("m.onnx")).unwrap(), fs::read(fixture("training_info.onnx")).unwrap());
    assert_eq!(load_model(&dir.path("m.onnx")).unwrap(), model);
}

fn location_pairs(entries: &[StringStringEntryProto]) -> Vec<(&str, &str)> {
    entries.iter().map(|e| (e.key(), e.value())).collect()
}

/// Re-encoding what onnx wrote gives back its bytes: every field number, type and packing of
/// the messages agrees with onnx's own (all_fields.onnx sets every field of onnx-ml.proto).
#[test]
fn fixtures_re_encode_byte_for_byte() {
    for name in ["all_fields.onnx", "typed_and_raw.onnx", "training_info.onnx", "external/model.onnx"] {
        let bytes = fs::read(fixture(name)).unwrap();
        let model = decode_model(&bytes, name).unwrap();
        assert_eq!(dropped_bytes(bytes.len(), &model), 0, "{name}");
        assert!(model.encode_to_vec() == bytes, "{name} re-encodes differently");
    }
}

#[test]
fn all_fields_decode_to_what_onnx_wrote() {
    let model = load_model(&fixture("all_fields.onnx")).unwrap();
    assert_eq!((model.ir_version(), model.model_version(), default_opset(&model)), (11, 7, 23));
    assert_eq!(model.configuration[0].device, ["cuda:0", "cuda:1"]);
    assert_eq!(model.functions[0].node[0].attribute[0].ref_attr_name(), "alpha");
    let g = model.graph.as_ref().unwrap();
    let n = &g.node[0];
    assert_eq!((n.domain(), n.overload(), n.doc_string()), ("test.domain", "v2", "a node"));
    let spec = &n.device_configurations[0].sharding_spec[0];
    assert_eq!(spec.index_to_device_group_map[0].value, [0, 1]);
    let dims: Vec<_> = spec.sharded_dim[0].simple_sharding.iter().map(|s| s.dim.clone()).collect();
    assert_eq!(dims, [Some(Dim::DimValue(4)), Some(Dim::DimParam("N".into()))]);
    // Each attribute's type names the field that holds its value.
    for a in &n.attribute {
        let set = match a.r#type() {
            AttributeType::Float => a.f.is_some(),
            AttributeType::Int => a.i.is_some(),
            AttributeType::String => a.s.is_some(),
            AttributeType::Tensor => a.t.is_some(),
            AttributeType::Graph => a.g.is_some(),
            AttributeType::SparseTensor => a.sparse_tensor.is_some(),
            AttributeType::TypeProto => a.tp.is_some(),
            AttributeType::Floats => a.floats == [1.0, 2.5],
            AttributeType::Ints => a.ints == [1, -2, 3],
            AttributeType::Strings => a.strings == [b"x".to_vec(), b"yz".to_vec()],
            AttributeType::Tensors => a.tensors.len() == 2,
            AttributeType::Graphs => a.graphs.len() == 1,
            AttributeType::SparseTensors => a.sparse_tensors.len() == 1,
            AttributeType::TypeProtos => a.type_protos.len() == 2,
            AttributeType::Undefined => false,
        };
        assert!(set, "attribute {:?}", a.name());
    }
    let kinds: Vec<_> = g.value_info.iter().map(|v| v.r#type.as_ref().unwrap().value.clone()).collect();
    assert!(matches!(kinds[0], Some(type_proto::Value::SequenceType(_))));
    assert!(matches!(kinds[1], Some(type_proto::Value::MapType(_))));
    assert!(matches!(kinds[2], Some(type_proto::Value::OptionalType(_))));
    assert!(matches!(kinds[3], Some(type_proto::Value::SparseTensorType(_))));
    let Some(type_proto::Value::OpaqueType(opaque)) = &kinds[4] else { panic!("opaque type") };
    assert_eq!(opaque.name(), "Blob");
    let sparse = &g.sparse_initializer[0];
    assert_eq!(
        (sparse.dims.as_slice(), sparse.values.as_ref().unwrap().float_data.as_slice()),
        (&[2, 2][..], &[5.0, 6.0][..])
    );
    // Types the engine does not compute with load, and convert to a clear error.
    let e = tensor_from_proto(initializer(g, "t_str"), "all_fields.onnx").unwrap_err();
    assert_eq!(e.to_string(), "all_fields.onnx: tensor \"t_str\": string tensors are not supported");
}

#[test]
fn unknown_fields_are_counted_as_dropped() {
    let mut bytes = small_model().encode_to_vec();
    // Field 99, varint 1: a field no IR version defines.
    bytes.extend([0x98, 0x06, 0x01]);
    let model = decode_model(&bytes, "m.onnx").unwrap();
    assert_eq!(dropped_bytes(bytes.len(), &model), 3);
    assert_eq!(model, small_model());
}

#[test]
fn unreadable_files_are_config_errors_naming_the_file() {
    let dir = Scratch::new("missing");
    let missing = dir.path("nope.onnx");
    let e = load_model(&missing).unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e}");
    assert!(e.to_string().starts_with(&format!("{}: cannot read it", missing.display())), "{e}");
    assert!(matches!(load_model(&dir.0).unwrap_err(), Error::Config(_)));

    fs::write(dir.path("empty.onnx"), b"").unwrap();
    let e = message(load_model(&dir.path("empty.onnx")));
    assert!(e.ends_with("empty.onnx: the file is empty, not an ONNX model"), "{e}");
    let e = message(decode_model(b"\x08\x0a\x3a\xff", "m.onnx"));
    assert!(e.starts_with("m.onnx: not a valid ONNX model: "), "{e}");
}

#[test]
fn versions_outside_the_supported_ranges_are_refused() {
    let with = |f: &dyn Fn(&mut ModelProto)| {
        let mut m = small_model();
        f(&mut m);
        decode_model(&m.encode_to_vec(), "m.onnx")
    };
    let e = message(with(&|m| m.ir_version = Some(12)));
    assert!(e.starts_with("m.onnx: ir_version 12 is newer than this worker reads (3 to 11"), "{e}");
    let e = message(with(&|m| m.ir_version = Some(2)));
    assert!(e.starts_with("m.onnx: ir_version 2 is older"), "{e}");
    let e = message(with(&|m| m.ir_version = None));
    assert!(e.starts_with("m.onnx: ir_version is not set"), "{e}");
    let e = message(with(&|m| m.graph = None));
    assert_eq!(e, "m.onnx: the model has no graph");
    for bad in [6, 24] {
        let e = message(with(&|m| m.opset_import[0].version = Some(bad)));
        assert!(e.starts_with(&format!("m.onnx: opset_import: default-domain opset {bad} is outside 7 to 23")), "{e}");
    }
    let e = message(with(&|m| m.opset_import[0].domain = Some("com.microsoft".into())));
    assert!(e.contains("names no version of the default domain"), "{e}");
    let e = message(with(&|m| {
        m.opset_import.push(OperatorSetIdProto { domain: Some("ai.onnx".into()), version: Some(13) })
    }));
    assert!(e.ends_with("more than once, at opsets [13, 17]"), "{e}");

    // "ai.onnx" is the default domain too, and opset 7 and 23 are in range.
    for v in [7, 23] {
        let m = with(&|m| m.opset_import[0] = OperatorSetIdProto { domain: Some("ai.onnx".into()), version: Some(v) });
        assert_eq!(default_opset(&m.unwrap()), v);
    }
}

#[test]
fn bad_tensors_are_named_by_where_they_sit() {
    let mut m = small_model();
    let g = m.graph.as_mut().unwrap();
    g.initializer.push(TensorProto {
        name: Some("h.0.attn.c_attn.weight".into()),
        dims: vec![64, 192],
        data_type: Some(1),
        raw_data: Some(vec![0; 100]),
        ..Default::default()
    });
    assert_eq!(
        message(decode_model(&m.encode_to_vec(), "model.onnx")),
        "model.onnx: initializer \"h.0.attn.c_attn.weight\": raw_data holds 100 bytes, dims \
         [64,192] of float32 need 49152"
    );

    let mut m = small_model();
    let g = m.graph.as_mut().unwrap();
    g.node[3].attribute[0].t.as_mut().unwrap().dims = vec![3];
    assert_eq!(
        message(decode_model(&m.encode_to_vec(), "m.onnx")),
        "m.onnx: node \"shape\" (Constant) attribute \"value\": raw_data holds 16 bytes, dims [3] \
         of int64 need 24"
    );

    let mut m = small_model();
    let g = m.graph.as_mut().unwrap();
    let then = g.node[2].attribute[0].g.as_mut().unwrap();
    then.initializer[0].data_type = Some(99);
    assert_eq!(
        message(decode_model(&m.encode_to_vec(), "m.onnx")),
        "m.onnx: node \"if\" (If) attribute \"then_branch\": initializer \"W2\": data_type 99 is \
         not an ONNX element type"
    );

    let mut m = full_model();
    m.training_info[0].algorithm.as_mut().unwrap().initializer[0].dims = vec![-1];
    assert_eq!(
        message(decode_model(&m.encode_to_vec(), "m.onnx")),
        "m.onnx: training_info[0].algorithm: initializer \"lr\": dims [-1] has a negative dimension"
    );
}

/// Writes `small_model` with W's data in `w.bin` at `location`, `offset` and `length`.
fn external_model(dir: &Scratch, location: &str, offset: &str, length: Option<&str>) -> PathBuf {
    let mut m = small_model();
    let w = &mut m.graph.as_mut().unwrap().initializer[0];
    let raw = w.raw_data.take().unwrap();
    let mut data = vec![0xAA; 8];
    data.extend(&raw);
    fs::write(dir.path("w.bin"), data).unwrap();
    w.set_data_location(DataLocation::External);
    let entry = |k: &str, v: &str| StringStringEntryProto { key: Some(k.into()), value: Some(v.into()) };
    w.external_data = vec![entry("location", location), entry("offset", offset)];
    w.external_data.extend(length.map(|l| entry("length", l)));
    let path = dir.path("m.onnx");
    save_model(&m, &path).unwrap();
    path
}

#[test]
fn external_data_is_read_from_inside_the_model_directory_only() {
    let dir = Scratch::new("external-errors");
    let w = |m: ModelProto| m.graph.unwrap().initializer[0].clone();
    let want = w(small_model());
    // Offset and length as given; without a length, to the end of the file; "./" is fine.
    assert_eq!(w(load_model(&external_model(&dir, "w.bin", "8", Some("1024"))).unwrap()), want);
    assert_eq!(w(load_model(&external_model(&dir, "./w.bin", "8", None)).unwrap()), want);

    let fails = |location: &str, offset: &str, length: Option<&str>| {
        let path = external_model(&dir, location, offset, length);
        let e = message(load_model(&path));
        let prefix = format!("{}: initializer \"W\": ", path.display());
        assert!(e.starts_with(&prefix), "{e}");
        e[prefix.len()..].to_string()
    };
    assert!(fails("../w.bin", "8", None).starts_with("external data location \"../w.bin\" must be a path inside"));
    let e = fails("/etc/passwd", "0", None);
    assert!(e.contains("must be a path inside the model's directory"), "{e}");
    assert!(fails("", "0", None).contains("external_data has no location"));
    assert!(fails("gone.bin", "0", None).starts_with("cannot open its external data file"));
    assert!(fails("w.bin", "eight", None).starts_with("external_data offset \"eight\" is not a byte count"));
    assert_eq!(
        fails("w.bin", "8", Some("2048")),
        format!(
            "external data file {} holds 1032 bytes, the tensor's data would be bytes 8..2056",
            dir.path("w.bin").display()
        )
    );
    assert_eq!(
        fails("w.bin", "0", None),
        "external data \"w.bin\" bytes 0..1032: raw_data holds 1032 bytes, dims [16,16] of \
         float32 need 1024"
    );

    #[cfg(unix)]
    {
        let outside = Scratch::new("external-outside");
        fs::write(outside.path("secret.bin"), vec![0u8; 1024]).unwrap();
        std::os::unix::fs::symlink(outside.path("secret.bin"), dir.path("link.bin")).unwrap();
        assert!(fails("link.bin", "0", None).contains("outside the model's directory"));
    }
}

/// A tiny deterministic generator for the property tests (xorshift64).
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Runs everything a loaded model goes through; a damaged file may fail anywhere, never panic.
fn exercise(bytes: &[u8], dir: &Path) -> bool {
    let Ok(mut model) = decode_model(bytes, "fuzz.onnx") else {
        return false;
    };
    if resolve_external_data(&mut model, dir, "fuzz.onnx").is_err() {
        return false;
    }
    for_each_tensor(&mut model, &mut |t, _, _| {
        let _ = tensor_from_proto(t, "fuzz.onnx");
        Ok(())
    })
    .unwrap();
    let _ = default_opset(&model);
    let _ = model.encode_to_vec();
    true
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = small_model().encode_to_vec();
    assert!(decode_model(&bytes, "m.onnx").is_ok());
    for len in 0..bytes.len() {
        assert!(decode_model(&bytes[..len], "m.onnx").is_err(), "prefix of {len} bytes loaded");
    }
}

#[test]
fn flipped_bytes_never_panic() {
    let dir = Scratch::new("flips");
    for bytes in [small_model().encode_to_vec(), fs::read(fixture("all_fields.onnx")).unwrap()] {
        let mut refused = 0;
        for i in 0..bytes.len() {
            for mask in [0x01u8, 0x80, 0xff] {
                let mut damaged = bytes.clone();
                damaged[i] ^= mask;
                refused += usize::from(!exercise(&damaged, &dir.0));
            }
        }
        // Flips in names and float bits load; flips in tags, lengths and dims do not.
        assert!(refused > bytes.len() / 2 && refused < bytes.len() * 3, "{refused} refused");
    }
}

#[test]
fn random_damage_never_panics() {
    let dir = Scratch::new("damage");
    let seeds = [small_model().encode_to_vec(), fs::read(fixture("all_fields.onnx")).unwrap()];
    let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
    for round in 0..4000 {
        let mut bytes = seeds[round % seeds.len()].clone();
        for _ in 0..1 + rng.below(4) {
            let at = rng.below(bytes.len());
            match rng.below(6) {
                0 => bytes[at] ^= 1 << rng.below(8),
                1 => bytes[at] = rng.next() as u8,
                2 => {
                    let end = (at + 1 + rng.below(16)).min(bytes.len());
                    bytes.drain(at..end);
                }
                3 => {
                    let end = (at + 1 + rng.below(16)).min(bytes.len());
                    let copy = bytes[at..end].to_vec();
                    bytes.splice(at..at, copy);
                }
                4 => {
                    let noise: Vec<u8> = (0..1 + rng.below(8)).map(|_| rng.next() as u8).collect();
                    bytes.splice(at..at, noise);
                }
                _ => bytes.truncate(at),
            }
            if bytes.is_empty() {
                break;
            }
        }
        exercise(&bytes, &dir.0);
    }
}

/// A float attribute, or (with `refers`) one that takes the calling node's attribute `refers`.
fn float_attribute(name: &str, value: Option<f32>, refers: Option<&str>) -> AttributeProto {
    let mut a = attribute(name, AttributeType::Float);
    a.f = value;
    a.ref_attr_name = refers.map(str::to_string);
    a
}

/// Model-local functions are inlined: a function calling another, an attribute passed down by
/// reference or left to the function's default, two calls of one function kept apart.
#[test]
fn functions_are_inlined_with_their_attributes() {
    use crate::backend::cpu::CpuBackend;
    use crate::exec::Executor;
    use crate::graph::infer::{bind, Bindings};
    let local = |mut n: NodeProto| {
        n.domain = Some("local".into());
        n
    };
    // Inner(x) = LeakyRelu(x, alpha = @alpha, default 0.5); Outer(a, b) = Inner(a + b, alpha = @slope).
    let inner = FunctionProto {
        name: Some("Inner".into()),
        domain: Some("local".into()),
        input: vec!["x".into()],
        output: vec!["y".into()],
        attribute_proto: vec![float_attribute("alpha", Some(0.5), None)],
        node: vec![NodeProto {
            attribute: vec![float_attribute("alpha", None, Some("alpha"))],
            ..node("LeakyRelu", "leaky", &["x"], &["y"])
        }],
        opset_import: vec![OperatorSetIdProto { domain: Some(String::new()), version: Some(17) }],
        ..Default::default()
    };
    let outer = FunctionProto {
        name: Some("Outer".into()),
        domain: Some("local".into()),
        input: vec!["a".into(), "b".into()],
        output: vec!["out".into()],
        attribute: vec!["slope".into()],
        node: vec![
            node("Add", "sum", &["a", "b"], &["t"]),
            NodeProto {
                attribute: vec![float_attribute("alpha", None, Some("slope"))],
                ..local(node("Inner", "act", &["t"], &["out"]))
            },
        ],
        ..Default::default()
    };
    let graph = GraphProto {
        name: Some("g".into()),
        node: vec![
            NodeProto {
                attribute: vec![float_attribute("slope", Some(0.1), None)],
                ..local(node("Outer", "first", &["X", "Y"], &["Z"]))
            },
            local(node("Outer", "second", &["Z", "Y"], &["W"])),
        ],
        input: vec![float_input("X", &[4]), float_input("Y", &[4])],
        output: vec![float_input("W", &[4])],
        ..Default::default()
    };
    let model = ModelProto {
        ir_version: Some(8),
        opset_import: vec![
            OperatorSetIdProto { domain: Some(String::new()), version: Some(17) },
            OperatorSetIdProto { domain: Some("local".into()), version: Some(1) },
        ],
        graph: Some(graph),
        functions: vec![inner, outer],
        ..Default::default()
    };
    let g = crate::graph::onnx_io::from_model(&model, "m.onnx").unwrap();
    let names: Vec<&str> = g.nodes.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, ["first/sum", "first/act/leaky", "second/sum", "second/act/leaky"]);

    let bound = bind(&g, &Bindings::default(), false).unwrap();
    let mut ex = Executor::new(std::sync::Arc::new(CpuBackend::new()), bound, &[]).unwrap();
    let (x, y) = (vec![-4f32, -1.0, 1.0, 2.0], vec![1f32, -1.0, 0.5, -3.0]);
    ex.feed(g.find("X").unwrap(), &Tensor::from_vec(&[4], x.clone())).unwrap();
    ex.feed(g.find("Y").unwrap(), &Tensor::from_vec(&[4], y.clone())).unwrap();
    ex.run(0).unwrap();
    let leaky = |v: f32, alpha: f32| if v < 0.0 { alpha * v } else { v };
    let want: Vec<f32> = x.iter().zip(&y).map(|(a, b)| leaky(leaky(a + b, 0.1) + b, 0.5)).collect();
    assert_eq!(ex.fetch(g.find("W").unwrap()).unwrap().as_slice::<f32>(), &want[..]);

    // A function imported at another opset than the model's is refused, naming it.
    let mut other = model.clone();
    other.functions[0].opset_import[0].version = Some(13);
    let e = crate::graph::onnx_io::from_model(&other, "m.onnx").unwrap_err();
    assert!(matches!(e, Error::Unsupported(_)) && e.to_string().contains("function 'Inner'"), "{e}");
}
