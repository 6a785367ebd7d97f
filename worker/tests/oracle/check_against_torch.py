#!/usr/bin/env python3
"""Cross-check the numpy oracle (reference_train.py) against PyTorch.

    python check_against_torch.py [--steps 50] [--keep DIR]

Not part of `make test` (it needs torch). Make a venv for it with, e.g.:

    python3 -m venv /tmp/venv-torch
    /tmp/venv-torch/bin/pip install torch numpy onnx==1.17.0 pyyaml

For each case below it writes random initial weights as an ONNX file, data shards and a worker
config; runs the oracle through its command line; rebuilds the same model in torch from the same
ONNX initializers, reads the same shards with its own loader, and trains with torch.optim
(AdamW, Adam, SGD), torch.nn.utils.clip_grad_norm_ and autograd. Asserts that the per-step losses of
the float64 torch run equal the oracle's to 1e-5 relative (and the final weights too), and prints
how far a float32 torch run lands from the oracle, which is what a float32 engine can expect.
"""

import argparse
import json
import math
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np
import onnx
import torch
import torch.nn.functional as F
import yaml
from onnx import numpy_helper

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# Only the fixture writers are shared with the oracle; the torch side reads them on its own.
from reference_train import write_initializers_onnx, write_sample_shard, write_token_shard  # noqa: E402

TOL = 1e-5

# ----------------------------------------------------------------------------------------------
# Fixtures


def gpt2_weights(rng, vocab, seq, embed, n_layer):
    w = {"wte": 0.02 * rng.standard_normal((vocab, embed)),
         "wpe": 0.02 * rng.standard_normal((seq, embed))}
    for layer in range(n_layer):
        p = f"h.{layer}."
        for ln in ("ln_1", "ln_2"):
            w[p + ln + ".weight"] = 1.0 + 0.05 * rng.standard_normal(embed)
            w[p + ln + ".bias"] = 0.02 * rng.standard_normal(embed)
        for name, (n_in, n_out) in {"attn.c_attn": (embed, 3 * embed),
                                    "attn.c_proj": (embed, embed),
                                    "mlp.c_fc": (embed, 4 * embed),
                                    "mlp.c_proj": (4 * embed, embed)}.items():
            w[p + name + ".weight"] = 0.02 * rng.standard_normal((n_in, n_out))
            w[p + name + ".bias"] = 0.01 * rng.standard_normal(n_out)
    w["ln_f.weight"] = 1.0 + 0.05 * rng.standard_normal(embed)
    w["ln_f.bias"] = 0.02 * rng.standard_normal(embed)
    return w


def mlp_weights(rng, sizes):
    w = {}
    for i in range(len(sizes) - 1):
        w[f"fc{i}.weight"] = rng.standard_normal((sizes[i], sizes[i + 1])) / math.sqrt(sizes[i])
        w[f"fc{i}.bias"] = 0.1 * rng.standard_normal(sizes[i + 1])
    return w


