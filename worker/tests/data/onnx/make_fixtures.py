#!/usr/bin/env python3
"""Writes the ONNX fixtures that worker/src/onnx/tests.rs loads, with the real `onnx` package.

    python3 -m venv /tmp/onnxvenv && /tmp/onnxvenv/bin/pip install onnx==1.18.0 numpy
    /tmp/onnxvenv/bin/python worker/tests/data/onnx/make_fixtures.py

onnx 1.18 writes IR version 11 and knows opset 23, the newest this worker reads. The output is
deterministic; the Rust tests hard-code the values written here, so change both together.
"""

import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = os.path.dirname(os.path.abspath(__file__))
OPSET = [helper.make_opsetid("", 17)]


def save(model, name):
    path = os.path.join(HERE, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    onnx.save_model(model, path)


def typed_and_raw():
    """Y = MatMul(X, W) + B, W in raw_data, B and the extra tensors in the typed fields."""
    w = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(3, 2) * 0.5, "W")
    b = helper.make_tensor("B", TensorProto.FLOAT, [2], [0.25, -1.0])
    typed = [
        helper.make_tensor("i64", TensorProto.INT64, [3], [-1, 0, 1 << 40]),
        helper.make_tensor("i32", TensorProto.INT32, [2], [-7, 2**31 - 1]),
        helper.make_tensor("i16", TensorProto.INT16, [2], [-300, 300]),
        helper.make_tensor("i8", TensorProto.INT8, [2], [-128, 127]),
        helper.make_tensor("u16", TensorProto.UINT16, [1], [65535]),
        helper.make_tensor("u8", TensorProto.UINT8, [2], [0, 255]),
        helper.make_tensor("bool", TensorProto.BOOL, [3], [True, False, True]),
        helper.make_tensor("f16", TensorProto.FLOAT16, [2], np.array([1.5, -2.0], np.float16)),
        helper.make_tensor("bf16", TensorProto.BFLOAT16, [2], [1.5, -2.0]),
        helper.make_tensor("f64", TensorProto.DOUBLE, [2], [0.1, -1e300]),
        helper.make_tensor("u32", TensorProto.UINT32, [1], [4000000000]),
        helper.make_tensor("u64", TensorProto.UINT64, [1], [2**64 - 1]),
        numpy_helper.from_array(np.array([5, -5], np.int64), "i64_raw"),
    ]
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["X", "W"], ["XW"], name="matmul"),
            helper.make_node("Add", ["XW", "B"], ["Y"], name="add"),
        ],
        "typed_and_raw",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 3])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 2])],
        [w, b] + typed,
    )
    save(helper.make_model(graph, opset_imports=OPSET, producer_name="make_fixtures"),
         "typed_and_raw.onnx")


