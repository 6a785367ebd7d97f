#!/usr/bin/env python3
"""Independent numpy reference for tensorfleet-worker training runs.

    python reference_train.py --config CFG.yaml [--base-dir DIR] --output losses.json
    python reference_train.py --self-test

Reads a worker training configuration (YAML, or JSON when the text starts with "{"), loads the
initial weights from the ONNX file named by `model.onnx.path` (initializers only: the graph itself
is not interpreted), recognises the builtin GPT-2 or MLP from the initializer names, and trains it
with a hand-written forward and backward pass, the worker's data loaders, optimizers, gradient
clipping, accumulation and LR schedules. Writes

    {"losses": [loss of each weight update, the mean over its micro-batches, before the update],
     "lrs": [...], "gradNorms": [...], "model": "gpt2" | "mlp",
     "weights": {name: final values as nested lists}}

and the same final weights to `<output without .json>.npz` (see --weights).

Everything is computed in float64, on purpose: this is the reference the float32 engine is
compared with, so its own rounding must be negligible next to the engine's.

Needs numpy, onnx and PyYAML (PyYAML only for YAML configs).

Model contracts (weights are [in, out], y = x @ W + b):
  GPT-2: wte [V,C], wpe [T,C], h.{l}.ln_1.{weight,bias}, h.{l}.attn.c_attn.{weight [C,3C],bias},
         h.{l}.attn.c_proj.{weight [C,C],bias}, h.{l}.ln_2.*, h.{l}.mlp.c_fc.{weight [C,4C],bias},
         h.{l}.mlp.c_proj.{weight [4C,C],bias}, ln_f.{weight,bias}; logits tied to wte; inputs
         input_ids/labels int64 [B,T].
  MLP:   fc{i}.weight [in,out], fc{i}.bias [out], ReLU between layers; inputs x [B,IN], labels [B].
  Also GPT-2s exported from PyTorch with their module names kept (nanoGPT's nn.Linear weights
  [out, in], or Hugging Face's Conv1D [in, out]) under `[prefix.]transformer.{wte,wpe,h.N.*,ln_f}`;
  their final weights are written back under those names and layouts.
Heads: --heads, else model.gpt2.heads, else metadata_props "heads", else read off the graph's
reshape to [B,T,H,C/H].
Loss: mean softmax cross-entropy over all positions whose label is not -100.
"""

import argparse
import glob
import json
import math
import os
import re
import struct
import sys

import numpy as np

IGNORE_INDEX = -100
LN_EPS = 1e-5
GELU_K = math.sqrt(2.0 / math.pi)
TOKENS_MAGIC_U16 = 20240520
TOKENS_MAGIC_U32 = 20240801


class OracleError(Exception):
    """A configuration, model or data problem, reported with what and where."""


# ----------------------------------------------------------------------------------------------
# Layers: each forward returns (out, cache); each backward takes (dout, cache) and returns grads.


def layernorm_forward(x, w, b):
    # x: [..., C]; biased variance, as torch.nn.LayerNorm and ONNX LayerNormalization.
    mean = x.mean(axis=-1, keepdims=True)
    xc = x - mean
    var = (xc * xc).mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(var + LN_EPS)
    xhat = xc * rstd
    return xhat * w + b, (xhat, rstd, w)


def layernorm_backward(dout, cache):
    xhat, rstd, w = cache
    c = xhat.shape[-1]
    dw = (dout * xhat).reshape(-1, c).sum(axis=0)
    db = dout.reshape(-1, c).sum(axis=0)
    dxhat = dout * w
    dx = rstd * (
        dxhat
        - dxhat.mean(axis=-1, keepdims=True)
        - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True)
    )
    return dx, dw, db


def linear_forward(x, w, b):
    # x: [..., in], w: [in, out], b: [out]
    return x @ w + b, x


def linear_backward(dout, x, w):
    n_in, n_out = w.shape
    dw = x.reshape(-1, n_in).T @ dout.reshape(-1, n_out)
    db = dout.reshape(-1, n_out).sum(axis=0)
    dx = dout @ w.T
    return dx, dw, db


def gelu_tanh_forward(x):
    t = np.tanh(GELU_K * (x + 0.044715 * x**3))
    return 0.5 * x * (1.0 + t), (x, t)


def gelu_tanh_backward(dout, cache):
    x, t = cache
    du = GELU_K * (1.0 + 3.0 * 0.044715 * x * x)
    return dout * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du)


def attention_forward(qkv, n_head):
    # qkv: [B,T,3C] -> y: [B,T,C]; causal (key j > query i is excluded).
    bsz, t, c3 = qkv.shape
    c = c3 // 3
    hd = c // n_head

    def heads(z):  # [B,T,C] -> [B,H,T,hd]
        return z.reshape(bsz, t, n_head, hd).transpose(0, 2, 1, 3)

    q, k, v = (heads(qkv[..., i * c:(i + 1) * c]) for i in range(3))
    scale = 1.0 / math.sqrt(hd)
    scores = (q @ k.transpose(0, 1, 3, 2)) * scale  # [B,H,T,T]
    future = np.triu(np.ones((t, t), dtype=bool), k=1)
    scores = np.where(future, -np.inf, scores)
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    y = p @ v  # [B,H,T,hd]
    y = y.transpose(0, 2, 1, 3).reshape(bsz, t, c)
    return y, (q, k, v, p, scale)


