#!/usr/bin/env python3
"""Training throughput on one GPU: tensorfleet next to PyTorch, in the same run.

    python worker/benches/gpu_bench.py --worker target/release/tensorfleet-worker \
        [--model gpt2|llama|resnet50] [--steps 20] [--warmup 5] [--micro-batches 64,32,16,8] \
        [--rows ...] [--out target/gpu-bench]

`make bench-gpu` runs it. Needs a CUDA GPU, a CUDA build of torch, and nvidia-smi (no
torchvision, transformers or onnx: the PyTorch models are pytorch_peer.py's).

The models (--model):
  - gpt2: GPT-2 124M as llm.c and nanoGPT train it: 12 layers, 12 heads, embed 768, seq 1024,
    vocab 50257, tied LM head, tanh GELU, on random tokens; the worker's builtin `model.gpt2`,
    its vocabulary padded to a multiple of --vocab-multiple (128: 50304, as nanoGPT and
    Megatron pad it; the padded logits masked, so the same model; 1 leaves it at 50257).
    PyTorch's rows train the unpadded 50257 (torch.compile pads the products' strides itself).
  - llama: a Llama of 125M parameters: 12 layers, 12 heads, 4 kv-heads, embed 768, SwiGLU
    width 2048, seq 1024, vocab 32000 (Llama 2's), untied LM head, on random tokens; the
    worker's builtin `model.llama`, PyTorch's the same layers (Hugging Face's LlamaForCausalLM
    written out, SDPA with grouped-query attention).
  - resnet50: ResNet-50 (torchvision's v1.5 layout), 224×224 RGB, 1000 classes, on random
    images, both sides the same samples from the same initial weights; the worker trains the
    ONNX file the TorchScript exporter wrote from the same PyTorch module (export_resnet50.py,
    run by `make gpu-bundle`; its weights are filled in here from the module's seeded init, so
    that what is carried to the GPU machine stays small), with an attached softmaxCrossEntropy
    loss and BatchNormalization in training mode.
Each trains with bf16 autocast over fp32 master weights: GPT-2 and Llama with AdamW (lr 6e-4,
betas (0.9, 0.95), weight decay 0.1, gradients clipped to norm 1), ResNet-50 with SGD (lr 0.1,
momentum 0.9, weight decay 1e-4 on the weights of rank 2 or more). For each of

  - PyTorch eager (fused AdamW; F.scaled_dot_product_attention for the transformers),
  - PyTorch with torch.compile (the same model compiled),
  - tensorfleet (the worker binary, `precision: bf16`, `device: cuda`, fused attention),
  - tensorfleet with TENSORFLEET_CUDA_ATTENTION=warp (attention on the warp kernels rather than
    the tensor cores),
  - and in fp16 with dynamic loss scaling (the `_fp16` rows): tensorfleet `precision: fp16`,
    PyTorch eager and compiled under fp16 autocast with a GradScaler,

(--rows picks some, in the order given; the tensorfleet rows come first by default, so that a run
cut short has them) it takes the largest micro-batch of --micro-batches that trains without
running out of memory, times --steps steps after --warmup, and reports throughput, MFU, peak
GPU memory and the losses of the first and last steps (all of them in the JSON):

  - tokens/s (images/s for resnet50): micro-batch × sequence / the median step time
    (tensorfleet: the `itemsPerSec` of its metrics.jsonl lines after the warm-up);
  - MFU: model FLOPs per item × items/s over the GPU's dense bf16 peak (table below;
    --peak-tflops overrides). FLOPs per item are three times the forward's dense products
    (2 per multiply-add; the worker counts the same, graph/flops.rs): for the transformers
    llm.c's and PaLM's 6·N + 12·L·C·T per token (N the parameters the products read), for
    ResNet-50 its convolutions and classifier counted on the PyTorch module;
  - peak memory: torch.cuda.max_memory_allocated for PyTorch; for the worker the largest
    `used_memory` nvidia-smi reports for its process, polled every 100 ms (which includes the
    CUDA context, so it reads higher than an allocator's count).

After a tensorfleet row (unless --no-profile) one more run at its micro-batch profiles its third
step (the worker's `profiling` config: each op timed to the GPU's completion) and lists the op
types that took the most time. A worker run is killed after --run-timeout seconds; each run's
stderr goes to <out>/worker-stderr.log. <out>/gpu-bench-<model>.json is written after each row
and keeps the rows of an earlier run into the same --out; the table is printed last, and
written to <out>/gpu-bench-<model>.txt.
--device cpu runs the same harness on the CPU (both sides, tiny sizes), to check it without a GPU.
"""

