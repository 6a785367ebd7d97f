#!/usr/bin/env python3
"""Export two tiny torchvision CNNs with both PyTorch exporters, as test data for the engine
(tests/torch_cnn.rs), with PyTorch's own training of the same modules as the reference.

    python export.py [--out-dir DIR]      # default: this script's directory

Writes
  resnet18_torchscript.onnx, resnet18_dynamo.onnx,
  mobilenet_v2_torchscript.onnx, mobilenet_v2_dynamo.onnx
                 input float32 [batch, 3, 32, 32] -> logits float32 [batch, 10]
  batches.pb     32 samples in onnxSamples format (`input` float32 [3, 32, 32], `labels` int64 []):
                 2 batches of 16, taken in order (step k trains on batch k mod 2)
  expected.json  per model and optimizer (20 steps of SGD, 20 of AdamW; hyperparameters in
                 the file), in float32 and float64: the loss of each step (before its update),
                 the first step's global gradient norm, the eval-mode loss on batch 0 after each
                 step; `agreeSteps`, the leading steps whose float32 and float64 losses agree to
                 1e-4 relative; and for SGD the running statistics after `agreeSteps` steps
                 (float32), with how far PyTorch's float32 and float64 runs are apart on each.
                 Also what each export holds (op counts, BatchNormalization attributes) and
                 what the default export settings give.
and prints a summary.

The models (torchvision 0.29, random init, seeded):
- resnet18: torchvision.models.resnet.ResNet with BasicBlock [2, 2, 2, 2] - resnet18's
  topology and ops - at width 4 instead of 64 (a subclass rebuilds the stem, the four stages
  and the head at 4/8/16/32 channels, then reapplies ResNet's init).
- mobilenet_v2: torchvision.models.mobilenet_v2(width_mult=0.1, num_classes=10, dropout=0.0).
  The classifier's dropout is 0 because random masks cannot be reproduced across frameworks.
Both are exported from model.train(), each from its own copy. The TorchScript exporter traces
a training-mode module by running it forward once on the example input, and writes the
running statistics as that pass left them (one momentum step from PyTorch's init); so the
dynamo export and PyTorch's reference training start from the module after that same pass,
and the script checks that every exported initializer with a state_dict name equals it.

The exporters and BatchNormalization (what each writes; expected.json records it per export):
- TorchScript (dynamo=False, opset 17). Its default `training=TrainingMode.EVAL` exports the
  module in eval mode and, with its constant folding, folds every BatchNormalization into the
  convolution before it: no BatchNormalization is left and the initializers are fused kernels
  named `onnx::Conv_<n>` - not the module PyTorch trains. So we pass
  `training=torch.onnx.TrainingMode.TRAINING` (PRESERVE from model.train() gives the same):
  BatchNormalization then has training_mode=1, momentum 0.9 (ONNX's = 1 - PyTorch's 0.1), three
  outputs (the updated running statistics are outputs nothing reads), and the running
  statistics are initializers named `<module>.running_mean` / `.running_var`, read only as
  BatchNormalization's inputs 3 and 4. num_batches_tracked is not exported.
- dynamo (dynamo=True, opset 20 by default). It exports BatchNormalization in inference mode
  even from model.train() (no training_mode, one output, momentum 0.9), and its default ONNX
  optimizer (`optimize=True`) then fuses that inference-mode BatchNormalization into the
  convolution before it (onnxscript's FuseBatchNormIntoConv), and lifts every constant into an
  initializer (mobilenet_v2's ReLU6 bounds become float initializers `min_val_cast`,
  `max_val_cast`). So we pass `optimize=False`: the graph keeps BatchNormalization with the
  running statistics as initializers (the module's names), constants stay Constant nodes, a
  convolution without bias gets a zero bias computed by Shape/Expand/CastLike, and ReLU6's
  bounds are CastLike(constant, activation), which the engine must fold to bind Clip (not yet:
  tests/torch_cnn.rs ignores mobilenet_v2_dynamo until it does). num_batches_tracked is not
  exported. `external_data=False` keeps
  the weights in the .onnx file (the default writes them beside it, to <file>.onnx.data, which
  the engine reads too), and the script drops the per-node metadata (stack traces) afterwards,
  to keep the committed file small.
The engine trains either as PyTorch trains the module: batch statistics in the training
graph, running statistics updated with PyTorch's momentum and unbiased variance, inference
mode in evaluation and export (docs/MODELS.md).

Reference training: F.cross_entropy on the logits (the engine attaches softmaxCrossEntropy),
weight decay on weights of rank 2 or more only (the engine's default), no clipping.

Needs: torch 2.15, torchvision 0.29 (the newest, built for torch 2.14 and later), onnx,
onnxscript: .ci/bench-deps.sh, then `.venv-bench/bin/pip install --no-deps torchvision==0.29.2`
and `.venv-bench/bin/pip install pillow onnx onnxscript`.
"""

import argparse
import copy
import os
import sys
import tempfile
import warnings
from collections import Counter

