#!/usr/bin/env python3
"""GPT-2 124M training throughput on one GPU: tensorfleet next to PyTorch, in the same run.

    python worker/benches/gpu_gpt2_124m.py --worker target/release/tensorfleet-worker \
        [--steps 20] [--warmup 5] [--micro-batches 64,32,16,8] [--rows ...] [--out target/gpu-bench]

`make bench-gpu` runs it. Needs a CUDA GPU, a CUDA build of torch, and nvidia-smi.

The model is GPT-2 124M as llm.c and nanoGPT train it: 12 layers, 12 heads, embed 768, seq 1024,
vocab 50257, tied LM head, tanh GELU, bf16 autocast over fp32 master weights, AdamW (lr 6e-4,
betas (0.9, 0.95), weight decay 0.1), on random tokens. For each of

  - PyTorch eager (F.scaled_dot_product_attention, fused AdamW),
  - PyTorch with torch.compile (the same model compiled),
  - tensorfleet (the worker binary, `precision: bf16`, `device: cuda`, fused attention),
  - tensorfleet with TENSORFLEET_CUDA_ATTENTION=warp (attention on the warp kernels rather than
    the tensor cores),
  - and in fp16 with dynamic loss scaling (the `_fp16` rows): tensorfleet `precision: fp16`,
    PyTorch eager and compiled under fp16 autocast with a GradScaler,

(--rows picks some, in the order given; the tensorfleet rows come first by default, so that a run
cut short has them) it takes the largest micro-batch of --micro-batches that trains without
running out of memory, times --steps steps after --warmup, and reports tokens/s, MFU and peak GPU
memory:

  - tokens/s: micro-batch × 1024 / the median step time (tensorfleet: the `itemsPerSec` of its
    metrics.jsonl lines after the warm-up);
  - MFU: model FLOPs per token (6·N + 12·L·C·T with N the parameters without the position
    embedding, llm.c's and PaLM's count, the worker's too) × tokens/s over the GPU's dense bf16
    peak (table below; --peak-tflops overrides);
  - peak memory: torch.cuda.max_memory_allocated for PyTorch; for the worker the largest
    `used_memory` nvidia-smi reports for its process, polled every 100 ms (which includes the
    CUDA context, so it reads higher than an allocator's count).

After a tensorfleet row (unless --no-profile) one more run at its micro-batch profiles its third
step (the worker's `profiling` config: each op timed to the GPU's completion) and lists the op
types that took the most time. A worker run is killed after --run-timeout seconds; each run's
stderr goes to <out>/worker-stderr.log. <out>/gpu-bench.json is written after each row and keeps
the rows of an earlier run into the same --out; the table is printed last.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_peer import Gpt2  # noqa: E402  (the CPU peer's model, the same code)

LAYERS, HEADS, EMBED, SEQ, VOCAB = 12, 12, 768, 1024, 50257
DEVICE = "cuda"  # the worker's; a harness check on a machine without a GPU sets "cpu"

# Dense bf16 tensor-core peaks, TFLOP/s, by a substring of the device name.
PEAKS = [("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("A100", 312.0), ("L40S", 362.0)]


def flops_per_token():
    n = VOCAB * EMBED + LAYERS * (12 * EMBED * EMBED + 13 * EMBED) + 2 * EMBED  # without wpe
    return 6 * n + 12 * LAYERS * EMBED * SEQ


def peak_tflops(name, override):
    if override:
        return override
    for key, tflops in PEAKS:
        if key in name:
            return tflops
    return None


def torch_run(compiled, micro_batch, steps, warmup, dtype=torch.bfloat16):
    """One timed PyTorch run; fp16 scales the loss as torch.amp does (GradScaler: the gradients
    unscaled before clipping, a step skipped where they overflow)."""
    torch.manual_seed(0)
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
    model = Gpt2(LAYERS, EMBED, HEADS, SEQ, VOCAB).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    step_fn = torch.compile(model) if compiled else model
    idx = torch.randint(0, VOCAB, (micro_batch, SEQ), device="cuda")
    labels = torch.randint(0, VOCAB, (micro_batch, SEQ), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    times = []
    for k in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=dtype):
            loss = step_fn(idx, labels)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if k >= warmup:
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    return {"tokens_per_s": micro_batch * SEQ / step, "step_ms": step * 1e3, "peak_bytes": torch.cuda.max_memory_allocated()}


def write_tokens(path, count):
    """An llm.c token shard (header: magic 20240520, version 1, token count) of random tokens."""
    import array
    import random

    rng = random.Random(0)
    header = array.array("i", [20240520, 1, count] + [0] * 253)
    tokens = array.array("H", (rng.randrange(VOCAB) for _ in range(count)))
    with open(path, "wb") as f:
        header.tofile(f)
        tokens.tofile(f)


def failure(stderr, code):
    """What a failed worker run said last, or its exit status."""
    return stderr.strip().splitlines()[-1] if stderr.strip() else f"exit {code}"


def worker_config(micro_batch, steps, out, peak, run_dir, precision="bf16"):
    """The worker's config for `steps` steps of `micro_batch` rows, and its token shard."""
    os.makedirs(f"{out}/tokens", exist_ok=True)
    shard = f"{out}/tokens/train_000000.bin"
    need = (steps + 1) * micro_batch * SEQ + 1
    if not os.path.exists(shard) or os.path.getsize(shard) < 1024 + 2 * need:
        write_tokens(shard, need)
    shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl appends; checkpoints would resume
    return {
        "model": {"gpt2": {"layers": LAYERS, "heads": HEADS, "embed": EMBED, "seqLen": SEQ, "vocab": VOCAB}},
        "data": {"train": {"path": f"{out}/tokens", "format": "tokens"}},
        "batchSize": micro_batch,
        "steps": steps,
        "optimizer": {"name": "adamw", "lr": 6e-4, "beta1": 0.9, "beta2": 0.95, "weightDecay": 0.1},
        "gradClipNorm": 1.0,
        "precision": precision,
        "device": DEVICE,
        "logging": {"every": 1, "tensorboard": False, "peakTflops": peak or 0},
        "output": {"dir": run_dir},
    }