def pattern_tokens(rng, n, vocab):
    """Learnable text: a noisy counter, so losses visibly fall within 50 steps."""
    t = (np.arange(n) * 7 + (np.arange(n) // 13)) % vocab
    noise = rng.random(n) < 0.15
    t[noise] = rng.integers(0, vocab, noise.sum())
    return t


def make_case(root, name, rng, spec):
    d = os.path.join(root, name)
    os.makedirs(os.path.join(d, "data"))
    if spec["model"] == "torch_export":
        import shutil
        shutil.copy(spec["onnx"], os.path.join(d, "init.onnx"))
        for i, n in enumerate(spec["shards"]):
            write_token_shard(os.path.join(d, "data", f"train_{i:02d}.bin"),
                              pattern_tokens(rng, n, spec["vocab"]))
    elif spec["model"] == "gpt2":
        v, t, c, layers = spec["vocab"], spec["seq"], spec["embed"], spec["layers"]
        heads = spec["heads"]
        write_initializers_onnx(os.path.join(d, "init.onnx"), gpt2_weights(rng, v, t, c, layers),
                                {"heads": heads})
        if spec["format"] == "tokens":
            for i, n in enumerate(spec["shards"]):
                write_token_shard(os.path.join(d, "data", f"train_{i:02d}.bin"),
                                  pattern_tokens(rng, n, v))
        else:
            for i, n in enumerate(spec["shards"]):
                samples = []
                for _ in range(n):
                    w = pattern_tokens(rng, t + 1, v)
                    labels = w[1:].copy()
                    labels[rng.random(t) < 0.2] = -100
                    samples.append({"input_ids": w[:-1].astype(np.int64),
                                    "labels": labels.astype(np.int64)})
                write_sample_shard(os.path.join(d, "data", f"part_{i}.pb"), samples)
    else:
        sizes = spec["sizes"]
        write_initializers_onnx(os.path.join(d, "init.onnx"), mlp_weights(rng, sizes))
        centers = rng.standard_normal((sizes[-1], sizes[0]))
        for i, n in enumerate(spec["shards"]):
            samples = []
            for _ in range(n):
                y = int(rng.integers(0, sizes[-1]))
                x = centers[y] + 0.8 * rng.standard_normal(sizes[0])
                samples.append({"x": x.astype(np.float32), "labels": np.array(y, np.int64)})
            write_sample_shard(os.path.join(d, "data", f"part_{i}.pb"), samples)
    cfg = {
        "model": {"onnx": {"path": "init.onnx",
                           "loss": {"type": "softmaxCrossEntropy", "output": "logits",
                                    "label": "labels"}}},
        "data": {"train": {"path": "data", "format": spec["format"]}, "shuffle": False},
        **spec["train"],
    }
    with open(os.path.join(d, "train.yaml"), "w") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)
    return d, cfg


CASES = {
    "gpt2_adamw_const_clip": dict(
        model="gpt2", vocab=64, seq=16, embed=32, layers=2, heads=4, format="tokens",
        shards=[1000, 1500, 700],
        train=dict(batchSize=4, gradientAccumulationSteps=1, steps=50,
                   optimizer=dict(name="adamw", lr=1e-3, beta1=0.9, beta2=0.95, epsilon=1e-8,
                                  weightDecay=0.1),
                   lrSchedule=dict(name="constant", warmupSteps=0), gradClipNorm=1.0)),
    "gpt2_sgd_nesterov_cosine_accum": dict(
        model="gpt2", vocab=64, seq=16, embed=32, layers=2, heads=2, format="tokens",
        shards=[900, 1300],
        train=dict(batchSize=2, gradientAccumulationSteps=2, steps=50,
                   optimizer=dict(name="sgd", lr=0.5, momentum=0.9, nesterov=True,
                                  weightDecay=0.01),
                   lrSchedule=dict(name="cosine", warmupSteps=5, minLr=0.05), gradClipNorm=0.5)),
    "gpt2_adamw_linear_samples_ignore": dict(
        model="gpt2", vocab=48, seq=8, embed=16, layers=1, heads=2, format="onnxSamples",
        shards=[20, 13],
        train=dict(batchSize=3, gradientAccumulationSteps=1, steps=50,
                   optimizer=dict(name="adamw", lr=3e-3, beta1=0.8, beta2=0.99, epsilon=1e-6,
                                  weightDecay=0.05),
                   lrSchedule=dict(name="linear", warmupSteps=4, minLr=1e-4), gradClipNorm=0.0)),
    # The GPT-2 exported by torch.onnx.export (torch names, nn.Linear [out, in] weights, heads
    # read off the graph): what the engine's "exported model trains" test compares with.
    "torch_export_gpt2_tiny_adamw_cosine": dict(
        model="torch_export", onnx=os.path.join(HERE, "..", "data", "torch_gpt2",
                                                "gpt2_tiny_with_loss.onnx"),
        vocab=96, seq=16, heads=2, format="tokens", shards=[1200, 800],
        train=dict(batchSize=4, gradientAccumulationSteps=1, steps=50,
                   optimizer=dict(name="adamw", lr=3e-3, beta1=0.9, beta2=0.95, epsilon=1e-8,
                                  weightDecay=0.1),
                   lrSchedule=dict(name="cosine", warmupSteps=5, minLr=3e-4), gradClipNorm=1.0)),
    "mlp_adamw_cosine": dict(
        model="mlp", sizes=[12, 16, 16, 5], format="onnxSamples", shards=[50, 41],
        train=dict(batchSize=8, gradientAccumulationSteps=1, steps=50,
                   optimizer=dict(name="adamw", lr=1e-2, beta1=0.9, beta2=0.999, epsilon=1e-8,
                                  weightDecay=0.1),
                   lrSchedule=dict(name="cosine", warmupSteps=5, minLr=1e-3), gradClipNorm=1.0)),
    "mlp_adam_l2_linear": dict(
        model="mlp", sizes=[12, 24, 5], format="onnxSamples", shards=[45],
        train=dict(batchSize=6, gradientAccumulationSteps=1, steps=50,
                   optimizer=dict(name="adam", lr=5e-3, beta1=0.9, beta2=0.999, epsilon=1e-8,
                                  weightDecay=0.01),
                   lrSchedule=dict(name="linear", warmupSteps=0, minLr=0.0), gradClipNorm=0.0)),
    "mlp_sgd_momentum_accum_clip": dict(
        model="mlp", sizes=[12, 20, 5], format="onnxSamples", shards=[37, 30],
        train=dict(batchSize=4, gradientAccumulationSteps=3, steps=50,
                   optimizer=dict(name="sgd", lr=0.1, momentum=0.9, nesterov=False,
                                  weightDecay=1e-3),
                   lrSchedule=dict(name="constant", warmupSteps=0), gradClipNorm=0.5)),
}

# ----------------------------------------------------------------------------------------------
# The torch side: its own data reading, model, optimizer and schedule


def torch_token_batches(data_dir, b, t):
    shards = []
    for name in sorted(os.listdir(data_dir)):
        if name.endswith(".bin"):
            raw = np.fromfile(os.path.join(data_dir, name), dtype=np.uint8)
            header = raw[:1024].view(np.int32)
            shards.append(raw[1024:].view(np.uint16)[:header[2]].astype(np.int64))
    shard, pos = 0, 0
    while True:
        if pos + b * t + 1 > len(shards[shard]):
            shard, pos = (shard + 1) % len(shards), 0
            continue
        w = torch.from_numpy(shards[shard][pos:pos + b * t + 1])
        pos += b * t
        yield {"input_ids": w[:-1].view(b, t), "labels": w[1:].view(b, t)}


def torch_sample_batches(data_dir, b):
    samples = []
    for name in sorted(os.listdir(data_dir)):
        if not name.endswith(".pb"):
            continue
        data = open(os.path.join(data_dir, name), "rb").read()
        off = 0
        while off < len(data):
            size = struct.unpack_from("<I", data, off)[0]
            end, off, sample = off + 4 + size, off + 4, {}
            while off < end:
                n = struct.unpack_from("<I", data, off)[0]
                tp = onnx.TensorProto.FromString(data[off + 4:off + 4 + n])
                sample[tp.name] = numpy_helper.to_array(tp)
                off += 4 + n
            samples.append(sample)
    usable = len(samples) // b * b
    i = 0
    while True:
        chunk = samples[i:i + b]
        i = (i + b) % usable
        yield {k: torch.from_numpy(np.stack([s[k] for s in chunk])) for k in chunk[0]}


def torch_gpt2_loss(p, batch, n_head):
    ids, labels = batch["input_ids"], batch["labels"]
    bsz, t = ids.shape
    c = p["wte"].shape[1]
    hd = c // n_head
    x = F.embedding(ids, p["wte"]) + p["wpe"][:t]
    n_layer = sum(1 for k in p if k.endswith(".ln_1.weight"))
    causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
    for layer in range(n_layer):
        def g(n, layer=layer):
            return p[f"h.{layer}.{n}"]

        a = F.layer_norm(x, (c,), g("ln_1.weight"), g("ln_1.bias"), eps=1e-5)
        q, k, v = (a @ g("attn.c_attn.weight") + g("attn.c_attn.bias")).split(c, dim=-1)
        q, k, v = (z.view(bsz, t, n_head, hd).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
        att = torch.softmax(att.masked_fill(~causal, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).reshape(bsz, t, c)
        x = x + y @ g("attn.c_proj.weight") + g("attn.c_proj.bias")
        m = F.layer_norm(x, (c,), g("ln_2.weight"), g("ln_2.bias"), eps=1e-5)
        h = F.gelu(m @ g("mlp.c_fc.weight") + g("mlp.c_fc.bias"), approximate="tanh")
        x = x + h @ g("mlp.c_proj.weight") + g("mlp.c_proj.bias")
    x = F.layer_norm(x, (c,), p["ln_f.weight"], p["ln_f.bias"], eps=1e-5)
    logits = x @ p["wte"].T
    return F.cross_entropy(logits.reshape(bsz * t, -1), labels.reshape(-1), ignore_index=-100)


def torch_mlp_loss(p, batch):
    x = batch["x"].to(p["fc0.weight"].dtype)
    n_layer = sum(1 for k in p if k.endswith(".weight"))
    for i in range(n_layer):
        x = x @ p[f"fc{i}.weight"] + p[f"fc{i}.bias"]
        if i + 1 < n_layer:
            x = torch.relu(x)
    return F.cross_entropy(x, batch["labels"].reshape(-1), ignore_index=-100)


def lr_at(sched, lr, s, total):
    warm, min_lr = sched.get("warmupSteps", 0), sched.get("minLr", 0.0)
    if s < warm:
        return lr * (s + 1) / warm
    r = (s - warm) / max(total - warm, 1)
    return {"constant": lr,
            "cosine": min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * r)),
            "linear": lr + (min_lr - lr) * r}[sched["name"]]


def torch_train(case_dir, spec, cfg, dtype, model_file="init.onnx", gpt2_loss=None, autocast=False,
                trained=lambda name: True):
    """Trains the case in torch; returns the per-step losses and the final weights. `gpt2_loss`
    replaces torch_gpt2_loss, `autocast` runs the loss under torch.autocast("cpu", bfloat16),
    and `trained` picks the initializers that are weights (the others are left out)."""
    model = onnx.load(os.path.join(case_dir, model_file))
    raw = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer
           if i.data_type == onnx.TensorProto.FLOAT and trained(i.name)}
    back = {}  # our name -> (file's name, transposed)
    if spec["model"] == "torch_export":  # nanoGPT names; nn.Linear weights are [out, in]
        for name in raw:
            short = name.split("transformer.", 1)[1]
            ours = short[:3] if short in ("wte.weight", "wpe.weight") else short
            back[ours] = (name, raw[name].ndim == 2 and ours not in ("wte", "wpe"))
    else:
        back = {n: (n, False) for n in raw}
    p = {ours: torch.tensor(raw[n].T.copy() if t else raw[n], dtype=dtype, requires_grad=True)
         for ours, (n, t) in back.items()}
    data_dir = os.path.join(case_dir, "data")
    b = cfg["batchSize"]
    if spec["model"] in ("gpt2", "torch_export"):
        batches = (torch_token_batches(data_dir, b, spec["seq"]) if spec["format"] == "tokens"
                   else torch_sample_batches(data_dir, b))
        loss_fn = lambda batch: (gpt2_loss or torch_gpt2_loss)(p, batch, spec["heads"])  # noqa: E731
    else:
        batches = torch_sample_batches(data_dir, b)
        loss_fn = lambda batch: torch_mlp_loss(p, batch)  # noqa: E731
    o = cfg["optimizer"]
    groups = [{"params": [t for t in p.values() if t.ndim >= 2], "weight_decay": o["weightDecay"]},
              {"params": [t for t in p.values() if t.ndim < 2], "weight_decay": 0.0}]
    if o["name"] in ("adamw", "adam"):
        cls = torch.optim.AdamW if o["name"] == "adamw" else torch.optim.Adam
        opt = cls(groups, lr=o["lr"], betas=(o["beta1"], o["beta2"]), eps=o["epsilon"])
    else:
        opt = torch.optim.SGD(groups, lr=o["lr"], momentum=o["momentum"], nesterov=o["nesterov"])
    accum, steps, losses = cfg["gradientAccumulationSteps"], cfg["steps"], []
    for s in range(steps):
        total = 0.0
        for _ in range(accum):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = loss_fn(next(batches)) / accum
            loss.backward()
            total += loss.item()
        if cfg["gradClipNorm"] > 0:
            torch.nn.utils.clip_grad_norm_(list(p.values()), cfg["gradClipNorm"])
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg["lrSchedule"], o["lr"], s, steps)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    final = {}
    for ours, (n, t) in back.items():
        w = p[ours].detach().double().numpy()
        final[n] = w.T if t else w
    return np.array(losses), final