import numpy as np
import onnx
import onnx.numpy_helper
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torchvision.models import mobilenet_v2
from torchvision.models.resnet import BasicBlock, ResNet

# worker/tests/data/torch_oracle.py: what the export scripts share.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch_oracle  # noqa: E402

SEED = 20
BATCH, BATCHES, SIZE, CLASSES = 16, 2, 32, 10
STEPS = 20
AGREE = 1e-4
SGD = {"lr": 0.01, "momentum": 0.9, "weightDecay": 5e-4}
ADAMW = {"lr": 3e-4, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "weightDecay": 0.01}


class TinyResNet18(ResNet):
    """resnet18 (BasicBlock, [2, 2, 2, 2]) at `width` channels in the first stage, not 64."""

    def __init__(self, width=4, num_classes=CLASSES):
        super().__init__(BasicBlock, [2, 2, 2, 2], num_classes=num_classes)
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.layer1 = self._make_layer(BasicBlock, width, 2)
        self.layer2 = self._make_layer(BasicBlock, 2 * width, 2, stride=2)
        self.layer3 = self._make_layer(BasicBlock, 4 * width, 2, stride=2)
        self.layer4 = self._make_layer(BasicBlock, 8 * width, 2, stride=2)
        self.fc = nn.Linear(8 * width, num_classes)
        for m in self.modules():  # ResNet.__init__'s init, for the rebuilt modules
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)


def build_models():
    torch.manual_seed(SEED)
    return {
        "resnet18": TinyResNet18(),
        "mobilenet_v2": mobilenet_v2(width_mult=0.1, num_classes=CLASSES, dropout=0.0),
    }


def export(model, x, path, exporter, **options):
    """Exports a copy of `model` in train mode; returns the options used, as text."""
    m = copy.deepcopy(model).train()
    names = dict(input_names=["input"], output_names=["logits"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "torchscript":
            opts = dict(dynamo=False, opset_version=17, **options)
            torch.onnx.export(m, (x,), path, dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
                              **names, **opts)

        else:
            opts = dict(dynamo=True, **options)
            torch.onnx.export(m, (x,), path, dynamic_shapes=({0: torch.export.Dim("batch")},), **names, **opts)
    return ", ".join(f"{k}={v}" for k, v in opts.items())


def strip_node_metadata(path):
    """Drops the dynamo exporter's per-node metadata (stack traces, FX nodes: two thirds of
    the file), which the engine does not read."""
    proto = onnx.load(path)
    for n in proto.graph.node:
        del n.metadata_props[:]
    onnx.save(proto, path)


def describe(path):
    """Op counts and the BatchNormalization nodes' attributes of an exported file."""
    g = onnx.load(path).graph
    bns = [n for n in g.node if n.op_type == "BatchNormalization"]
    attrs = Counter()
    for n in bns:
        a = {x.name: onnx.helper.get_attribute_value(x) for x in n.attribute}
        attrs[(int(a.get("training_mode", 0)), round(float(a.get("momentum", 0.9)), 6), len(n.output))] += 1
    return {
        "ops": dict(sorted(Counter(n.op_type for n in g.node).items())),
        "floatInitializers": sum(1 for i in g.initializer if i.data_type == onnx.TensorProto.FLOAT),
        "batchNormalization": [{"trainingMode": t, "momentum": m, "outputs": o, "nodes": c}
                               for (t, m, o), c in sorted(attrs.items())],
    }


def check_initializers(path, model):
    """Every initializer that has a state_dict name holds the module's value."""
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    named = 0
    for init in onnx.load(path).graph.initializer:
        if init.name in state:
            np.testing.assert_array_equal(onnx.numpy_helper.to_array(init), state[init.name], err_msg=init.name)
            named += 1
    return named


def running_stats(model):
    return {k: [float(f"{v:.8g}") for v in t.reshape(-1).tolist()] for k, t in model.state_dict().items()
            if k.endswith(("running_mean", "running_var"))}


def train(model, kind, dtype, xs, ys, snapshot_after=None):
    """PyTorch's training: per step the loss before the update, the eval-mode loss on batch 0
    after it; the first step's gradient norm; the running statistics after `snapshot_after`."""
    m = copy.deepcopy(model).to(dtype).train()
    opt = torch_oracle.optimizer(kind, m, SGD, ADAMW)
    losses, evals, grad_norm, stats = [], [], None, None
    for step in range(STEPS):
        x, y = xs[step % BATCHES].to(dtype), ys[step % BATCHES]
        loss = F.cross_entropy(m(x), y)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        if step == 0:
            grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in m.parameters())).item()
        opt.step()
        m.eval()
        with torch.no_grad():
            evals.append(F.cross_entropy(m(xs[0].to(dtype)), ys[0]).item())
        m.train()
        if snapshot_after == step + 1:
            stats = running_stats(m)
    return {"losses": losses, "gradNorm": grad_norm, "evalLosses": evals}, stats


def stats_difference(a, b):
    """The worst difference of statistic `a` from `b`, relative to b's largest magnitude or to
    1e-3 when that is smaller (a running mean that is 0 mathematically holds rounding noise)."""
    a, b = np.array(a), np.array(b)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-3))