import argparse
import array
import contextlib
import ctypes
import json
import os
import random
import shutil
import statistics
import struct
import subprocess
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_peer import Gpt2, Llama, ResNet50  # noqa: E402  (the CPU peer's models, the same code)

# Dense bf16 tensor-core peaks, TFLOP/s, by a substring of the device name.
PEAKS = [("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("A100", 312.0), ("L40S", 362.0)]

ADAMW = {"name": "adamw", "lr": 6e-4, "beta1": 0.9, "beta2": 0.95, "weightDecay": 0.1}


def write_tokens(path, count, vocab):
    """An llm.c token shard (header: magic 20240520, version 1, token count) of random tokens."""
    rng = random.Random(0)
    header = array.array("i", [20240520, 1, count] + [0] * 253)
    tokens = array.array("H", (rng.randrange(vocab) for _ in range(count)))
    with open(path, "wb") as f:
        header.tofile(f)
        tokens.tofile(f)


def tensor_proto(name, data_type, dims, raw):
    """A serialized onnx.TensorProto (dims 1, data_type 2, name 8, raw_data 9), written by hand
    so that the GPU machine needs no onnx package."""

    def varint(n):
        out = bytearray()
        while True:
            out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
            n >>= 7
            if not n:
                return bytes(out)

    def field(tag, payload):
        return varint(tag << 3 | 2) + varint(len(payload)) + payload

    dims_bytes = b"".join(varint(1 << 3) + varint(d) for d in dims)
    return dims_bytes + varint(2 << 3) + varint(data_type) + field(8, name.encode()) + field(9, raw)


def image_samples(count, size, classes):
    """`count` samples of 8 random images, repeated (the step's work does not depend on the
    values), each with a random label: the images as float32 bytes [3, size, size], the labels
    as ints. The worker's shard (write_images) and PyTorch's batch are these same samples."""
    rng = random.Random(0)
    images = [array.array("f", (rng.gauss(0.0, 1.0) for _ in range(3 * size * size))).tobytes() for _ in range(8)]
    return [images[i % 8] for i in range(count)], [rng.randrange(classes) for _ in range(count)]


def write_images(path, count, size, classes):
    """An ONNX Runtime sample shard (docs: shared notes' formats) of image_samples' `count`
    samples, `input` float32 [3, size, size] and `labels` int64 []."""
    images, labels = image_samples(count, size, classes)
    with open(path, "wb") as f:
        for image, label in zip(images, labels):
            tensors = [
                tensor_proto("input", 1, [3, size, size], image),
                tensor_proto("labels", 7, [], struct.pack("<q", label)),
            ]
            body = b"".join(struct.pack("<I", len(t)) + t for t in tensors)
            f.write(struct.pack("<I", len(body)) + body)


class Transformer:
    """What the GPT-2 and Llama benchmarks share: random tokens, AdamW, clipping."""

    unit = "tokens"
    seq = 1024
    clip = True  # gradients clipped to norm 1, as the worker's gradClipNorm

    def optimizer(self, model):
        return torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    def batch(self, micro_batch, device):
        idx = torch.randint(0, self.vocab, (micro_batch, self.seq), device=device)
        labels = torch.randint(0, self.vocab, (micro_batch, self.seq), device=device)
        return idx, labels

    def flops_per_item(self):
        return 6 * self.product_params() + 12 * self.layers * self.embed * self.seq

    def worker_config(self, micro_batch, steps, out):
        os.makedirs(f"{out}/tokens-{self.name}", exist_ok=True)
        shard = f"{out}/tokens-{self.name}/train_000000.bin"
        need = (steps + 1) * micro_batch * self.seq + 1
        if not os.path.exists(shard) or os.path.getsize(shard) < 1024 + 2 * need:
            write_tokens(shard, need, self.vocab)
        return {
            "model": {self.name: self.worker_model()},
            "data": {"train": {"path": f"{out}/tokens-{self.name}", "format": "tokens"}},
            "optimizer": ADAMW,
            "gradClipNorm": 1.0,
        }


class Gpt2Bench(Transformer):
    name = "gpt2"
    layers, heads, embed, vocab = 12, 12, 768, 50257
    title = "GPT-2 124M, seq 1024"

    def __init__(self, vocab_multiple):
        self.vocab_multiple = vocab_multiple

    def model(self):
        return Gpt2(self.layers, self.embed, self.heads, self.seq, self.vocab)

    def product_params(self):
        # Every parameter but the position embedding (the tied token embedding is the LM head).
        c = self.embed
        return self.vocab * c + self.layers * (12 * c * c + 13 * c) + 2 * c

    def worker_model(self):
        c = {"layers": self.layers, "heads": self.heads, "embed": self.embed}
        return dict(c, seqLen=self.seq, vocab=self.vocab, makeVocabSizeDivisibleBy=self.vocab_multiple)


class LlamaBench(Transformer):
    name = "llama"
    layers, heads, kv_heads, embed, ffn, vocab = 12, 12, 4, 768, 2048, 32000
    title = "Llama 125M (12 layers, 12 heads, 4 kv-heads, embed 768, SwiGLU 2048), seq 1024"

    def model(self):
        return Llama(self.layers, self.embed, self.heads, self.kv_heads, self.ffn, self.seq, self.vocab)

    def product_params(self):
        # The LM head and the blocks' projections (the token embedding is a lookup).
        c, kv = self.embed, self.kv_heads * self.embed // self.heads
        return self.vocab * c + self.layers * (2 * c * c + 2 * c * kv + 3 * c * self.ffn)

    def worker_model(self):
        return {
            "layers": self.layers,
            "heads": self.heads,
            "kvHeads": self.kv_heads,
            "embed": self.embed,
            "ffn": self.ffn,
            "seqLen": self.seq,
            "vocab": self.vocab,
        }


class ResNet50Bench:
    name = "resnet50"
    unit = "images"
    seq = 1
    clip = False
    classes = 1000

    def __init__(self, onnx_dir, size=224):
        self.onnx_dir, self.size = onnx_dir, size
        self.graph = None  # the exported graph with its weights, once written (weights())
        self.title = f"ResNet-50, {size}x{size}, 1000 classes"

    def model(self):
        return ResNet50(self.classes)

    def optimizer(self, model):
        decay = [p for p in model.parameters() if p.ndim >= 2]
        rest = [p for p in model.parameters() if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": 1e-4}, {"params": rest, "weight_decay": 0.0}]
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9)

    def batch(self, micro_batch, device):
        """The worker's samples (image_samples), so that both sides' losses can be compared."""
        images, labels = image_samples(micro_batch, self.size, self.classes)
        x = torch.frombuffer(bytearray(b"".join(images)), dtype=torch.float32)
        x = x.view(micro_batch, 3, self.size, self.size).to(device)
        return x, torch.tensor(labels, device=device)

    def flops_per_item(self):
        """Three times the forward's convolutions and classifier, counted on the module (on the
        meta device: shapes only)."""
        total = [0]

        def count(m, inputs, out):
            if isinstance(m, torch.nn.Conv2d):
                total[0] += 2 * out.numel() * m.weight[0].numel()
            elif isinstance(m, torch.nn.Linear):
                total[0] += 2 * out.numel() * m.in_features

        with torch.device("meta"):
            model = self.model()
        for m in model.modules():
            m.register_forward_hook(count)
        model.logits(torch.empty(1, 3, self.size, self.size, device="meta"))
        return 3 * total[0]

    def weights(self, run_dir):
        """The exported graph beside its weights: export_resnet50.py's graph and manifest, the
        weights file written from a freshly initialized module by name. Written once per
        benchmark: every worker run reads the same files, and the worker never writes them."""
        if self.graph:
            return self.graph
        os.makedirs(run_dir, exist_ok=True)
        graph = f"{run_dir}/resnet50.onnx"
        shutil.copy(f"{self.onnx_dir}/resnet50.onnx", graph)
        manifest = json.load(open(f"{self.onnx_dir}/resnet50.weights.json"))
        torch.manual_seed(0)
        state = self.model().state_dict()
        with open(f"{run_dir}/{manifest['location']}", "wb") as f:
            for w in manifest["weights"]:
                t = state[w["name"]].detach().to(torch.float32).clone()  # its own storage, no offset
                if list(t.shape) != w["shape"]:
                    raise SystemExit(f"{w['name']}: the module's shape {list(t.shape)}, the export's {w['shape']}")
                f.seek(w["offset"])
                f.write(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))  # no numpy needed
        self.graph = graph
        return graph

    def worker_config(self, micro_batch, steps, out):
        samples = f"{out}/images-{self.size}"
        shard = f"{samples}/train_000.pb"
        have = int(open(f"{samples}/count").read()) if os.path.exists(f"{samples}/count") else 0
        if have < micro_batch:
            os.makedirs(samples, exist_ok=True)
            write_images(shard, micro_batch, self.size, self.classes)
            open(f"{samples}/count", "w").write(str(micro_batch))
        return {
            "model": {"onnx": {"path": self.weights(f"{out}/resnet50-model"), "loss": {
                "type": "softmaxCrossEntropy", "output": "logits", "label": "labels"}}},
            "data": {"train": {"path": samples, "format": "onnxSamples"}},
            "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weightDecay": 1e-4},
        }


