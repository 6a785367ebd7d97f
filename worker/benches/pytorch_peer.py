#!/usr/bin/env python3
"""PyTorch (CPU) peer for `make bench`: the time of one full training step.

    python worker/benches/pytorch_peer.py [--steps 10] [--warmup 3] [--only gpt2|squeezenet]

A step is forward, loss, backward, AdamW step and zero_grad, on random data, timed with
time.perf_counter; the figure is the median over --steps after --warmup untimed steps, with
torch.set_num_threads(os.cpu_count()). Prints one JSON object:

    {"gpt2_step_ms": ..., "squeezenet_step_ms": ..., "torch_version": ..., "threads": ..., ...}

Models (the configs the engine's criterion benches use):
  gpt2        2 layers, embed 128, 4 heads, seq 128, batch 8, vocab 50257, tied LM head, tanh GELU,
              causal F.scaled_dot_product_attention (what a PyTorch user would run), fp32.
  squeezenet  SqueezeNet 1.1 written here (no torchvision), 10 classes, 64x64 RGB, batch 8,
              dropout 0.5 before the classifier as in the paper's model, fp32.
Optimizer: torch.optim.AdamW(lr 1e-4, betas (0.9, 0.95), weight_decay 0.1) over all parameters.

The venv (torch from PyPI; the default Linux wheel also pulls the CUDA runtime packages), which
`make bench` creates through .ci/bench-deps.sh:

    python3 -m venv .venv-bench
    .venv-bench/bin/pip install -r worker/benches/requirements-bench.txt

Measured on the 2-core build machine (torch 2.15.0+cu132 from PyPI, Python 3.11): about 3.0 GB
downloaded (torch 0.54 GB + the nvidia-* CUDA 13 runtime wheels), 5.5 GB installed, 1.5 minutes.
`pip install --no-deps torch` is not a way out: that wheel's `import torch` fails without the
nvidia-* packages (libcudart.so.13). Where download.pytorch.org is reachable, the CPU-only wheel
is far smaller: `pip install torch==2.15.0 --index-url https://download.pytorch.org/whl/cpu`
(not reachable from the build machine, so not measured there).

Run it on an idle machine. torch's OpenMP threads spin while they wait: with another process
busy on one of the two cores, a SqueezeNet step measured 3.4 s instead of 0.05-0.08 s here, and
`OMP_WAIT_POLICY=PASSIVE` brought it back to 0.08 s. The JSON carries the 1-minute load average
before and after, so a reader can see whether the figures were taken on a busy machine.
So the train_step bench (benches/train_step.rs, which runs this script with
$TENSORFLEET_BENCH_PYTHON) runs it twice, with OMP_WAIT_POLICY unset and =PASSIVE, unless the
caller set it, and compares each configuration with the faster run: PyTorch at its best.
"""

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------
# GPT-2


class Block(nn.Module):
    def __init__(self, embed, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(embed)
        self.c_attn = nn.Linear(embed, 3 * embed)
        self.attn_proj = nn.Linear(embed, embed)
        self.ln_2 = nn.LayerNorm(embed)
        self.c_fc = nn.Linear(embed, 4 * embed)
        self.mlp_proj = nn.Linear(4 * embed, embed)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class Gpt2(nn.Module):
    def __init__(self, layers, embed, heads, seq, vocab):
        super().__init__()
        self.wte = nn.Embedding(vocab, embed)
        self.wpe = nn.Embedding(seq, embed)
        self.blocks = nn.ModuleList([Block(embed, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(embed)
        for p in self.parameters():
            if p.ndim >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, labels):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.T  # tied
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


# ----------------------------------------------------------------------------------------------
# Llama (Hugging Face's LlamaForCausalLM, as the worker's builtin `model.llama` computes it):
# RMSNorm, rotary embeddings, grouped-query attention, SwiGLU, an untied LM head, no biases.


class RmsNorm(nn.Module):
    def __init__(self, width, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        # In float32, as Hugging Face's LlamaRMSNorm, then back to the input's type.
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaBlock(nn.Module):
    def __init__(self, embed, heads, kv_heads, ffn, eps):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, embed // heads
        kv = kv_heads * self.head_dim
        self.input_layernorm = RmsNorm(embed, eps)
        self.q_proj = nn.Linear(embed, embed, bias=False)
        self.k_proj = nn.Linear(embed, kv, bias=False)
        self.v_proj = nn.Linear(embed, kv, bias=False)
        self.o_proj = nn.Linear(embed, embed, bias=False)
        self.post_attention_layernorm = RmsNorm(embed, eps)
        self.gate_proj = nn.Linear(embed, ffn, bias=False)
        self.up_proj = nn.Linear(embed, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, embed, bias=False)

    def forward(self, x, cos, sin):
        b, t, c = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        x = x + self.o_proj(y.transpose(1, 2).reshape(b, t, c))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    def __init__(self, layers, embed, heads, kv_heads, ffn, seq, vocab, rope_theta=10000.0, eps=1e-6):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, embed)
        self.layers = nn.ModuleList([LlamaBlock(embed, heads, kv_heads, ffn, eps) for _ in range(layers)])
        self.norm = RmsNorm(embed, eps)
        self.lm_head = nn.Linear(embed, vocab, bias=False)
        for p in self.parameters():
            if p.ndim >= 2:
                nn.init.normal_(p, std=0.02)  # Hugging Face's initializer_range
        d = embed // heads
        inv_freq = rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, idx, labels):
        t = idx.shape[1]
        x = self.embed_tokens(idx)
        cos, sin = self.cos[:t].to(x.dtype), self.sin[:t].to(x.dtype)
        for block in self.layers:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), labels.view(-1))