def external():
    """Big initializers in model.onnx.data, as onnx.save_model(save_as_external_data=True) does:
    W (512 bytes) of the main graph and W2 (256 bytes) of an If branch move, B (32 bytes) stays,
    and so does the Constant's value (attribute tensors stay by default)."""
    w = numpy_helper.from_array(np.arange(128, dtype=np.float32).reshape(16, 8) * 0.5, "W")
    b = numpy_helper.from_array(np.full(8, 0.25, np.float32), "B")
    w2 = numpy_helper.from_array(np.arange(64, dtype=np.float32) - 32, "W2")
    then_branch = helper.make_graph(
        [helper.make_node("Identity", ["W2"], ["T"], name="then_id")], "then", [],
        [helper.make_tensor_value_info("T", TensorProto.FLOAT, [64])], [w2])
    else_branch = helper.make_graph(
        [helper.make_node("Constant", [], ["E"], name="else_const",
                          value=numpy_helper.from_array(np.zeros(64, np.float32)))], "else", [],
        [helper.make_tensor_value_info("E", TensorProto.FLOAT, [64])])
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["X", "W"], ["XW"], name="matmul"),
            helper.make_node("Add", ["XW", "B"], ["Y"], name="add"),
            helper.make_node("If", ["C"], ["Z"], name="if",
                             then_branch=then_branch, else_branch=else_branch),
        ],
        "external",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 16]),
         helper.make_tensor_value_info("C", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 8]),
         helper.make_tensor_value_info("Z", TensorProto.FLOAT, [64])],
        [w, b],
    )
    model = helper.make_model(graph, opset_imports=OPSET, producer_name="make_fixtures")
    os.makedirs(os.path.join(HERE, "external"), exist_ok=True)
    data = os.path.join(HERE, "external", "model.onnx.data")
    if os.path.exists(data):
        os.remove(data)  # onnx appends to an existing data file
    # onnx compares sys.getsizeof(raw_data) (33 bytes more than its length) with the threshold.
    onnx.save_model(model, os.path.join(HERE, "external", "model.onnx"),
                    save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data", size_threshold=128)


def training_info():
    """A model with ONNX's training IR: initialization and algorithm graphs with bindings."""
    w = numpy_helper.from_array(np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), "W")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y"], name="matmul")], "inference",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 2])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 2])], [w])
    init = helper.make_graph(
        [helper.make_node("RandomNormal", [], ["W_init"], name="init_w", shape=[2, 2])],
        "initialization", [], [helper.make_tensor_value_info("W_init", TensorProto.FLOAT, [2, 2])])
    lr = numpy_helper.from_array(np.array(0.1, np.float32), "lr")
    algo = helper.make_graph(
        [helper.make_node("Mul", ["W", "lr"], ["step"], name="scale"),
         helper.make_node("Sub", ["W", "step"], ["W_new"], name="update")],
        "algorithm", [], [helper.make_tensor_value_info("W_new", TensorProto.FLOAT, [2, 2])], [lr])
    info = helper.make_training_info(algo, [("W", "W_new")], init, [("W", "W_init")])
    model = helper.make_model(graph, opset_imports=OPSET, producer_name="make_fixtures")
    model.training_info.append(info)
    save(model, "training_info.onnx")


def props(tag):
    return [onnx.StringStringEntryProto(key=f"{tag}_key", value=f"{tag}_value")]