def attention_backward(dy, cache):
    q, k, v, p, scale = cache
    bsz, n_head, t, hd = q.shape
    dy = dy.reshape(bsz, t, n_head, hd).transpose(0, 2, 1, 3)  # [B,H,T,hd]
    dp = dy @ v.transpose(0, 1, 3, 2)  # [B,H,T,T]
    dv = p.transpose(0, 1, 3, 2) @ dy
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))  # masked entries have p == 0
    dq = (ds @ k) * scale
    dk = (ds.transpose(0, 1, 3, 2) @ q) * scale

    def merge(z):  # [B,H,T,hd] -> [B,T,C]
        return z.transpose(0, 2, 1, 3).reshape(bsz, t, n_head * hd)

    return np.concatenate([merge(dq), merge(dk), merge(dv)], axis=-1)


def cross_entropy_forward(logits, labels):
    # logits: [N,V], labels: [N]; mean over labels != -100.
    valid = labels != IGNORE_INDEX
    n_valid = int(valid.sum())
    shifted = logits - logits.max(axis=-1, keepdims=True)
    logsumexp = np.log(np.exp(shifted).sum(axis=-1))
    safe = np.where(valid, labels, 0)
    if safe.size and (safe.min() < 0 or safe.max() >= logits.shape[-1]):
        raise OracleError(
            f"label out of range [0, {logits.shape[-1]}): min {safe.min()}, max {safe.max()}"
        )
    nll = logsumexp - shifted[np.arange(len(labels)), safe]
    loss = float((nll * valid).sum() / n_valid) if n_valid else float("nan")
    return loss, (shifted, logsumexp, safe, valid, n_valid)


def cross_entropy_backward(cache):
    shifted, logsumexp, safe, valid, n_valid = cache
    dlogits = np.exp(shifted - logsumexp[:, None])
    dlogits[np.arange(len(safe)), safe] -= 1.0
    dlogits *= (valid / max(n_valid, 1))[:, None]
    return dlogits


# ----------------------------------------------------------------------------------------------
# Models: loss_and_grads(params, batch) -> (loss, {name: grad})


class Gpt2:
    kind = "gpt2"

    def __init__(self, params, n_head):
        self.n_layer = count_layers(params)
        self.n_head = n_head
        c = params["wte"].shape[1]
        if c % n_head:
            raise OracleError(f"embed {c} is not divisible by heads {n_head}")
        self.seq_len = params["wpe"].shape[0]
        self.vocab = params["wte"].shape[0]

    def loss_and_grads(self, params, batch, need_grads=True):
        ids = batch["input_ids"].astype(np.int64)
        labels = batch["labels"].astype(np.int64)
        bsz, t = ids.shape
        if t > self.seq_len:
            raise OracleError(f"sequence length {t} exceeds wpe rows {self.seq_len}")
        if ids.min() < 0 or ids.max() >= self.vocab:
            raise OracleError(f"input_ids out of range [0, {self.vocab})")
        x = params["wte"][ids] + params["wpe"][:t]  # [B,T,C]
        caches = []
        for layer in range(self.n_layer):
            pre = f"h.{layer}."

            def p(n, pre=pre):
                return params[pre + n]

            a, ln1 = layernorm_forward(x, p("ln_1.weight"), p("ln_1.bias"))
            qkv, qkv_in = linear_forward(a, p("attn.c_attn.weight"), p("attn.c_attn.bias"))
            y, att = attention_forward(qkv, self.n_head)
            o, proj_in = linear_forward(y, p("attn.c_proj.weight"), p("attn.c_proj.bias"))
            x = x + o
            m, ln2 = layernorm_forward(x, p("ln_2.weight"), p("ln_2.bias"))
            f, fc_in = linear_forward(m, p("mlp.c_fc.weight"), p("mlp.c_fc.bias"))
            g, gelu = gelu_tanh_forward(f)
            o2, proj2_in = linear_forward(g, p("mlp.c_proj.weight"), p("mlp.c_proj.bias"))
            x = x + o2
            caches.append((ln1, qkv_in, att, proj_in, ln2, fc_in, gelu, proj2_in))
        xf, lnf = layernorm_forward(x, params["ln_f.weight"], params["ln_f.bias"])
        logits = xf @ params["wte"].T  # [B,T,V]
        loss, ce = cross_entropy_forward(logits.reshape(bsz * t, -1), labels.reshape(-1))
        if not need_grads:
            return loss, None

        grads = {}
        dlogits = cross_entropy_backward(ce).reshape(bsz, t, -1)
        dwte = dlogits.reshape(bsz * t, -1).T @ xf.reshape(bsz * t, -1)
        dxf = dlogits @ params["wte"]
        dx, grads["ln_f.weight"], grads["ln_f.bias"] = layernorm_backward(dxf, lnf)
        for layer in reversed(range(self.n_layer)):
            ln1, qkv_in, att, proj_in, ln2, fc_in, gelu, proj2_in = caches[layer]
            pre = f"h.{layer}."

            def p(n, pre=pre):
                return params[pre + n]

            dg, grads[pre + "mlp.c_proj.weight"], grads[pre + "mlp.c_proj.bias"] = (
                linear_backward(dx, proj2_in, p("mlp.c_proj.weight")))
            df = gelu_tanh_backward(dg, gelu)
            dm, grads[pre + "mlp.c_fc.weight"], grads[pre + "mlp.c_fc.bias"] = (
                linear_backward(df, fc_in, p("mlp.c_fc.weight")))
            dres, grads[pre + "ln_2.weight"], grads[pre + "ln_2.bias"] = layernorm_backward(dm, ln2)
            dx = dx + dres
            dy, grads[pre + "attn.c_proj.weight"], grads[pre + "attn.c_proj.bias"] = (
                linear_backward(dx, proj_in, p("attn.c_proj.weight")))
            dqkv = attention_backward(dy, att)
            da, grads[pre + "attn.c_attn.weight"], grads[pre + "attn.c_attn.bias"] = (
                linear_backward(dqkv, qkv_in, p("attn.c_attn.weight")))
            dres, grads[pre + "ln_1.weight"], grads[pre + "ln_1.bias"] = layernorm_backward(da, ln1)
            dx = dx + dres
        np.add.at(dwte, ids.reshape(-1), dx.reshape(bsz * t, -1))
        grads["wte"] = dwte
        dwpe = np.zeros_like(params["wpe"])
        dwpe[:t] = dx.sum(axis=0)
        grads["wpe"] = dwpe
        return loss, grads