def start_worker(worker, config, cfg_path, attention):
    """The worker training on `config` (written to `cfg_path`), its stderr piped (see
    wait_worker)."""
    with open(cfg_path, "w") as f:
        json.dump(config, f)
    env = dict(os.environ, TENSORFLEET_CUDA_ATTENTION=attention)
    proc = subprocess.Popen(
        [worker, "train", "--config", cfg_path, "--quiet"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    return proc


def wait_worker(proc, cfg_path, timeout, log):
    """Waits for the worker, killing it after `timeout` seconds; its stderr, whole, is appended
    to `log` (a failed run's last lines are printed too) and returned."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        err += f"\nkilled after {timeout} s"
    with open(log, "a") as f:
        f.write(f"==== {cfg_path}: exit {proc.returncode}\n{err}\n")
    if proc.returncode != 0:
        print("\n".join("    " + l for l in err.strip().splitlines()[-25:]), file=sys.stderr)
    return err


def worker_run(worker, micro_batch, steps, warmup, out, peak, attention="auto", timeout=240, precision="bf16"):
    """One timed worker run; `attention` is TENSORFLEET_CUDA_ATTENTION's value (warp: the warp
    kernels in place of the tensor-core ones); `precision` the worker's (bf16, or fp16 with its
    dynamic loss scale)."""
    run_dir = f"{out}/tensorfleet-{attention}-{precision}-mb{micro_batch}"
    config = worker_config(micro_batch, warmup + steps, out, peak, run_dir, precision)
    cfg_path = f"{run_dir}.json"
    started = time.perf_counter()
    proc = start_worker(worker, config, cfg_path, attention)
    peak_mib = [0]

    def poll():
        while proc.poll() is None:
            try:
                q = subprocess.run(
                    ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                )
            except FileNotFoundError:
                return  # no nvidia-smi: no memory figure (reported as 0)
            for line in q.stdout.splitlines():
                pid, mib = (s.strip() for s in line.split(","))
                if pid == str(proc.pid):
                    peak_mib[0] = max(peak_mib[0], int(mib))
            time.sleep(0.1)

    watcher = threading.Thread(target=poll)
    watcher.start()
    err = wait_worker(proc, cfg_path, timeout, f"{out}/worker-stderr.log")
    watcher.join()
    if proc.returncode != 0:
        return {"error": failure(err, proc.returncode)}
    lines = [json.loads(l) for l in open(f"{run_dir}/metrics.jsonl") if '"itemsPerSec"' in l]
    rates = [l["itemsPerSec"] for l in lines if l["step"] > warmup]
    if not rates:
        return {"error": f"no step after the {warmup} warm-up steps in {run_dir}/metrics.jsonl"}
    return {
        "tokens_per_s": statistics.median(rates),
        "peak_bytes": peak_mib[0] << 20,
        "losses": [l.get("loss") for l in lines],
        "wall_s": time.perf_counter() - started,
    }


def worker_profile(worker, micro_batch, out, peak, attention, top=15, timeout=240):
    """Where a tensorfleet step's time goes: the worker's op profile of its third step (each op
    timed to the GPU's completion, so launch gaps show as well), summed by op type."""
    run_dir = f"{out}/tensorfleet-profile"
    config = worker_config(micro_batch, 3, out, peak, run_dir)
    config["profiling"] = {"fromStep": 3, "toStep": 3}
    cfg_path = f"{out}/tensorfleet-profile.json"
    proc = start_worker(worker, config, cfg_path, attention)
    err = wait_worker(proc, cfg_path, timeout, f"{out}/worker-stderr.log")
    if proc.returncode != 0:
        return {"error": failure(err, proc.returncode)}
    events = json.load(open(f"{run_dir}/profile.json"))
    events = events["traceEvents"] if isinstance(events, dict) else events
    step_us = sum(e["dur"] for e in events if e.get("cat") == "step")
    by_op = {}
    for e in events:
        if e.get("cat") == "op":
            total, count = by_op.get(e["name"], (0.0, 0))
            by_op[e["name"]] = (total + e["dur"], count + 1)
    ops = sorted(by_op.items(), key=lambda kv: -kv[1][0])
    nodes = sorted((e for e in events if e.get("cat") == "op"), key=lambda e: -e["dur"])
    return {
        "micro_batch": micro_batch,
        "step_ms": step_us / 1e3,
        "ops_ms": sum(t for t, _ in by_op.values()) / 1e3,
        "top": [{"op": name, "ms": t / 1e3, "launches": n} for name, (t, n) in ops[:top]],
        # The single nodes that took longest (which product, which cast), for the JSON only.
        "top_nodes": [{"node": e.get("args", {}).get("node"), "op": e["name"], "ms": e["dur"] / 1e3} for e in nodes[:40]],
    }


def largest_that_fits(run, sizes):
    for mb in sizes:
        try:
            r = run(mb)
        except torch.OutOfMemoryError as e:
            r = {"error": f"out of memory: {e}".splitlines()[0]}
        torch.cuda.empty_cache()
        if "error" not in r:
            return dict(r, micro_batch=mb)
        print(f"  micro-batch {mb}: {r['error']}", file=sys.stderr)
        if not any(word in r["error"].lower() for word in ("memory", "allocate")):
            return dict(r, micro_batch_tried=mb)  # a failure a smaller batch would repeat
    return {"error": f"no micro-batch of {sizes} fits"}


ROWS = [
    "tensorfleet",
    "tensorfleet_warp_attn",
    "pytorch_eager",
    "pytorch_compile",
    "tensorfleet_fp16",
    "pytorch_eager_fp16",
    "pytorch_compile_fp16",
]


def print_table(summary):
    print(
        f"GPT-2 124M, seq {SEQ}, bf16 (the _fp16 rows: fp16, dynamic loss scaling), on {summary['gpu']} "
        f"(dense bf16 and fp16 peak {summary['peak_bf16_tflops']} TFLOP/s)"
    )
    print(f"{'':22} {'micro-batch':>11} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9}")
    for label in ROWS:
        r = summary["results"].get(label)
        if r is None:
            continue
        if "error" in r:
            print(f"{label:22} {r['error']}")
        else:
            mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-"
            print(f"{label:22} {r['micro_batch']:>11} {r['tokens_per_s']:>10.0f} {mfu:>6} {r['peak_bytes'] / 2**30:>9.1f}")
    profile = summary.get("tensorfleet_profile")
    if profile and "error" in profile:
        print(f"tensorfleet op profile: {profile['error']}")
    elif profile:
        print(
            f"tensorfleet op profile ({profile['attention']} attention), micro-batch {profile['micro_batch']}: "
            f"a profiled step {profile['step_ms']:.1f} ms, its ops {profile['ops_ms']:.1f} ms (each waited for)"
        )
        for o in profile["top"]:
            print(f"  {o['op']:28} {o['ms']:>9.2f} ms {o['launches']:>6} launches")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--micro-batches", default="64,32,16,8")
    ap.add_argument("--peak-tflops", type=float, default=0.0)
    ap.add_argument("--out", default="target/gpu-bench")
    ap.add_argument(
        "--rows",
        default=",".join(ROWS),
        help="which of the rows to measure, in this order; rows measured by an earlier run into the same "
        "--out are kept in its gpu-bench.json and table",
    )
    ap.add_argument("--run-timeout", type=int, default=240, help="seconds before a worker run is killed")
    ap.add_argument("--no-profile", action="store_true", help="skip tensorfleet's op profile")
    a = ap.parse_args()
    sizes = [int(s) for s in a.micro_batches.split(",")]
    rows = a.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        ap.error(f"--rows: {unknown} are not among {ROWS}")
    name = torch.cuda.get_device_name(0)
    peak = peak_tflops(name, a.peak_tflops)
    os.makedirs(a.out, exist_ok=True)
    json_path = f"{a.out}/gpu-bench.json"
    summary = {"results": {}, "tensorfleet_profile": None}
    if os.path.exists(json_path):
        summary = json.load(open(json_path))
    summary.update(
        gpu=name,
        peak_bf16_tflops=peak,
        torch=torch.__version__,
        model={"layers": LAYERS, "heads": HEADS, "embed": EMBED, "seq": SEQ, "vocab": VOCAB},
        flops_per_token=flops_per_token(),
        steps=a.steps,
        warmup=a.warmup,
    )
    runs = {
        "pytorch_eager": lambda mb: torch_run(False, mb, a.steps, a.warmup),
        "pytorch_compile": lambda mb: torch_run(True, mb, a.steps, a.warmup),
        "tensorfleet": lambda mb: worker_run(a.worker, mb, a.steps, a.warmup, a.out, peak, "auto", a.run_timeout),
        # What the tensor-core attention is worth (and a measurement should it fail).
        "tensorfleet_warp_attn": lambda mb: worker_run(
            a.worker, mb, a.steps, a.warmup, a.out, peak, "warp", a.run_timeout
        ),
        "pytorch_eager_fp16": lambda mb: torch_run(False, mb, a.steps, a.warmup, torch.float16),
        "pytorch_compile_fp16": lambda mb: torch_run(True, mb, a.steps, a.warmup, torch.float16),
        "tensorfleet_fp16": lambda mb: worker_run(
            a.worker, mb, a.steps, a.warmup, a.out, peak, "auto", a.run_timeout, "fp16"
        ),
    }
    for label in rows:
        print(f"{label} ...", file=sys.stderr)
        r = largest_that_fits(runs[label], sizes)
        if "tokens_per_s" in r and peak:
            r["mfu"] = flops_per_token() * r["tokens_per_s"] / (peak * 1e12)
        summary["results"][label] = r
        print(f"{label}: {json.dumps({k: v for k, v in r.items() if k != 'losses'})}", file=sys.stderr)
        with open(json_path, "w") as f:  # after each row, so a run cut short keeps what it measured
            json.dump(summary, f, indent=1)
        # The default kernels' profile, or the warp attention's where the default run failed.
        if label.startswith("tensorfleet") and not a.no_profile and "micro_batch" in r:
            if not (summary.get("tensorfleet_profile") or {}).get("top") or label == "tensorfleet":
                attention = "warp" if label == "tensorfleet_warp_attn" else "auto"
                print(f"{label} op profile ...", file=sys.stderr)
                profile = worker_profile(a.worker, r["micro_batch"], a.out, peak, attention, timeout=a.run_timeout)
                profile["attention"] = attention
                summary["tensorfleet_profile"] = profile
                with open(json_path, "w") as f:
                    json.dump(summary, f, indent=1)
    print_table(summary)


if __name__ == "__main__":
    main()