def all_fields():
    """Every message and field of onnx-ml.proto (IR 11) set at least once, for a byte-exact
    round trip through the Rust messages; only TensorProto's segment, raw_data and external data
    fields are left to the other fixtures. Not meant to run; only to be well-formed. TypeProto's
    denotation is set only beside tensor, sequence and map types: prost writes a oneof at the
    position of its lowest tag, so with the others the bytes would come out in another order."""
    t_typed = helper.make_tensor("t_typed", TensorProto.FLOAT, [2], [1.0, 2.0])
    t_typed.doc_string = "a tensor"
    t_typed.metadata_props.extend(props("tensor"))
    t_str = helper.make_tensor("t_str", TensorProto.STRING, [2], [b"a", b"bc"])
    t_c64 = helper.make_tensor("t_c64", TensorProto.COMPLEX64, [1], [1 + 2j])
    t_i4 = helper.make_tensor("t_i4", TensorProto.INT4, [3], [-8, 7, 1])
    t_f8 = helper.make_tensor("t_f8", TensorProto.FLOAT8E4M3FN, [2], [1.0, -2.0])
    t_c128 = helper.make_tensor("t_c128", TensorProto.COMPLEX128, [1], [3 - 4j])
    t_u64 = helper.make_tensor("t_u64", TensorProto.UINT64, [1], [2**64 - 1])
    sparse = helper.make_sparse_tensor(
        helper.make_tensor("sp", TensorProto.FLOAT, [2], [5.0, 6.0]),
        helper.make_tensor("sp_idx", TensorProto.INT64, [2], [0, 3]), [2, 2])

    tensor_type = helper.make_tensor_type_proto(TensorProto.FLOAT, [2, "N", None])
    tensor_type.denotation = "TENSOR"
    tensor_type.tensor_type.shape.dim[0].denotation = "DATA_BATCH"
    seq_type = helper.make_sequence_type_proto(tensor_type)
    seq_type.denotation = "SEQ"
    map_type = helper.make_map_type_proto(TensorProto.INT64, tensor_type)
    opt_type = helper.make_optional_type_proto(tensor_type)
    sparse_type = helper.make_sparse_tensor_type_proto(TensorProto.FLOAT, [4])
    opaque_type = onnx.TypeProto()
    opaque_type.opaque_type.domain = "test.domain"
    opaque_type.opaque_type.name = "Blob"

    sub = helper.make_graph([helper.make_node("Identity", ["a"], ["b"])], "sub",
                            [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1])],
                            [helper.make_tensor_value_info("b", TensorProto.FLOAT, [1])])
    attrs = [
        helper.make_attribute("f", 0.5),
        helper.make_attribute("i", -3),
        helper.make_attribute("s", "text"),
        helper.make_attribute("t", t_typed),
        helper.make_attribute("g", sub),
        helper.make_attribute("sparse_tensor", sparse),
        helper.make_attribute("tp", tensor_type),
        helper.make_attribute("floats", [1.0, 2.5]),
        helper.make_attribute("ints", [1, -2, 3]),
        helper.make_attribute("strings", ["x", "yz"]),
        helper.make_attribute("tensors", [t_typed, t_str]),
        helper.make_attribute("graphs", [sub]),
        helper.make_attribute("sparse_tensors", [sparse]),
        helper.make_attribute("type_protos", [seq_type, map_type]),
    ]
    attrs[0].doc_string = "an attribute"
    node = helper.make_node("Custom", ["x"], ["y"], name="custom", domain="test.domain",
                            doc_string="a node")
    node.attribute.extend(attrs)
    node.overload = "v2"
    node.metadata_props.extend(props("node"))
    config = node.device_configurations.add()
    config.configuration_id = "mesh"
    config.pipeline_stage = 1
    spec = config.sharding_spec.add()
    spec.tensor_name = "x"
    spec.device.extend([0, 1])
    group = spec.index_to_device_group_map.add()
    group.key = 0
    group.value.extend([0, 1])
    dim = spec.sharded_dim.add()
    dim.axis = 0
    simple = dim.simple_sharding.add()
    simple.dim_value = 4
    simple.num_shards = 2
    simple = dim.simple_sharding.add()
    simple.dim_param = "N"
    simple.num_shards = 2

    fn_node = helper.make_node("Mul", ["a", "a"], ["b"], name="square")
    ref = onnx.AttributeProto(name="alpha", ref_attr_name="alpha", type=onnx.AttributeProto.FLOAT)
    fn_node.attribute.append(ref)
    function = helper.make_function(
        "test.domain", "Custom", ["a"], ["b"], [fn_node], OPSET, attributes=["beta"],
        attribute_protos=[helper.make_attribute("alpha", 1.0)], doc_string="a function",
        value_info=[helper.make_tensor_value_info("b", TensorProto.FLOAT, [1])], overload="v2")
    function.metadata_props.extend(props("function"))

    value_info = [helper.make_value_info(n, t) for n, t in
                  [("vi_seq", seq_type), ("vi_map", map_type), ("vi_opt", opt_type),
                   ("vi_sparse", sparse_type), ("vi_opaque", opaque_type)]]
    value_info[0].doc_string = "a value"
    value_info[0].metadata_props.extend(props("value"))
    annotation = onnx.TensorAnnotation(tensor_name="y")
    annotation.quant_parameter_tensor_names.extend(props("quant"))
    graph = helper.make_graph(
        [node], "all_fields",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, "N", None])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [t_typed, t_str, t_c64, t_c128, t_u64, t_i4, t_f8], doc_string="a graph", value_info=value_info,
        sparse_initializer=[sparse])
    graph.quantization_annotation.append(annotation)
    graph.metadata_props.extend(props("graph"))

    info = helper.make_training_info(sub, [("a", "b")], sub, [("a", "b")])
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("test.domain", 1)],
        producer_name="make_fixtures", producer_version="1", domain="dev.tensorfleet",
        model_version=7, doc_string="every field", functions=[function])
    model.training_info.append(info)
    model.metadata_props.extend(props("model"))
    device = model.configuration.add()
    device.name = "mesh"
    device.num_devices = 2
    device.device.extend(["cuda:0", "cuda:1"])
    save(model, "all_fields.onnx")


if __name__ == "__main__":
    assert onnx.__version__ == "1.18.0", f"fixtures are made with onnx 1.18.0, not {onnx.__version__}"
    typed_and_raw()
    external()
    training_info()
    all_fields()