class Mlp:
    kind = "mlp"

    def __init__(self, params):
        self.n_layer = count_fc_layers(params)

    def loss_and_grads(self, params, batch, need_grads=True):
        x = batch["x"].astype(np.float64)
        x = x.reshape(x.shape[0], -1)
        labels = batch["labels"].astype(np.int64).reshape(-1)
        inputs, pre_act = [], []
        for i in range(self.n_layer):
            inputs.append(x)
            x, _ = linear_forward(x, params[f"fc{i}.weight"], params[f"fc{i}.bias"])
            if i + 1 < self.n_layer:
                pre_act.append(x)
                x = np.maximum(x, 0.0)
        loss, ce = cross_entropy_forward(x, labels)
        if not need_grads:
            return loss, None
        grads = {}
        dx = cross_entropy_backward(ce)
        for i in reversed(range(self.n_layer)):
            if i + 1 < self.n_layer:
                dx = dx * (pre_act[i] > 0)
            dx, grads[f"fc{i}.weight"], grads[f"fc{i}.bias"] = linear_backward(
                dx, inputs[i], params[f"fc{i}.weight"])
        return loss, grads


def count_layers(params):
    layers = {int(m.group(1)) for n in params if (m := re.match(r"h\.(\d+)\.", n))}
    if layers != set(range(len(layers))):
        raise OracleError(f"GPT-2 layer indices are not 0..L-1: {sorted(layers)}")
    return len(layers)


def count_fc_layers(params):
    layers = {int(m.group(1)) for n in params if (m := re.match(r"fc(\d+)\.weight$", n))}
    if not layers or layers != set(range(len(layers))):
        raise OracleError(f"MLP layers are not fc0..fc(L-1): {sorted(layers)}")
    return len(layers)


def gpt2_param_names(n_layer):
    names = ["wte", "wpe"]
    for layer in range(n_layer):
        for n in ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
                  "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
                  "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"):
            names.append(f"h.{layer}.{n}")
    return names + ["ln_f.weight", "ln_f.bias"]


# ----------------------------------------------------------------------------------------------
# ONNX model: initial weights and (for GPT-2) the number of heads


def load_onnx(path):
    try:
        import onnx
        from onnx import numpy_helper
    except ImportError as e:  # pragma: no cover
        raise OracleError(f"the onnx package is needed to read {path}: {e}") from e
    if not os.path.isfile(path):
        raise OracleError(f"model file not found: {path}")
    model = onnx.load(path)  # external data files are resolved beside the model
    params = {}
    for init in model.graph.initializer:
        arr = numpy_helper.to_array(init)
        if arr.dtype.kind == "f":
            params[init.name] = arr.astype(np.float64)
    return model, params


def torch_gpt2_names(params):
    """Map nanoGPT / Hugging Face names (`[prefix.]transformer.h.0.attn.c_attn.weight`, ...) to the
    contract's names. Returns {contract name: (onnx name, transposed)}, or None if not such a model.
    nn.Linear keeps weights [out, in] (transposed here); HF's Conv1D keeps [in, out]: c_attn's shape
    tells which."""
    wte = [n for n in params if n.endswith("wte.weight") and params[n].ndim == 2]
    if len(wte) != 1:
        return None
    prefix = wte[0][:-len("wte.weight")]
    c = params[wte[0]].shape[1]
    attn = params.get(prefix + "h.0.attn.c_attn.weight")
    linear = attn is not None and attn.shape == (3 * c, c)
    mapping = {}
    for name, arr in params.items():
        if not name.startswith(prefix):
            continue
        short = name[len(prefix):]
        if short in ("wte.weight", "wpe.weight"):
            mapping[short[:3]] = (name, False)
        elif re.match(r"h\.\d+\.|ln_f\.", short):
            mapping[short] = (name, linear and arr.ndim == 2)
    return mapping


