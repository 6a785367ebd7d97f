#!/usr/bin/env python3
"""Writes cnn.onnx, the "imported" model of the custom-ONNX demo: a small convolutional
classifier built with onnx.helper, standing in for a model exported from another framework.
It carries no loss; the worker attaches one (examples/local/custom-onnx.yaml).

    .venv/bin/python make_cnn.py --output cnn.onnx [--size 32] [--classes 8]

Graph (NCHW; B is the symbolic dimension `batch`, which the worker binds from batchSize):

    image [B,3,S,S]
    → Conv 3→16 3×3 pad 1 → Relu → MaxPool 2×2    [B,16,S/2,S/2]
    → Conv 16→32 3×3 pad 1 → Relu → MaxPool 2×2   [B,32,S/4,S/4]
    → Conv 32→64 3×3 pad 1 → Relu                 [B,64,S/4,S/4]
    → GlobalAveragePool → Flatten                  [B,64]
    → Gemm 64→classes                              logits [B,classes]

Input and output names match the shapes set (make_shapes.py): `image` in, class scores
`logits` out. Weights are uniform (seeded; bounds below), biases zero: the initial weights of
the run are whatever this file holds. Checked with onnx.checker before it is written.

Needs numpy and onnx (the project's .venv has both).
"""

import argparse
import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", required=True, help="the .onnx file to write")
    ap.add_argument("--size", type=int, default=32, help="input image height and width")
    ap.add_argument("--classes", type=int, default=8)
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    if a.size < 4 or a.size % 4 != 0 or a.classes < 2:
        ap.error("--size must be a multiple of 4 (two 2×2 poolings) and --classes at least 2")
    rng = np.random.default_rng(a.seed)
    inits, nodes = [], []

    def weight(name, shape, bound):
        inits.append(numpy_helper.from_array(rng.uniform(-bound, bound, shape).astype(np.float32), name))
        return name

    def bias(name, n):
        inits.append(numpy_helper.from_array(np.zeros(n, np.float32), name))
        return name

    x = "image"
    c_in = 3
    for i, (c_out, pool) in enumerate([(16, True), (32, True), (64, False)], start=1):
        # Kaiming-uniform for ReLU: keeps the activations' scale through the layers, so the
        # model trains from the first step without normalization layers.
        w = weight(f"conv{i}.weight", [c_out, c_in, 3, 3], np.sqrt(6.0 / (c_in * 9)))
        b = bias(f"conv{i}.bias", c_out)
        nodes.append(helper.make_node("Conv", [x, w, b], [f"conv{i}"], name=f"conv{i}",
                                      kernel_shape=[3, 3], pads=[1, 1, 1, 1]))
        nodes.append(helper.make_node("Relu", [f"conv{i}"], [f"relu{i}"], name=f"relu{i}"))
        x = f"relu{i}"
        if pool:
            nodes.append(helper.make_node("MaxPool", [x], [f"pool{i}"], name=f"pool{i}",
                                          kernel_shape=[2, 2], strides=[2, 2]))
            x = f"pool{i}"
        c_in = c_out
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["gap"], name="gap"))
    nodes.append(helper.make_node("Flatten", ["gap"], ["features"], name="flatten", axis=1))
    # fc.weight is [classes, 64] with transB, the layout of a Linear layer exported by PyTorch,
    # and PyTorch's Linear bound 1/sqrt(fan_in): a narrower start than the convolutions', so
    # the first logits are small and the first loss is near ln(classes), not a confident guess.
    w = weight("fc.weight", [a.classes, c_in], 1.0 / np.sqrt(c_in))
    b = bias("fc.bias", a.classes)
    nodes.append(helper.make_node("Gemm", ["features", w, b], ["logits"], name="fc", transB=1))

    graph = helper.make_graph(
        nodes, "shapes_cnn",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 3, a.size, a.size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", a.classes])],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="tensorfleet-examples")
    onnx.checker.check_model(model, full_check=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.output)), exist_ok=True)
    onnx.save_model(model, a.output)
    params = sum(int(np.prod(t.dims)) for t in inits)
    print(f"{a.output}: {len(nodes)} nodes, {params} weights, input image [batch,3,{a.size},{a.size}], "
          f"output logits [batch,{a.classes}]")


if __name__ == "__main__":
    main()