def peak_tflops(name, override):
    if override:
        return override
    for key, tflops in PEAKS:
        if key in name:
            return tflops
    return None


def torch_run(bench, device, compiled, micro_batch, steps, warmup, dtype=torch.bfloat16):
    """One timed PyTorch run; fp16 scales the loss as torch.amp does (GradScaler: the gradients
    unscaled before clipping, a step skipped where they overflow)."""
    torch.manual_seed(0)
    scaler = torch.amp.GradScaler(device, enabled=dtype == torch.float16)
    model = bench.model().to(device)
    opt = bench.optimizer(model)
    step_fn = torch.compile(model) if compiled else model
    x, labels = bench.batch(micro_batch, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for k in range(warmup + steps):
        sync()
        t0 = time.perf_counter()
        with torch.autocast(device, dtype=dtype):
            loss = step_fn(x, labels)
        losses.append(loss.detach())  # read after the loop: no wait in the timed steps
        scaler.scale(loss).backward()
        if bench.clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        sync()
        if k >= warmup:
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    return {
        "items_per_s": micro_batch * bench.seq / step,
        "step_ms": step * 1e3,
        "peak_bytes": peak,
        "losses": [l.item() for l in losses],
    }


def failure(stderr, code):
    """What a failed worker run said last, or its exit status."""
    return stderr.strip().splitlines()[-1] if stderr.strip() else f"exit {code}"


def worker_config(bench, device, micro_batch, steps, out, peak, run_dir, precision="bf16"):
    """The worker's config for `steps` steps of `micro_batch` samples, and its data."""
    shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl appends; checkpoints would resume
    return dict(
        bench.worker_config(micro_batch, steps, out),
        batchSize=micro_batch,
        steps=steps,
        precision=precision,
        device=device,
        logging={"every": 1, "tensorboard": False, "peakTflops": peak or 0},
        output={"dir": run_dir},
    )


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


def gpu_memory_poller(proc, peak_mib):
    """Polls nvidia-smi for the largest memory `proc` used, into peak_mib[0]."""

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
    return watcher


def worker_run(a, bench, micro_batch, peak, attention="auto", precision="bf16"):
    """One timed worker run; `attention` is TENSORFLEET_CUDA_ATTENTION's value (warp: the warp
    kernels in place of the tensor-core ones); `precision` the worker's (bf16, or fp16 with its
    dynamic loss scale)."""
    run_dir = f"{a.out}/tensorfleet-{bench.name}-{attention}-{precision}-mb{micro_batch}"
    config = worker_config(bench, a.device, micro_batch, a.warmup + a.steps, a.out, peak, run_dir, precision)
    cfg_path = f"{run_dir}.json"
    started = time.perf_counter()
    proc = start_worker(a.worker, config, cfg_path, attention)
    peak_mib = [0]
    watcher = gpu_memory_poller(proc, peak_mib)
    err = wait_worker(proc, cfg_path, a.run_timeout, f"{a.out}/worker-stderr.log")
    watcher.join()
    if proc.returncode != 0:
        return {"error": failure(err, proc.returncode)}
    lines = [json.loads(l) for l in open(f"{run_dir}/metrics.jsonl") if '"itemsPerSec"' in l]
    rates = [l["itemsPerSec"] for l in lines if l["step"] > a.warmup]
    if not rates:
        return {"error": f"no step after the {a.warmup} warm-up steps in {run_dir}/metrics.jsonl"}
    return {
        "items_per_s": statistics.median(rates),
        "peak_bytes": peak_mib[0] << 20,
        "losses": [l.get("loss") for l in lines],
        "wall_s": time.perf_counter() - started,
    }


def worker_profile(a, bench, micro_batch, peak, attention, top=15):
    """Where a tensorfleet step's time goes: the worker's op profile of its third step (each op
    timed to the GPU's completion, so launch gaps show as well), summed by op type."""
    run_dir = f"{a.out}/tensorfleet-{bench.name}-profile"
    config = worker_config(bench, a.device, micro_batch, 3, a.out, peak, run_dir)
    config["profiling"] = {"fromStep": 3, "toStep": 3}
    cfg_path = f"{run_dir}.json"
    proc = start_worker(a.worker, config, cfg_path, attention)
    err = wait_worker(proc, cfg_path, a.run_timeout, f"{a.out}/worker-stderr.log")
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
        if torch.cuda.is_available():
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
    unit = summary["unit"]
    print(
        f"{summary['title']}, bf16 (the _fp16 rows: fp16, dynamic loss scaling), on {summary['gpu']} "
        f"(dense bf16 and fp16 peak {summary['peak_bf16_tflops']} TFLOP/s)"
    )
    print(f"{'':22} {'micro-batch':>11} {unit + '/s':>10} {'MFU':>6} {'peak GiB':>9}  loss: first step → last")
    for label in ROWS:
        r = summary["results"].get(label)
        if r is None:
            continue
        if "error" in r:
            print(f"{label:22} {r['error']}")
        else:
            mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-"
            losses = [l for l in r.get("losses") or [] if l is not None]
            trend = f"{losses[0]:.4f} → {losses[-1]:.4f}" if losses else "-"
            print(
                f"{label:22} {r['micro_batch']:>11} {r['items_per_s']:>10.0f} {mfu:>6} "
                f"{r['peak_bytes'] / 2**30:>9.1f}  {trend}"
            )
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


def measure(a, bench, label, sizes, peak, summary, json_path):
    """One row into `summary` (and its JSON), and the tensorfleet profile after the first
    tensorfleet row that trained."""
    device = a.device
    runs = {
        "pytorch_eager": lambda mb: torch_run(bench, device, False, mb, a.steps, a.warmup),
        "pytorch_compile": lambda mb: torch_run(bench, device, True, mb, a.steps, a.warmup),
        "tensorfleet": lambda mb: worker_run(a, bench, mb, peak),
        # What the tensor-core attention is worth (and a measurement should it fail).
        "tensorfleet_warp_attn": lambda mb: worker_run(a, bench, mb, peak, "warp"),
        "pytorch_eager_fp16": lambda mb: torch_run(bench, device, False, mb, a.steps, a.warmup, torch.float16),
        "pytorch_compile_fp16": lambda mb: torch_run(bench, device, True, mb, a.steps, a.warmup, torch.float16),
        "tensorfleet_fp16": lambda mb: worker_run(a, bench, mb, peak, "auto", "fp16"),
    }
    print(f"{bench.name} {label} ...", file=sys.stderr)
    r = largest_that_fits(runs[label], sizes)
    if "items_per_s" in r and peak:
        r["mfu"] = bench.flops_per_item() * r["items_per_s"] / (peak * 1e12)
    summary["results"][label] = r
    print(f"{bench.name} {label}: {json.dumps({k: v for k, v in r.items() if k != 'losses'})}", file=sys.stderr)
    with open(json_path, "w") as f:  # after each row, so a run cut short keeps what it measured
        json.dump(summary, f, indent=1)
    # The default kernels' profile, or the warp attention's where the default run failed.
    if label.startswith("tensorfleet") and not a.no_profile and "micro_batch" in r:
        if not (summary.get("tensorfleet_profile") or {}).get("top") or label == "tensorfleet":
            attention = "warp" if label == "tensorfleet_warp_attn" else "auto"
            print(f"{bench.name} {label} op profile ...", file=sys.stderr)
            profile = worker_profile(a, bench, r["micro_batch"], peak, attention)
            profile["attention"] = attention
            summary["tensorfleet_profile"] = profile
            with open(json_path, "w") as f:
                json.dump(summary, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", required=True)
    ap.add_argument("--model", choices=("gpt2", "llama", "resnet50"), default="gpt2")
    ap.add_argument(
        "--resnet50-export", default=".gpu-bundle", help="where export_resnet50.py wrote resnet50.onnx and its manifest"
    )
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--micro-batches", default="64,32,16,8", help="samples: sequences, or images for resnet50")
    ap.add_argument("--peak-tflops", type=float, default=0.0)
    ap.add_argument("--out", default="target/gpu-bench")
    ap.add_argument(
        "--rows",
        default=",".join(ROWS),
        help="which of the rows to measure, in this order; rows measured by an earlier run into the same "
        "--out are kept in its JSON and table",
    )
    ap.add_argument("--run-timeout", type=int, default=240, help="seconds before a worker run is killed")
    ap.add_argument("--no-profile", action="store_true", help="skip tensorfleet's op profile")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: check the harness without a GPU")
    ap.add_argument("--image-size", type=int, default=224, help="resnet50's input (smaller for a CPU check)")
    ap.add_argument(
        "--vocab-multiple", type=int, default=128, help="gpt2: the worker pads its vocabulary to a multiple of this"
    )
    a = ap.parse_args()
    sizes = [int(s) for s in a.micro_batches.split(",")]
    rows = a.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        ap.error(f"--rows: {unknown} are not among {ROWS}")
    if a.model == "gpt2":
        bench = Gpt2Bench(a.vocab_multiple)
    elif a.model == "llama":
        bench = LlamaBench()
    else:
        bench = ResNet50Bench(a.resnet50_export, a.image_size)
    name = torch.cuda.get_device_name(0) if a.device == "cuda" else "the CPU"
    peak = peak_tflops(name, a.peak_tflops)
    os.makedirs(a.out, exist_ok=True)
    json_path = f"{a.out}/gpu-bench-{bench.name}.json"
    summary = {"results": {}, "tensorfleet_profile": None}
    if os.path.exists(json_path):
        summary = json.load(open(json_path))
    summary.update(
        gpu=name,
        peak_bf16_tflops=peak,
        torch=torch.__version__,
        model=bench.name,
        title=bench.title,
        unit=bench.unit,
        flops_per_item=bench.flops_per_item(),
        steps=a.steps,
        warmup=a.warmup,
    )
    for label in rows:
        measure(a, bench, label, sizes, peak, summary, json_path)
    print_table(summary)
    with open(f"{a.out}/gpu-bench-{bench.name}.txt", "w") as f, contextlib.redirect_stdout(f):
        print_table(summary)


if __name__ == "__main__":
    main()