# ----------------------------------------------------------------------------------------------
# ResNet-50 (He et al. 2015, with torchvision's "v1.5" stride on the 3x3 convolution of each
# bottleneck), written here so that no torchvision is needed: the same layers, names and init.


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin, width, stride):
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.downsample is None else self.downsample(x)))


class ResNet50(nn.Module):
    def __init__(self, classes=1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        cin, stages = 64, []
        for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            stage = []
            for i in range(blocks):
                stage.append(Bottleneck(cin, width, stride if i == 0 else 1))
                cin = width * Bottleneck.expansion
            stages.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(cin, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def logits(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, stride=2, padding=1)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))

    def forward(self, x, labels):
        return F.cross_entropy(self.logits(x).float(), labels)


# ----------------------------------------------------------------------------------------------
# SqueezeNet 1.1 (Iandola et al. 2016; the 1.1 variant: 3x3/64 stem, pools after fire 2 and 4)


class Fire(nn.Module):
    def __init__(self, cin, squeeze, expand1, expand3):
        super().__init__()
        self.squeeze = nn.Conv2d(cin, squeeze, 1)
        self.expand1 = nn.Conv2d(squeeze, expand1, 1)
        self.expand3 = nn.Conv2d(squeeze, expand3, 3, padding=1)

    def forward(self, x):
        s = F.relu(self.squeeze(x))
        return torch.cat([F.relu(self.expand1(s)), F.relu(self.expand3(s))], dim=1)


class SqueezeNet11(nn.Module):
    def __init__(self, classes):
        super().__init__()
        pool = lambda: nn.MaxPool2d(3, stride=2, ceil_mode=True)  # noqa: E731
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, 3, stride=2), nn.ReLU(), pool(),
            Fire(64, 16, 64, 64), Fire(128, 16, 64, 64), pool(),
            Fire(128, 32, 128, 128), Fire(256, 32, 128, 128), pool(),
            Fire(256, 48, 192, 192), Fire(384, 48, 192, 192),
            Fire(384, 64, 256, 256), Fire(512, 64, 256, 256),
        )
        self.classifier = nn.Sequential(
            nn.Dropout(0.5), nn.Conv2d(512, classes, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))

    def forward(self, x, labels):
        logits = torch.flatten(self.classifier(self.features(x)), 1)
        return F.cross_entropy(logits, labels)


# ----------------------------------------------------------------------------------------------


def time_steps(model, inputs, steps, warmup):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        loss = model(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        elapsed = (time.perf_counter() - t0) * 1e3
        if not math.isfinite(loss.item()):
            raise RuntimeError("loss is not finite")
        if i >= warmup:
            times.append(elapsed)
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--only", choices=("gpt2", "squeezenet"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    result = {"torch_version": torch.__version__, "threads": torch.get_num_threads(),
              "load_avg_1m_before": round(os.getloadavg()[0], 2),
              "python": platform.python_version(), "machine": platform.machine(),
              "steps": args.steps, "warmup": args.warmup}

    if args.only in (None, "gpt2"):
        layers, embed, heads, seq, batch, vocab = 2, 128, 4, 128, 8, 50257
        model = Gpt2(layers, embed, heads, seq, vocab)
        idx = torch.randint(0, vocab, (batch, seq))
        labels = torch.randint(0, vocab, (batch, seq))
        times = time_steps(model, (idx, labels), args.steps, args.warmup)
        ms = statistics.median(times)
        result.update({
            "gpt2_step_ms": round(ms, 3), "gpt2_step_ms_min": round(min(times), 3),
            "gpt2_tokens_per_s": round(batch * seq / (ms / 1e3), 1),
            "gpt2_config": dict(layers=layers, embed=embed, heads=heads, seq=seq, batch=batch,
                                vocab=vocab, params=sum(p.numel() for p in model.parameters())),
        })
        del model

    if args.only in (None, "squeezenet"):
        classes, size, batch = 10, 64, 8
        model = SqueezeNet11(classes)
        x = torch.randn(batch, 3, size, size)
        labels = torch.randint(0, classes, (batch,))
        times = time_steps(model, (x, labels), args.steps, args.warmup)
        ms = statistics.median(times)
        result.update({
            "squeezenet_step_ms": round(ms, 3), "squeezenet_step_ms_min": round(min(times), 3),
            "squeezenet_images_per_s": round(batch / (ms / 1e3), 1),
            "squeezenet_config": dict(classes=classes, image=size, batch=batch,
                                      params=sum(p.numel() for p in model.parameters())),
        })

    result["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
    json.dump(result, sys.stdout)
    print()


if __name__ == "__main__":
    main()
