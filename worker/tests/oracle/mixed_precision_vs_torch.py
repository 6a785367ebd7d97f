#!/usr/bin/env python3
"""tensorfleet's mixed precision next to PyTorch autocast, on the CPU.

    python mixed_precision_vs_torch.py --worker target/release/tensorfleet-worker [--steps 30]

Not part of `make test` (it needs torch: use .venv-bench, which `make bench` creates). For the
GPT-2 cases of check_against_torch.py, it trains the same initial weights on the same token shards

  - with the worker, `precision: fp32` and `precision: bf16` (`device: cpu`);
  - with PyTorch, in fp32 and under torch.autocast("cpu", bfloat16): the model written as a
    PyTorch user writes it (F.linear with the bias in the product, causal
    F.scaled_dot_product_attention, tanh GELU, the loss on float32 logits), fp32 master
    weights, torch.optim.AdamW / SGD, clip_grad_norm_,

and prints how far apart the runs' per-step losses are. Two bf16 runs round differently, and
the difference grows as training goes on, so the first step (the same weights, the same batch:
only the forward pass' rounding differs) is the sharp comparison: tensorfleet's bf16 loss
should sit next to autocast's, both away from fp32's. Over the later steps the check is that
tensorfleet's bf16 run stays as close to autocast's as autocast's stays to fp32.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from check_against_torch import CASES, make_case, torch_train  # noqa: E402
import onnx  # noqa: E402


def gpt2_loss(p, batch, n_head):
    """GPT-2 as a PyTorch user writes it (weights [in, out] as the worker's, so F.linear takes
    their transpose)."""
    ids, labels = batch["input_ids"], batch["labels"]
    bsz, t = ids.shape
    c = p["wte"].shape[1]
    x = F.embedding(ids, p["wte"]) + p["wpe"][:t]
    n_layer = sum(1 for k in p if k.endswith(".ln_1.weight"))
    for layer in range(n_layer):
        def g(n, layer=layer):
            return p[f"h.{layer}.{n}"]

        a = F.layer_norm(x, (c,), g("ln_1.weight"), g("ln_1.bias"), eps=1e-5)
        q, k, v = F.linear(a, g("attn.c_attn.weight").T, g("attn.c_attn.bias")).split(c, dim=-1)
        q, k, v = (z.view(bsz, t, n_head, c // n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(bsz, t, c)
        x = x + F.linear(y, g("attn.c_proj.weight").T, g("attn.c_proj.bias"))
        m = F.layer_norm(x, (c,), g("ln_2.weight"), g("ln_2.bias"), eps=1e-5)
        h = F.gelu(F.linear(m, g("mlp.c_fc.weight").T, g("mlp.c_fc.bias")), approximate="tanh")
        x = x + F.linear(h, g("mlp.c_proj.weight").T, g("mlp.c_proj.bias"))
    x = F.layer_norm(x, (c,), p["ln_f.weight"], p["ln_f.bias"], eps=1e-5)
    logits = F.linear(x, p["wte"])
    return F.cross_entropy(logits.float().reshape(bsz * t, -1), labels.reshape(-1), ignore_index=-100)


def torch_losses(case_dir, spec, cfg, autocast):
    weight = lambda n: n in ("wte", "wpe") or n.startswith(("h.", "ln_f."))  # noqa: E731
    losses, _ = torch_train(case_dir, spec, cfg, torch.float32, model_file="model.onnx", gpt2_loss=gpt2_loss,
                            autocast=autocast, trained=weight)
    return losses


def builtin_model(worker, case_dir, spec, cfg):
    """The worker's builtin GPT-2 of the case's size with the case's initial weights, as a whole
    ONNX model (its graph from the worker's own export, its initializers from init.onnx)."""
    builtin = {
        "model": {"gpt2": {"layers": spec["layers"], "heads": spec["heads"], "embed": spec["embed"],
                           "seqLen": spec["seq"], "vocab": spec["vocab"]}},
        "data": cfg["data"], "batchSize": cfg["batchSize"], "steps": 1,
        "optimizer": {"name": "sgd", "lr": 1e-30}, "checkpoint": {"every": 1, "keep": 1},
        "output": {"dir": "builtin"},
    }
    with open(os.path.join(case_dir, "builtin.json"), "w") as f:
        json.dump(builtin, f)
    run = lambda *a: subprocess.run([worker, *a], check=True, capture_output=True, cwd=case_dir)  # noqa: E731
    run("train", "--config", "builtin.json", "--quiet")
    run("export", "--checkpoint", "builtin/checkpoints/checkpoint_1", "--output", "builtin.onnx")
    model = onnx.load(os.path.join(case_dir, "builtin.onnx"))
    init = {i.name: i for i in onnx.load(os.path.join(case_dir, "init.onnx")).graph.initializer}
    for i, t in enumerate(model.graph.initializer):
        if t.name in init:
            model.graph.initializer[i].CopyFrom(init[t.name])
    onnx.save(model, os.path.join(case_dir, "model.onnx"))


def worker_train(worker, case_dir, precision):
    out = os.path.join(case_dir, f"out-{precision}")
    subprocess.run([worker, "train", "--config", os.path.join(case_dir, "train.yaml"), "--quiet",
                    "--set", f"precision={precision}", "--set", "device=cpu", "--set", f"output.dir={out}",
                    "--set", "model.onnx.path=model.onnx"],
                   check=True, capture_output=True, cwd=case_dir)
    lines = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    return np.array([l["loss"] for l in lines if "lr" in l])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", required=True)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    worker = os.path.abspath(args.worker)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    root = tempfile.mkdtemp(prefix="mixed-vs-torch-")
    rng = np.random.default_rng(2024)
    print(f"torch {torch.__version__}, cases in {root}")
    rel = lambda a, b: np.abs(a - b) / np.abs(b)  # noqa: E731
    for name, spec in CASES.items():
        spec = {**spec, "train": {**spec["train"], "steps": args.steps}}
        d, cfg = make_case(root, name, rng, spec)  # every case, so the rng stays in step
        if spec["model"] != "gpt2" or spec["format"] != "tokens":
            continue
        builtin_model(worker, d, spec, cfg)
        tf32, tf16 = worker_train(worker, d, "fp32"), worker_train(worker, d, "bf16")
        pt32, pt16 = torch_losses(d, spec, cfg, False), torch_losses(d, spec, cfg, True)
        print(f"{name}: loss {pt32[0]:.4f} -> {pt32[-1]:.4f} over {args.steps} steps")
        print(f"  step 1: tensorfleet bf16 vs autocast {rel(tf16[0], pt16[0]):.1e}; "
              f"autocast vs fp32 {rel(pt16[0], pt32[0]):.1e}; tensorfleet bf16 vs fp32 {rel(tf16[0], tf32[0]):.1e}; "
              f"tensorfleet fp32 vs PyTorch fp32 {rel(tf32[0], pt32[0]):.1e}")
        print(f"  all steps, largest: tensorfleet bf16 vs autocast {rel(tf16, pt16).max():.1e}; "
              f"autocast vs fp32 {rel(pt16, pt32).max():.1e}; tensorfleet fp32 vs PyTorch fp32 {rel(tf32, pt32).max():.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