def select_gpt2_params(params, path):
    """The contract's GPT-2 parameters, and how each maps back to an initializer of the file."""
    mapping = {n: (n, False) for n in params}
    if "wte" not in params:
        mapping = torch_gpt2_names(params) or {}
    renamed = {k: (params[n].T.copy() if t else params[n]) for k, (n, t) in mapping.items()}
    n_layer = count_layers(renamed)
    names = gpt2_param_names(n_layer)
    missing = [n for n in names if n not in renamed]
    if missing:
        raise OracleError(f"{path}: GPT-2 initializers missing: {missing}")
    used = {mapping[n][0] for n in names}
    unused = [n for n, a in params.items() if n not in used and a.size > 1]
    if unused:
        print(f"reference_train: warning: {path}: float initializers the oracle does not use "
              f"(an untied LM head would be one): {unused}", file=sys.stderr)
    return {n: renamed[n] for n in names}, {n: mapping[n] for n in names}


def select_mlp_params(params, path):
    n_layer = count_fc_layers(params)
    out = {}
    for i in range(n_layer):
        for n in (f"fc{i}.weight", f"fc{i}.bias"):
            if n not in params:
                raise OracleError(f"{path}: MLP initializer missing: {n}")
            out[n] = params[n]
    return out, {n: (n, False) for n in out}


def detect_heads(model, c):
    """Heads of a GPT-2 graph: metadata_props `heads`; else the H of a Reshape to [B,T,H,C/H],
    its shape given as one int64 constant or as a Concat of four pieces (torch's export)."""
    for prop in model.metadata_props:
        if prop.key in ("heads", "n_head", "gpt2.heads", "num_heads"):
            return int(prop.value)
    from onnx import numpy_helper

    consts = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer
              if t.data_type == 7}
    producers = {}
    for node in model.graph.node:
        for out in node.output:
            producers[out] = node
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value" and a.t.data_type == 7:
                    consts[node.output[0]] = numpy_helper.to_array(a.t)

    def const(name, depth=0):  # int64 constant through Unsqueeze / Cast / Identity, else None
        if name in consts:
            return consts[name].reshape(-1)
        node = producers.get(name)
        if node is None or depth > 4 or node.op_type not in ("Unsqueeze", "Cast", "Identity",
                                                             "Squeeze"):
            return None
        return const(node.input[0], depth + 1)

    candidates = set()
    for node in model.graph.node:
        if node.op_type == "Reshape" and len(node.input) > 1:
            shape = const(node.input[1])
            if shape is not None and shape.size == 4:
                h, hd = int(shape[2]), int(shape[3])
                if h > 1 and h * hd == c:
                    candidates.add(h)
            src = producers.get(node.input[1])
            if (shape is None and src is not None and src.op_type == "Concat"
                    and len(src.input) == 4):
                h, hd = const(src.input[2]), const(src.input[3])
                if h is not None and h.size == 1 and h[0] > 1 and c % int(h[0]) == 0 and (
                        hd is None or int(hd[0]) * int(h[0]) == c):
                    candidates.add(int(h[0]))
        if node.op_type in ("Attention", "MultiHeadAttention"):
            for a in node.attribute:
                if a.name in ("num_heads", "q_num_heads"):
                    candidates.add(int(a.i))
    if len(candidates) == 1:
        return candidates.pop()
    return None


# ----------------------------------------------------------------------------------------------
# Data


def list_shards(path, ext):
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise OracleError(f"data path not found: {path}")
    files = sorted(glob.glob(os.path.join(path, "*" + ext)))
    if not files:
        raise OracleError(f"no *{ext} files in {path}")
    return files


def read_token_shard(path):
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(1024), dtype="<i4")
        if header.size != 256:
            raise OracleError(f"{path}: truncated header")
        magic, version, ntok = int(header[0]), int(header[1]), int(header[2])
        if magic == TOKENS_MAGIC_U16 and version == 1:
            dtype = "<u2"
        elif magic == TOKENS_MAGIC_U32 and version == 7:
            dtype = "<u4"
        else:
            raise OracleError(f"{path}: bad magic/version {magic}/{version}")
        tokens = np.frombuffer(f.read(), dtype=dtype)
    if tokens.size < ntok:
        raise OracleError(f"{path}: header says {ntok} tokens, file holds {tokens.size}")
    return tokens[:ntok].astype(np.int64)


class TokenLoader:
    """llm.c-style sequential windows of B*T+1 tokens, moving to the next shard when one ends."""

    def __init__(self, path, batch_size, seq_len):
        self.shards = [read_token_shard(p) for p in list_shards(path, ".bin")]
        self.paths = list_shards(path, ".bin")
        self.b, self.t = batch_size, seq_len
        if all(s.size < self.b * self.t + 1 for s in self.shards):
            raise OracleError(
                f"{path}: no token shard holds B*T+1 = {self.b * self.t + 1} tokens")
        self.shard, self.pos = 0, 0

    def next_batch(self):
        need = self.b * self.t + 1
        while self.pos + need > self.shards[self.shard].size:
            self.shard = (self.shard + 1) % len(self.shards)
            self.pos = 0
        window = self.shards[self.shard][self.pos:self.pos + need]
        self.pos += self.b * self.t
        return {
            "input_ids": window[:-1].reshape(self.b, self.t),
            "labels": window[1:].reshape(self.b, self.t),
        }


