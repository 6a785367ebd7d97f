#!/usr/bin/env python3
"""Export a tiny nanoGPT-style GPT-2 from PyTorch to ONNX, as test data for the engine.

    python export.py [--out-dir DIR]      # default: this script's directory

Writes
  gpt2_tiny.onnx            input_ids int64 [batch, 16] -> logits float32 [batch, 16, 96]
  gpt2_tiny_with_loss.onnx  input_ids, labels int64 [batch, 16] -> logits, loss (F.cross_entropy,
                            ignore_index -100, mean; exported as SoftmaxCrossEntropyLoss)
  expected.json             for one batch: input_ids, labels [2, 16] (two labels are -100), torch's
                            logits [2, 16, 96] and loss for it (float32, eval forward), and
                            `sgd.losses`: the losses of 5 plain SGD steps (lr 0.1, no momentum, no
                            weight decay, no clipping) on that same batch, starting from the
                            exported weights - the loss before each update
and prints the op types of each graph.

The model: 2 layers, 2 heads, embed 32, seq 16, vocab 96; nn.Embedding, nn.LayerNorm, nn.Linear,
tanh GELU, a causal mask from a (non-persistent, so exported as a Constant) tril buffer with
masked_fill, the LM head tied to the token
embedding. Seeded, deterministic on the CPU. Exported with the TorchScript exporter
(dynamo=False, opset 17). Constant folding is off, so the initializers keep their torch names
(`transformer.h.0.attn.c_attn.weight`, ...), nn.Linear weights stay [out, in] behind a Transpose
(or a Gemm transB), and the tied embedding stays one initializer used twice - which a trainer
must keep as one parameter.

Needs: torch, numpy, onnx (python3 -m venv V && V/bin/pip install torch numpy onnx).
"""

import argparse
import copy
import json
import math
import os
from collections import Counter

import onnx
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ, EMBED, HEADS, LAYERS = 96, 16, 32, 2, 2
SEED = 1337
SGD_LR, SGD_STEPS = 0.1, 5


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(EMBED, 3 * EMBED)
        self.c_proj = nn.Linear(EMBED, EMBED)
        self.register_buffer("bias", torch.tril(torch.ones(SEQ, SEQ)).view(1, 1, SEQ, SEQ),
                             persistent=False)

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(EMBED, dim=2)
        q = q.view(b, t, HEADS, c // HEADS).transpose(1, 2)  # [B,H,T,hd]
        k = k.view(b, t, HEADS, c // HEADS).transpose(1, 2)
        v = v.view(b, t, HEADS, c // HEADS).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(EMBED // HEADS))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.c_proj(y)


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(EMBED, 4 * EMBED)
        self.c_proj = nn.Linear(4 * EMBED, EMBED)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(EMBED)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(EMBED)
        self.mlp = Mlp()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Gpt(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, EMBED),
            wpe=nn.Embedding(SEQ, EMBED),
            h=nn.ModuleList([Block() for _ in range(LAYERS)]),
            ln_f=nn.LayerNorm(EMBED),
        ))
        self.lm_head = nn.Linear(EMBED, VOCAB, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * LAYERS))

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.normal_(m.bias, mean=0.0, std=0.01)  # nonzero, so tests see biases used
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        elif isinstance(m, nn.LayerNorm):
            nn.init.normal_(m.weight, mean=1.0, std=0.05)
            nn.init.normal_(m.bias, mean=0.0, std=0.02)

    def forward(self, idx, labels=None):
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))  # [B,T,V]
        if labels is None:
            return logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1),
                               ignore_index=-100)
        return logits, loss


def op_types(path):
    model = onnx.load(path)
    return Counter(n.op_type for n in model.graph.node)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default=os.path.dirname(os.path.abspath(__file__)))
    args = ap.parse_args()
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    gpt = Gpt().eval()

    gen = torch.Generator().manual_seed(SEED + 1)
    input_ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    labels[0, 3] = labels[1, 15] = -100

    plain = os.path.join(args.out_dir, "gpt2_tiny.onnx")
    lossy = os.path.join(args.out_dir, "gpt2_tiny_with_loss.onnx")
    common = dict(dynamo=False, opset_version=17, do_constant_folding=False, export_params=True)
    with torch.no_grad():
        torch.onnx.export(gpt, (input_ids,), plain, input_names=["input_ids"],
                          output_names=["logits"],
                          dynamic_axes={"input_ids": {0: "batch"}, "logits": {0: "batch"}},
                          **common)
        torch.onnx.export(gpt, (input_ids, labels), lossy,
                          input_names=["input_ids", "labels"], output_names=["logits", "loss"],
                          dynamic_axes={"input_ids": {0: "batch"}, "labels": {0: "batch"},
                                        "logits": {0: "batch"}},
                          **common)
        logits, loss = gpt(input_ids, labels)
    for path in (plain, lossy):
        onnx.checker.check_model(onnx.load(path), full_check=True)

    # Training the exported graph must reproduce these: the tied embedding is one parameter.
    trained = copy.deepcopy(gpt).train()
    sgd = torch.optim.SGD(trained.parameters(), lr=SGD_LR)
    sgd_losses = []
    for _ in range(SGD_STEPS):
        _, step_loss = trained(input_ids, labels)
        sgd_losses.append(step_loss.item())
        sgd.zero_grad()
        step_loss.backward()
        sgd.step()

    expected = {
        "about": "torch forward of gpt2_tiny*.onnx on one batch; see export.py",
        "torch": torch.__version__,
        "input_ids": input_ids.tolist(),
        "labels": labels.tolist(),
        "logits_shape": list(logits.shape),
        "logits": [float(v) for v in logits.reshape(-1).tolist()],  # row-major, float32 values
        "loss": float(loss.item()),
        "sgd": {"lr": SGD_LR, "steps": SGD_STEPS, "momentum": 0.0, "weightDecay": 0.0,
                "losses": sgd_losses},
    }
    with open(os.path.join(args.out_dir, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")
    print(f"torch {torch.__version__}, onnx {onnx.__version__}; loss {loss.item():.6f}")
    for path in (plain, lossy):
        ops = op_types(path)
        inits = onnx.load(path).graph.initializer
        listed = ", ".join(f"{k}x{v}" for k, v in sorted(ops.items()))
        print(f"{os.path.basename(path)}: {os.path.getsize(path)} bytes, "
              f"{len(inits)} initializers, op types: {listed}")


if __name__ == "__main__":
    main()
