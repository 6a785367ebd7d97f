#!/usr/bin/env python3
"""NumPy peer of the io bench (benches/io.rs): batches from llm.c token shards through np.memmap,
as nanoGPT and llm.c's Python tooling read them.

    python worker/benches/io_peer.py --batch 8 --seq 1024 --seconds 2 SHARD.bin...

Two samplers over the same shards, each timed for --seconds after a short warm-up:

  windows   the tensorfleet loader's access pattern: every shard cut into windows of B*T+1
            tokens, all windows of all shards visited in one seeded random order; inputs are a
            window's first B*T tokens, labels the same shifted by one, each as int64 [B, T].
            The memmaps stay open for the whole run.
  nanogpt   nanoGPT's get_batch: a fresh memmap per batch (nanoGPT does this to keep memory
            from growing), B random offsets into one shard, x and y stacked as int64 [B, T].

Prints one JSON object: {"windows_tokens_per_s": ..., "nanogpt_tokens_per_s": ..., ...}.
Only numpy is needed (.venv-bench has it; `make bench` creates that venv).
"""

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

HEADER_BYTES = 256 * 4
MAGIC_U16 = 20240520


def shard_tokens(path):
    """Token count from an llm.c u16 shard's header (the only kind prepare-data writes)."""
    header = np.fromfile(path, dtype="<i4", count=256)
    if header[0] != MAGIC_U16 or header[1] != 1:
        sys.exit(f"{path}: not an llm.c u16 token shard (magic {header[0]}, version {header[1]})")
    return int(header[2])


def timed(batch_fn, seconds, warmup=8):
    """Tokens per second of batch_fn over about `seconds`; returns (tokens/s, batches)."""
    for _ in range(warmup):
        batch_fn()
    n, tokens = 0, 0
    start = time.perf_counter()
    while True:
        x, y = batch_fn()
        tokens += x.size
        n += 1
        # Reading the clock every batch costs well under 1% of a batch here.
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return tokens / elapsed, n


def windows_sampler(paths, counts, b, t, seed):
    span = b * t
    maps = [np.memmap(p, dtype=np.uint16, mode="r", offset=HEADER_BYTES, shape=(n,)) for p, n in zip(paths, counts)]
    order = [(s, w) for s, n in enumerate(counts) for w in range((n - 1) // span)]
    perm = np.random.default_rng(seed).permutation(len(order))
    state = {"i": 0}

    def batch():
        s, w = order[perm[state["i"] % len(perm)]]
        state["i"] += 1
        start = w * span
        x = maps[s][start : start + span].astype(np.int64).reshape(b, t)
        y = maps[s][start + 1 : start + span + 1].astype(np.int64).reshape(b, t)
        return x, y

    return batch


def nanogpt_sampler(path, count, b, t, seed):
    rng = np.random.default_rng(seed)

    def batch():
        data = np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER_BYTES, shape=(count,))
        ix = rng.integers(0, count - t, size=b)
        x = np.stack([data[i : i + t].astype(np.int64) for i in ix])
        y = np.stack([data[i + 1 : i + 1 + t].astype(np.int64) for i in ix])
        return x, y

    return batch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--seconds", type=float, default=2.0, help="timed seconds per sampler")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("shards", nargs="+")
    a = ap.parse_args()
    counts = [shard_tokens(p) for p in a.shards]
    result = {
        "numpy_version": np.__version__,
        "python_version": platform.python_version(),
        "batch": a.batch,
        "seq": a.seq,
        "shards": len(a.shards),
        "load_avg_1m_before": round(os.getloadavg()[0], 2),
    }
    rate, n = timed(windows_sampler(a.shards, counts, a.batch, a.seq, a.seed), a.seconds)
    result["windows_tokens_per_s"] = round(rate, 1)
    result["windows_batches"] = n
    rate, n = timed(nanogpt_sampler(a.shards[0], counts[0], a.batch, a.seq, a.seed), a.seconds)
    result["nanogpt_tokens_per_s"] = round(rate, 1)
    result["nanogpt_batches"] = n
    result["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