def read_sample_shard(path):
    from onnx import TensorProto, numpy_helper

    with open(path, "rb") as f:
        data = f.read()
    samples, off = [], 0
    while off < len(data):
        if off + 4 > len(data):
            raise OracleError(f"{path}: truncated sample size at byte {off}")
        (size,) = struct.unpack_from("<I", data, off)
        off += 4
        end = off + size
        if end > len(data):
            raise OracleError(f"{path}: sample at byte {off - 4} runs past the end of the file")
        sample = {}
        while off < end:
            (n,) = struct.unpack_from("<I", data, off)
            off += 4
            if off + n > end:
                raise OracleError(f"{path}: tensor at byte {off - 4} runs past its sample")
            tensor = TensorProto()
            tensor.ParseFromString(data[off:off + n])
            off += n
            sample[tensor.name] = numpy_helper.to_array(tensor)
        samples.append(sample)
    return samples


class SampleLoader:
    """ONNX Runtime-style samples, in file order, B per batch; wraps, dropping the short tail."""

    def __init__(self, path, batch_size):
        self.samples = [s for p in list_shards(path, ".pb") for s in read_sample_shard(p)]
        self.b = batch_size
        self.n_batches = len(self.samples) // batch_size
        if self.n_batches == 0:
            raise OracleError(f"{path}: {len(self.samples)} samples, fewer than batch {batch_size}")
        self.next = 0

    def next_batch(self):
        chunk = self.samples[self.next * self.b:(self.next + 1) * self.b]
        self.next = (self.next + 1) % self.n_batches
        return {name: np.stack([s[name] for s in chunk]) for name in chunk[0]}


# ----------------------------------------------------------------------------------------------
# Optimizers (torch.optim semantics), clipping, schedules


def decays(p):
    return p.ndim >= 2  # weight decay only for matrices and embeddings


class AdamW:
    def __init__(self, params, lr, beta1, beta2, eps, weight_decay, decoupled=True):
        self.b1, self.b2, self.eps = beta1, beta2, eps
        self.wd, self.decoupled = weight_decay, decoupled
        self.m = {n: np.zeros_like(p) for n, p in params.items()}
        self.v = {n: np.zeros_like(p) for n, p in params.items()}
        self.t = 0

    def step(self, params, grads, lr):
        self.t += 1
        bc1 = 1.0 - self.b1**self.t
        bc2 = 1.0 - self.b2**self.t
        for n, p in params.items():
            g = grads[n]
            wd = self.wd if decays(p) else 0.0
            if self.decoupled:
                p *= 1.0 - lr * wd
            else:
                g = g + wd * p
            self.m[n] = self.b1 * self.m[n] + (1.0 - self.b1) * g
            self.v[n] = self.b2 * self.v[n] + (1.0 - self.b2) * g * g
            p -= lr * (self.m[n] / bc1) / (np.sqrt(self.v[n] / bc2) + self.eps)


class Sgd:
    def __init__(self, params, momentum, nesterov, weight_decay):
        self.momentum, self.nesterov, self.wd = momentum, nesterov, weight_decay
        self.buf = {}

    def step(self, params, grads, lr):
        for n, p in params.items():
            g = grads[n]
            if self.wd and decays(p):
                g = g + self.wd * p
            if self.momentum:
                if n in self.buf:
                    self.buf[n] = self.momentum * self.buf[n] + g
                else:
                    self.buf[n] = g.copy()
                g = g + self.momentum * self.buf[n] if self.nesterov else self.buf[n]
            p -= lr * g


def clip_grad_norm(grads, max_norm):
    total = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
    if max_norm > 0:
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for g in grads.values():
                g *= coef
    return total


def learning_rate(sched, lr, step, total):
    """LR of weight update `step` (0-based) of `total`."""
    name = sched.get("name", "constant")
    warmup = int(sched.get("warmupSteps", 0) or 0)
    min_lr = float(sched.get("minLr", 0.0) or 0.0)
    if step < warmup:
        return lr * (step + 1) / warmup
    span = max(total - warmup, 1)
    frac = (step - warmup) / span
    if name == "constant":
        return lr
    if name == "cosine":
        return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * frac))
    if name == "linear":
        return lr - (lr - min_lr) * frac
    raise OracleError(f"lrSchedule.name: '{name}' is not implemented by the oracle "
                      "(constant, cosine, linear)")


# ----------------------------------------------------------------------------------------------
# Configuration and the training loop


def load_config(path):
    if not os.path.isfile(path):
        raise OracleError(f"config file not found: {path}")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("{"):
        return json.loads(text)
    try:
        import yaml
    except ImportError as e:
        raise OracleError(f"{path} is YAML: install PyYAML, or write the config as JSON") from e
    return yaml.safe_load(text)


def get(cfg, dotted, default=None):
    node = cfg
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return node