def rel(a, b):
    return np.abs(a - b) / np.maximum(np.abs(b), 1e-12)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--keep", help="write the cases into this directory and keep them")
    ap.add_argument("--only", help="run only cases whose name contains this")
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    root = args.keep or tempfile.mkdtemp(prefix="oracle-vs-torch-")
    rng = np.random.default_rng(2024)
    failures = []
    print(f"torch {torch.__version__}, cases in {root}")
    for name, spec in CASES.items():
        spec = {**spec, "train": {**spec["train"], "steps": args.steps}}
        d, cfg = make_case(root, name, rng, spec)
        if args.only and args.only not in name:
            continue
        out = os.path.join(d, "oracle.json")
        subprocess.run([sys.executable, os.path.join(HERE, "reference_train.py"), "--config",
                        os.path.join(d, "train.yaml"), "--output", out, "--weights", "npz",
                        "--quiet"], check=True)
        oracle = np.array(json.load(open(out))["losses"])
        oracle_w = dict(np.load(os.path.join(d, "oracle.npz")))
        l64, w64 = torch_train(d, spec, cfg, torch.float64)
        l32, _ = torch_train(d, spec, cfg, torch.float32)
        loss_err = rel(l64, oracle).max()
        w_err = max(np.abs(w64[k] - oracle_w[k]).max() / np.abs(oracle_w[k]).max()
                    for k in oracle_w)
        f32_err = rel(l32, oracle).max()
        ok = loss_err < TOL and w_err < TOL and len(oracle) == args.steps
        print(f"{'ok  ' if ok else 'FAIL'} {name:38s} loss {oracle[0]:.5f} -> {oracle[-1]:.5f}  "
              f"max rel |torch64-oracle| loss {loss_err:.1e} weights {w_err:.1e}  "
              f"| float32 torch vs oracle: loss {f32_err:.1e}")
        if not ok:
            failures.append(name)
    if failures:
        print(f"FAILED: {failures}")
        return 1
    print(f"all {len(CASES) if not args.only else 'selected'} cases match to {TOL:g} relative")
    return 0


if __name__ == "__main__":
    sys.exit(main())
