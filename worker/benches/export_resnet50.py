#!/usr/bin/env python3
"""Exports ResNet-50 (pytorch_peer.ResNet50) for the GPU benchmark (gpu_bench.py --model
resnet50), as a user would: torch.onnx.export, the TorchScript exporter, from model.train().

    .venv-bench/bin/python worker/benches/export_resnet50.py --out-dir .gpu-bundle

Writes resnet50.onnx, whose weights are external data in resnet50.onnx.data (not written), and
resnet50.weights.json, where each weight lies in that file (name, offset, length, shape). The
benchmark writes resnet50.onnx.data on the GPU machine from a freshly initialized module by
name, so that the 100 MB of weights need not travel with the bundle. Every weight of the export
is a parameter or buffer of the module (the script fails otherwise).

The export: opset 17, `training=TrainingMode.TRAINING` (BatchNormalization in training mode,
with the running statistics as initializers named as in the state_dict: the TorchScript
exporter's default, eval mode, folds BatchNormalization into the convolutions, which is not the
model PyTorch trains), input `input` float32 [batch, 3, 224, 224], output `logits` [batch, 1000].

Needs torch and onnx: .ci/bench-deps.sh installs both into .venv-bench.
"""

import argparse
import json
import os
import sys
import tempfile
import warnings

import onnx
import torch
from onnx import external_data_helper

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_peer import ResNet50  # noqa: E402

LOCATION = "resnet50.onnx.data"


class ResNet50Logits(ResNet50):
    """The module whose forward is the logits (the loss is the trainer's to attach)."""

    def forward(self, x):
        return self.logits(x)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--size", type=int, default=224)
    a = ap.parse_args()
    # The exporter warns of each BatchNormalization's num_batches_tracked, which ONNX has not.
    warnings.filterwarnings("ignore", message="ONNX Preprocess")
    torch.manual_seed(0)
    model = ResNet50Logits().train()
    state = model.state_dict()
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/resnet50.onnx"
        torch.onnx.export(
            model,
            (torch.randn(2, 3, a.size, a.size),),
            path,
            dynamo=False,
            opset_version=17,
            training=torch.onnx.TrainingMode.TRAINING,
            do_constant_folding=False,
            input_names=["input"],
            output_names=["logits"],
            dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
        )
        graph = onnx.load(path)
    weights, offset = [], 0
    for tensor in graph.graph.initializer:
        if tensor.name not in state:
            raise SystemExit(f"export_resnet50: initializer {tensor.name!r} is not in the module's state_dict")
        if tensor.data_type != onnx.TensorProto.FLOAT:
            raise SystemExit(f"export_resnet50: initializer {tensor.name!r} is not float32")
        length = len(tensor.raw_data)
        weights.append({"name": tensor.name, "offset": offset, "length": length, "shape": list(tensor.dims)})
        external_data_helper.set_external_data(tensor, LOCATION, offset=offset, length=length)
        tensor.ClearField("raw_data")
        tensor.data_location = onnx.TensorProto.EXTERNAL
        offset += (length + 63) // 64 * 64  # 64-byte aligned, as onnx's own writer aligns
    os.makedirs(a.out_dir, exist_ok=True)
    onnx.save(graph, f"{a.out_dir}/resnet50.onnx")
    with open(f"{a.out_dir}/resnet50.weights.json", "w") as f:
        json.dump({"location": LOCATION, "bytes": offset, "weights": weights}, f, indent=1)
    ops = sorted({n.op_type for n in graph.graph.node})
    print(f"resnet50.onnx: {len(graph.graph.node)} nodes ({', '.join(ops)}), {len(weights)} weights, {offset} bytes")


if __name__ == "__main__":
    main()