def build(cfg, base_dir, heads_override=None, model_override=None):
    """Model, parameters and data loader described by a worker configuration."""
    onnx_path = model_override or get(cfg, "model.onnx.path")
    if onnx_path is None:
        raise OracleError("model.onnx.path: the oracle needs the initial weights as an ONNX file "
                          "(or pass --model FILE.onnx, e.g. for a builtin model.gpt2 config)")
    onnx_path = os.path.join(base_dir, onnx_path) if not model_override else onnx_path
    onnx_model, all_params = load_onnx(onnx_path)
    batch_size = int(get(cfg, "batchSize", 1))
    data_path = get(cfg, "data.train.path")
    if data_path is None:
        raise OracleError("data.train.path is missing")
    data_path = os.path.join(base_dir, data_path)
    fmt = get(cfg, "data.train.format", "tokens")
    if get(cfg, "data.shuffle", False):
        raise OracleError("data.shuffle: the oracle reads data in order only; set it to false")

    if "wte" in all_params or torch_gpt2_names(all_params):
        params, names = select_gpt2_params(all_params, onnx_path)
        heads = heads_override or get(cfg, "model.gpt2.heads")
        heads = heads or detect_heads(onnx_model, params["wte"].shape[1])
        if not heads:
            raise OracleError(f"{onnx_path}: cannot tell the number of attention heads; "
                              "pass --heads N or set model.gpt2.heads")
        model = Gpt2(params, int(heads))
        seq_len = int(get(cfg, "model.gpt2.seqLen", model.seq_len))
        if fmt == "tokens":
            loader = TokenLoader(data_path, batch_size, seq_len)
        elif fmt == "onnxSamples":
            loader = SampleLoader(data_path, batch_size)
        else:
            raise OracleError(f"data.train.format: unknown '{fmt}' (tokens, onnxSamples)")
    elif "fc0.weight" in all_params:
        params, names = select_mlp_params(all_params, onnx_path)
        model = Mlp(params)
        if fmt != "onnxSamples":
            raise OracleError(f"data.train.format: the MLP reads onnxSamples, not '{fmt}'")
        loader = SampleLoader(data_path, batch_size)
    else:
        raise OracleError(f"{onnx_path}: neither GPT-2 (wte, wpe, h.N.*) nor MLP (fcN.*) "
                          "initializers found")
    return model, params, loader, names


def make_optimizer(cfg, params):
    opt = get(cfg, "optimizer", {}) or {}
    name = opt.get("name", "adamw")
    wd = float(opt.get("weightDecay", 0.0) or 0.0)
    if name in ("adamw", "adam"):
        return AdamW(params, float(opt.get("lr", 1e-3)), float(opt.get("beta1", 0.9)),
                     float(opt.get("beta2", 0.999)), float(opt.get("epsilon", 1e-8)), wd,
                     decoupled=(name == "adamw"))
    if name == "sgd":
        return Sgd(params, float(opt.get("momentum", 0.0) or 0.0),
                   bool(opt.get("nesterov", False)), wd)
    raise OracleError(f"optimizer.name: '{name}' is not implemented by the oracle "
                      "(adamw, adam, sgd)")


def train(cfg, base_dir, heads_override=None, log=None, model_override=None):
    model, params, loader, names = build(cfg, base_dir, heads_override, model_override)
    optimizer = make_optimizer(cfg, params)
    steps = int(get(cfg, "steps", 1))
    accum = int(get(cfg, "gradientAccumulationSteps", 1) or 1)
    base_lr = float(get(cfg, "optimizer.lr", 1e-3))
    sched = get(cfg, "lrSchedule", {}) or {}
    max_norm = float(get(cfg, "gradClipNorm", 0.0) or 0.0)
    losses, lrs, norms = [], [], []
    for step in range(steps):
        total = {n: np.zeros_like(p) for n, p in params.items()}
        step_loss = 0.0
        for _ in range(accum):
            loss, grads = model.loss_and_grads(params, loader.next_batch())
            step_loss += loss / accum
            for n, g in grads.items():
                total[n] += g / accum
        norms.append(clip_grad_norm(total, max_norm))
        lr = learning_rate(sched, base_lr, step, steps)
        optimizer.step(params, total, lr)
        losses.append(step_loss)
        lrs.append(lr)
        if log:
            log(f"step {step + 1}/{steps} loss {step_loss:.6f} lr {lr:.3e} norm {norms[-1]:.4f}")
    # Final weights under the model file's own initializer names and layouts.
    final = {names[n][0]: (p.T if names[n][1] else p) for n, p in params.items()}
    return {"model": model.kind, "losses": losses, "lrs": lrs, "gradNorms": norms}, final


# ----------------------------------------------------------------------------------------------
# Self-test: finite differences on tiny random models, and the loaders on synthetic shards


def random_gpt2(rng, vocab=13, seq=6, embed=8, n_layer=2):
    params = {}
    for n in gpt2_param_names(n_layer):
        if n == "wte":
            shape = (vocab, embed)
        elif n == "wpe":
            shape = (seq, embed)
        elif n.endswith("c_attn.weight"):
            shape = (embed, 3 * embed)
        elif n.endswith("c_attn.bias"):
            shape = (3 * embed,)
        elif n.endswith("c_fc.weight"):
            shape = (embed, 4 * embed)
        elif n.endswith("c_fc.bias"):
            shape = (4 * embed,)
        elif n.endswith("mlp.c_proj.weight"):
            shape = (4 * embed, embed)
        elif n.endswith("attn.c_proj.weight"):
            shape = (embed, embed)
        else:
            shape = (embed,)
        is_ln_gain = n.endswith(("ln_1.weight", "ln_2.weight")) or n == "ln_f.weight"
        scale, base = (1.0, 1.0) if is_ln_gain else (0.3, 0.0)
        params[n] = base + scale * rng.standard_normal(shape)
    return params