def agree_steps(a, b):
    """Leading steps whose losses agree to AGREE relative."""
    for k, (x, y) in enumerate(zip(a, b)):
        if abs(x - y) > AGREE * abs(y):
            return k
    return len(a)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default=os.path.dirname(os.path.abspath(__file__)))
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    models = build_models()
    gen = torch.Generator().manual_seed(SEED + 1)
    xs = torch.randn(BATCHES, BATCH, 3, SIZE, SIZE, generator=gen)
    ys = torch.randint(0, CLASSES, (BATCHES, BATCH), generator=gen)
    torch_oracle.write_samples(os.path.join(args.out_dir, "batches.pb"), (
        [("input", x.numpy()), ("labels", np.array(y.item(), dtype=np.int64))]
        for x, y in zip(xs.reshape(-1, 3, SIZE, SIZE), ys.reshape(-1))))

    out = {
        "about": "PyTorch's training of the modules exported here; see export.py",
        "torch": torch.__version__, "torchvision": torchvision.__version__, "onnx": onnx.__version__,
        "data": "batches.pb", "batch": BATCH, "batches": BATCHES, "steps": STEPS, "agreeTolerance": AGREE,
        "sgd": SGD, "adamw": ADAMW, "weightDecayOn": "weights of rank 2 or more",
        "models": {},
    }
    for name, model in models.items():
        entry = {"parameters": sum(p.numel() for p in model.parameters()), "exports": {}, "defaults": {}}
        # The TorchScript exporter traces the module in training mode by running it forward
        # once on the example input, which moves the running statistics before it writes them:
        # the state both exports hold, and PyTorch's training starts from, is the module's after
        # that one pass.
        traced = copy.deepcopy(model).train()
        with torch.no_grad():
            traced(xs[0])
        for exporter, options in (("torchscript", {"training": torch.onnx.TrainingMode.TRAINING}),
                                  ("dynamo", {"optimize": False, "external_data": False})):
            path = os.path.join(args.out_dir, f"{name}_{exporter}.onnx")
            try:
                used = export(model if exporter == "torchscript" else traced, xs[0], path, exporter, **options)
                if exporter == "dynamo":
                    strip_node_metadata(path)
                onnx.checker.check_model(onnx.load(path), full_check=True)
                entry["exports"][exporter] = {"file": os.path.basename(path), "options": used,
                                              "stateDictInitializers": check_initializers(path, traced),
                                              **describe(path)}
            except Exception as e:  # recorded, so that the test can say why the case is absent
                entry["exports"][exporter] = {"error": f"{type(e).__name__}: {e}"}
            # What the same exporter writes with its default settings (not kept).
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "default.onnx")
                try:
                    entry["defaults"][exporter] = {"options": export(model, xs[0], path, exporter),
                                                   **describe(path)}
                except Exception as e:
                    entry["defaults"][exporter] = {"error": f"{type(e).__name__}: {e}"}
        for kind in ("sgd", "adamw"):
            f64, _ = train(traced, kind, torch.float64, xs, ys)
            f32, _ = train(traced, kind, torch.float32, xs, ys)
            agree = agree_steps(f32["losses"], f64["losses"])
            entry[kind] = {"float32": f32, "float64": f64, "agreeSteps": agree}
        # The running statistics once more (the same mechanism under either optimizer), with
        # how far PyTorch's own float32 and float64 runs are apart on each.
        agree = entry["sgd"]["agreeSteps"]
        _, f32 = train(traced, "sgd", torch.float32, xs, ys, snapshot_after=agree)
        _, f64 = train(traced, "sgd", torch.float64, xs, ys, snapshot_after=agree)
        entry["sgd"]["runningStatsAfterAgreeSteps"] = f32
        entry["sgd"]["runningStatsFloat32VsFloat64"] = {k: float(f"{stats_difference(f32[k], f64[k]):.3g}")
                                                        for k in f32} if f32 else None
        out["models"][name] = entry

    torch_oracle.write_expected(os.path.join(args.out_dir, "expected.json"), out)
    print(f"torch {torch.__version__}, torchvision {torchvision.__version__}, onnx {onnx.__version__}")
    for name, entry in out["models"].items():
        for exporter, e in entry["exports"].items():
            d = entry["defaults"][exporter]
            size = os.path.getsize(os.path.join(args.out_dir, e["file"])) if "file" in e else 0
            print(f"{name} {exporter}: {e.get('error') or f'{size} bytes'}; BatchNormalization "
                  f"{e.get('batchNormalization')}; with defaults: {d.get('batchNormalization', d.get('error'))}")
        for kind in ("sgd", "adamw"):
            r = entry[kind]
            print(f"{name} {kind}: fp32/fp64 agree for {r['agreeSteps']} steps; losses "
                  f"{r['float32']['losses'][0]:.4f} -> {r['float32']['losses'][-1]:.4f}")


if __name__ == "__main__":
    main()
