#!/usr/bin/env python3
"""Export a tiny network of PyTorch's upsampling layers with both PyTorch exporters, as test
data for the engine (tests/torch_upsample.rs), with PyTorch's own training of the module as the
reference.

    python export.py [--out-dir DIR]      # default: this script's directory

Writes
  net_torchscript.onnx (dynamo=False, opset 17), net_dynamo.onnx (dynamo=True, optimize=False,
                 external_data=False; opset 20): input float32 [batch, 3, 12, 12] -> logits [batch, 5]
  batches.pb     16 samples in onnxSamples format (`input` float32 [3, 12, 12], `labels` int64
                 []): 2 batches of 8, taken in order (step k trains on batch k mod 2)
  expected.json  per optimizer (12 steps of SGD with momentum, 12 of AdamW), PyTorch's float32
                 loss of each step (before its update) and the first step's gradient norm; and
                 the ConvTranspose and Resize nodes each export holds.

The network (seeded init) strings together what U-Nets, FCNs and diffusers' decoders upsample
with: nn.ConvTranspose2d (stride 2 with output_padding; grouped), nn.ConvTranspose1d without a
bias, nn.Upsample (bilinear; nearest) and F.interpolate (bilinear with align_corners True and
False, downsampling and to a size; nearest to a size). No BatchNormalization or dropout, so the
engine's float32 training follows PyTorch's step for step.
"""
import argparse
import copy
import os
import sys
import warnings

import numpy as np
import onnx
import torch
import torch.nn as nn
import torch.nn.functional as F

# worker/tests/data/torch_oracle.py: what the export scripts share.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch_oracle  # noqa: E402

SEED, BATCH, BATCHES, SIZE, CLASSES, STEPS = 0, 8, 2, 12, 5, 12
SGD = {"lr": 0.05, "momentum": 0.9, "weightDecay": 0.0}
ADAMW = {"lr": 0.01, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "weightDecay": 0.0}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.t1 = nn.ConvTranspose2d(4, 3, 3, stride=2, padding=1, output_padding=1)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear")
        self.c2 = nn.Conv2d(3, 6, 3, stride=2, padding=1)
        self.t2 = nn.ConvTranspose2d(6, 4, 4, stride=2, padding=1, groups=2)
        self.near = nn.Upsample(scale_factor=2, mode="nearest")
        self.t3 = nn.ConvTranspose1d(4, 4, 3, stride=2, padding=1, output_padding=1, bias=False)
        self.fc = nn.Linear(4, CLASSES)

    def forward(self, x):
        x = F.relu(self.c1(x))  # 12 -> 6
        x = self.t1(x)  # 6 -> 12
        x = self.up(x)  # 12 -> 24
        x = F.relu(self.c2(x))  # 24 -> 12
        x = F.interpolate(x, scale_factor=0.5, mode="bilinear", align_corners=True)  # 12 -> 6
        x = torch.tanh(self.t2(x))  # 6 -> 12
        x = self.near(x)  # 12 -> 24
        x = F.interpolate(x, size=(10, 7), mode="bilinear", align_corners=False)
        x = F.interpolate(x, size=(15, 9), mode="nearest")
        x = self.t3(x.mean(2))  # [N, 4, 9] -> [N, 4, 18]
        return self.fc(x.mean(2))


def export(model, x, path, exporter):
    names = dict(input_names=["input"], output_names=["logits"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "torchscript":
            torch.onnx.export(copy.deepcopy(model), (x,), path, dynamo=False, opset_version=17,
                              dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, **names)
        else:
            torch.onnx.export(copy.deepcopy(model), (x,), path, dynamo=True, optimize=False, external_data=False,
                              dynamic_shapes=({0: torch.export.Dim("batch")},), **names)
            m = onnx.load(path)  # the per-node metadata (stack traces) the engine does not read
            for n in m.graph.node:
                del n.metadata_props[:]
            onnx.save(m, path)
    onnx.checker.check_model(onnx.load(path), full_check=True)
    nodes = []
    for n in onnx.load(path).graph.node:
        if n.op_type in ("ConvTranspose", "Resize"):
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
            nodes.append({"op": n.op_type, **{k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()
                                               if k in ("mode", "coordinate_transformation_mode", "nearest_mode",
                                                        "group", "output_padding", "strides")}})
    return {"file": os.path.basename(path), "nodes": nodes}


def train(model, kind, xs, ys):
    m = copy.deepcopy(model)
    if kind == "sgd":
        opt = torch.optim.SGD(m.parameters(), lr=SGD["lr"], momentum=SGD["momentum"])
    else:
        opt = torch.optim.AdamW(m.parameters(), lr=ADAMW["lr"], betas=(ADAMW["beta1"], ADAMW["beta2"]),
                                eps=ADAMW["epsilon"], weight_decay=ADAMW["weightDecay"])

    losses, grad_norm = [], None
    for step in range(STEPS):
        loss = F.cross_entropy(m(xs[step % BATCHES]), ys[step % BATCHES])
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        if step == 0:
            grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in m.parameters())).item()
        opt.step()
    return {"losses": losses, "gradNorm": grad_norm}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default=os.path.dirname(os.path.abspath(__file__)))
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(SEED)
    model = Net()
    gen = torch.Generator().manual_seed(SEED + 1)
    xs = torch.randn(BATCHES, BATCH, 3, SIZE, SIZE, generator=gen)
    ys = torch.randint(0, CLASSES, (BATCHES, BATCH), generator=gen)
    torch_oracle.write_samples(os.path.join(args.out_dir, "batches.pb"), (
        [("input", x.numpy()), ("labels", np.array(y.item(), dtype=np.int64))]
        for x, y in zip(xs.reshape(-1, 3, SIZE, SIZE), ys.reshape(-1))))
    out = {
        "about": "PyTorch's training of the module exported here; see export.py",
        "torch": torch.__version__, "onnx": onnx.__version__,
        "data": "batches.pb", "batch": BATCH, "batches": BATCHES, "steps": STEPS, "sgd": SGD, "adamw": ADAMW,
        "exports": {e: export(model, xs[0], os.path.join(args.out_dir, f"net_{e}.onnx"), e)
                    for e in ("torchscript", "dynamo")},
    }
    for kind in ("sgd", "adamw"):
        out[kind]["float32"] = train(model, kind, xs, ys)
    torch_oracle.write_expected(os.path.join(args.out_dir, "expected.json"), out)
    for kind in ("sgd", "adamw"):
        losses = out[kind]["float32"]["losses"]
        print(f"{kind}: losses {losses[0]:.4f} -> {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