def random_mlp(rng, sizes=(7, 9, 6, 5)):
    params = {}
    for i in range(len(sizes) - 1):
        params[f"fc{i}.weight"] = 0.5 * rng.standard_normal((sizes[i], sizes[i + 1]))
        params[f"fc{i}.bias"] = 0.3 * rng.standard_normal(sizes[i + 1])
    return params


def grad_check(model, params, batch, name, h=1e-5, tol=1e-6):
    _, grads = model.loss_and_grads(params, batch)
    worst = 0.0
    for n, p in params.items():
        numeric = np.zeros_like(p)
        flat, nflat = p.reshape(-1), numeric.reshape(-1)
        for i in range(flat.size):
            old = flat[i]
            flat[i] = old + h
            lp, _ = model.loss_and_grads(params, batch, need_grads=False)
            flat[i] = old - h
            lm, _ = model.loss_and_grads(params, batch, need_grads=False)
            flat[i] = old
            nflat[i] = (lp - lm) / (2 * h)
        a = grads[n]
        rel = np.linalg.norm(a - numeric) / max(np.linalg.norm(a), np.linalg.norm(numeric), 1e-30)
        worst = max(worst, rel)
        status = "ok" if rel < tol else "FAIL"
        print(f"  {name:5s} {n:24s} {str(p.shape):12s} rel err {rel:.2e} {status}")
        if rel >= tol:
            raise AssertionError(
                f"{name}: gradient of {n} differs from finite differences: {rel:.2e}")
    return worst


def write_token_shard(path, tokens):
    header = np.zeros(256, dtype="<i4")
    header[:3] = [TOKENS_MAGIC_U16, 1, len(tokens)]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype="<u2").tobytes())


def write_sample_shard(path, samples):
    """samples: list of {input name: numpy array without batch dim}."""
    from onnx import numpy_helper

    with open(path, "wb") as f:
        for sample in samples:
            body = b""
            for name, arr in sample.items():
                blob = numpy_helper.from_array(np.asarray(arr), name=name).SerializeToString()
                body += struct.pack("<I", len(blob)) + blob
            f.write(struct.pack("<I", len(body)) + body)


def write_initializers_onnx(path, params, metadata=None):
    """A minimal ONNX model carrying `params` as float32 initializers (enough for the oracle)."""
    import onnx
    from onnx import helper, numpy_helper

    inits = [numpy_helper.from_array(np.asarray(v, dtype=np.float32), name=n)
             for n, v in params.items()]
    first = next(iter(params))
    graph = helper.make_graph(
        [helper.make_node("Identity", [first], ["out"])], "weights", [],
        [helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    for k, v in (metadata or {}).items():
        entry = model.metadata_props.add()
        entry.key, entry.value = k, str(v)
    onnx.save(model, path)


def self_test():
    import tempfile

    rng = np.random.default_rng(1234)
    print("gradients vs central finite differences (float64):")
    gp = random_gpt2(rng)
    gpt2 = Gpt2(gp, n_head=2)
    ids = rng.integers(0, 13, size=(2, 6))
    labels = rng.integers(0, 13, size=(2, 6))
    labels[0, 1] = labels[1, 4] = IGNORE_INDEX
    w1 = grad_check(gpt2, gp, {"input_ids": ids, "labels": labels}, "gpt2")
    # A shorter sequence than wpe holds: the unused wpe rows must get zero gradient.
    w2 = grad_check(gpt2, gp, {"input_ids": ids[:, :4], "labels": labels[:, :4]}, "gpt2")
    mp = random_mlp(rng)
    mlp = Mlp(mp)
    x = rng.standard_normal((4, 7))
    y = rng.integers(0, 5, size=4)
    w3 = grad_check(mlp, mp, {"x": x, "labels": y}, "mlp")
    print(f"worst relative error {max(w1, w2, w3):.2e} (limit 1e-6)")

    # A causal model: changing the last token must not change the loss of earlier positions.
    ids2 = ids.copy()
    ids2[:, -1] = (ids2[:, -1] + 1) % 13
    lab = labels.copy()
    lab[:, -1] = IGNORE_INDEX
    l1, _ = gpt2.loss_and_grads(gp, {"input_ids": ids, "labels": lab}, need_grads=False)
    l2, _ = gpt2.loss_and_grads(gp, {"input_ids": ids2, "labels": lab}, need_grads=False)
    assert abs(l1 - l2) < 1e-12, "attention is not causal"

    with tempfile.TemporaryDirectory() as tmp:
        # Token shards: windows of B*T+1, step B*T, next shard when the window does not fit.
        os.makedirs(os.path.join(tmp, "tok"))
        write_token_shard(os.path.join(tmp, "tok", "b.bin"), np.arange(100, 120))
        write_token_shard(os.path.join(tmp, "tok", "a.bin"), np.arange(0, 30))
        loader = TokenLoader(os.path.join(tmp, "tok"), 2, 3)
        starts = [int(loader.next_batch()["input_ids"][0, 0]) for _ in range(9)]
        assert starts == [0, 6, 12, 18, 100, 106, 112, 0, 6], starts
        b = TokenLoader(os.path.join(tmp, "tok"), 2, 3).next_batch()
        assert (b["labels"] == b["input_ids"] + 1).all()

        # Sample shards: order across sorted files, wrap with the short tail dropped.
        os.makedirs(os.path.join(tmp, "pb"))
        mk = lambda i: {"x": np.full(3, i, np.float32), "labels": np.array(i % 2, np.int64)}  # noqa: E731
        write_sample_shard(os.path.join(tmp, "pb", "1.pb"), [mk(i) for i in range(4)])
        write_sample_shard(os.path.join(tmp, "pb", "2.pb"), [mk(i) for i in range(4, 7)])
        sl = SampleLoader(os.path.join(tmp, "pb"), 3)
        firsts = [int(sl.next_batch()["x"][0, 0]) for _ in range(3)]
        assert firsts == [0, 3, 0], firsts
        assert SampleLoader(os.path.join(tmp, "pb"), 3).next_batch()["labels"].shape == (3,)

        # The whole path: ONNX file, config, loader, optimizer; the loss must fall.
        vocab, seq = 13, 6
        tokens = rng.integers(0, vocab, size=64)
        tokens[1::2] = (tokens[0::2] + 1) % vocab  # learnable: odd tokens follow even ones
        write_token_shard(os.path.join(tmp, "tok", "a.bin"), tokens)
        os.remove(os.path.join(tmp, "tok", "b.bin"))
        write_initializers_onnx(os.path.join(tmp, "init.onnx"), random_gpt2(rng, vocab, seq),
                                {"heads": 2})
        cfg = {"model": {"onnx": {"path": "init.onnx"}},
               "data": {"train": {"path": "tok", "format": "tokens"}, "shuffle": False},
               "batchSize": 2, "gradientAccumulationSteps": 2, "steps": 30,
               "optimizer": {"name": "adamw", "lr": 1e-2, "beta1": 0.9, "beta2": 0.95,
                             "epsilon": 1e-8, "weightDecay": 0.1},
               "lrSchedule": {"name": "cosine", "warmupSteps": 3, "minLr": 1e-3},
               "gradClipNorm": 1.0}
        result, _ = train(cfg, tmp)
        assert result["losses"][-1] < 0.8 * result["losses"][0], result["losses"]
        print(f"end-to-end gpt2: loss {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}")

    # The GPT-2 exported by PyTorch (worker/tests/data/torch_gpt2): names, heads, torch's loss.
    here = os.path.dirname(os.path.abspath(__file__))
    export_dir = os.path.join(here, "..", "data", "torch_gpt2")
    if os.path.isfile(os.path.join(export_dir, "expected.json")):
        with open(os.path.join(export_dir, "expected.json")) as f:
            expected = json.load(f)
        onnx_model, raw = load_onnx(os.path.join(export_dir, "gpt2_tiny_with_loss.onnx"))
        tp, _ = select_gpt2_params(raw, "gpt2_tiny_with_loss.onnx")
        heads = detect_heads(onnx_model, tp["wte"].shape[1])
        assert heads == 2, heads
        loss, _ = Gpt2(tp, heads).loss_and_grads(
            tp, {"input_ids": np.array(expected["input_ids"]),
                 "labels": np.array(expected["labels"])}, need_grads=False)
        assert abs(loss / expected["loss"] - 1) < 1e-6, (loss, expected["loss"])
        print(f"torch-exported gpt2_tiny: heads {heads}, "
              f"loss {loss:.7f} = torch's {expected['loss']:.7f}")

    # Schedules.
    s = {"name": "cosine", "warmupSteps": 2, "minLr": 0.1}
    got = [learning_rate(s, 1.0, i, 6) for i in range(6)]
    want = [0.5, 1.0, 1.0, 0.1 + 0.45 * (1 + math.cos(math.pi / 4)), 0.55,
            0.1 + 0.45 * (1 + math.cos(3 * math.pi / 4))]
    assert np.allclose(got, want), got
    print("self-test passed")


# ----------------------------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", help="worker training config (YAML or JSON)")
    ap.add_argument("--base-dir", help="directory relative paths in the config start from "
                                       "(default: the config file's directory)")
    ap.add_argument("--output", help="JSON file for losses and final weights")
    ap.add_argument("--weights", choices=("both", "json", "npz", "none"), default="both",
                    help="where final weights go: the JSON, an .npz beside it, both, or nowhere")
    ap.add_argument("--model", help="ONNX file with the initial weights, instead of "
                                    "model.onnx.path (relative to the current directory)")
    ap.add_argument("--heads", type=int, help="GPT-2 attention heads, when the model does not say")
    ap.add_argument("--steps", type=int, help="override the config's steps")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--self-test", action="store_true", help="gradient checks and loader tests")
    args = ap.parse_args(argv)

    if args.self_test:
        self_test()
        return 0
    if not args.config or not args.output:
        ap.error("--config and --output are required (or --self-test)")
    try:
        cfg = load_config(args.config)
        if args.steps is not None:
            cfg["steps"] = args.steps
        base = args.base_dir or os.path.dirname(os.path.abspath(args.config))
        log = None if args.quiet else (lambda m: print(m, file=sys.stderr))
        result, params = train(cfg, base, args.heads, log, args.model)
    except OracleError as e:
        print(f"reference_train: error: {e}", file=sys.stderr)
        return 2
    if args.weights in ("both", "json"):
        result["weights"] = {n: p.tolist() for n, p in params.items()}
    if args.weights in ("both", "npz"):
        stem = args.output[:-5] if args.output.endswith(".json") else args.output
        np.savez(stem + ".npz", **params)
        result["weightsNpz"] = os.path.basename(stem + ".npz")
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
