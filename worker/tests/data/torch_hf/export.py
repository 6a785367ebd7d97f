#!/usr/bin/env python3
"""Export tiny Hugging Face transformers and PyTorch recurrent classifiers with both PyTorch
exporters, as test data for the engine (tests/torch_hf.rs), with PyTorch's own training of the
same modules as the reference.

    python export.py [--out-dir DIR]      # default: this script's directory

Writes, per model and exporter, <model>_<exporter>.onnx (or the exporter's error in
expected.json), per model <model>.pb (2 batches in onnxSamples format, each sample's tensors
named as the graph's inputs, plus `labels`; step k trains on batch k mod 2), and expected.json:
per model and optimizer (20 steps of SGD, 20 of AdamW; hyperparameters in the file), in float32
and float64, the loss of each step (before its update) and the first step's global gradient
norm; what each export holds (op counts, initializers) and the options it was made with.

The models (transformers 5.24, random init from tiny configs, seeded; dropout 0 everywhere,
since random masks cannot be reproduced across frameworks):
- gpt2:  GPT2LMHeadModel (tied LM head), input_ids + attention_mask -> logits [B, S, V].
- bert:  BertForMaskedLM (tied decoder), input_ids + attention_mask -> logits [B, S, V].
- llama: LlamaForCausalLM (RMSNorm, RoPE, SwiGLU, grouped-query attention: 4 heads, 2 kv-heads,
         untied head), input_ids + attention_mask -> logits [B, S, V].
- vit:   ViTForImageClassification, pixel_values [B, 3, 16, 16] -> logits [B, 10].
- t5:    T5ForConditionalGeneration (tied head, relative position buckets), input_ids +
         attention_mask + decoder_input_ids -> logits [B, S, V]. Eager attention: the dynamo
         exporter fails on T5's default sdpa attention (expected.json records the error).
- lstm, gru: an nn.Embedding, a 2-layer bidirectional nn.LSTM / nn.GRU (batch_first) and a
         linear head on the last step's features, input_ids -> logits [B, 10].
Batch 1 pads the language models' last two positions (attention_mask 0, label -100, which
the loss ignores, as F.cross_entropy's default ignore_index does); bert's labels are -100 except
at a third of the positions (masked-LM style).

The exporters (what matters for training; docs/MODELS.md says the same to users):
- TorchScript (dynamo=False, opset 17, training=TrainingMode.TRAINING,
  do_constant_folding=False). With constant folding on (the default) it folds each Linear's
  weight transpose into a new initializer named `onnx::MatMul_<n>` and unties a tied LM head
  from its embedding: the graph trains, but not as the module does, and the names are lost.
  GPT-2 and Llama fail to export unless attention_mask is an input (transformers' mask code
  calls torch.diff, which has no ONNX symbolic), so the language models take it.
- dynamo (dynamo=True, opset 20 by default, optimize=False, external_data=False). Its default
  ONNX optimizer constant-folds the module: it precomputes T5's relative position bias from
  relative_attention_bias into a [1, H, S, S] initializer (which would then train per position,
  not per bucket), gathers the position embeddings for the exported positions into a new
  initializer and transposes tied weights into separate copies. optimize=False keeps the
  module's parameters as they are; the per-node metadata (stack traces) is dropped afterwards
  to keep the committed files small. Buffers such as Llama's rotary `inv_freq` stay
  initializers, annotated `InputSpec.kind = BUFFER`, which the engine reads: they do not train.

Reference training: F.cross_entropy on the logits (the engine attaches softmaxCrossEntropy
with ignoreIndex -100), weight decay on weights of rank 2 or more only (the engine's default).

Needs: torch 2.15, transformers 5.24, onnx, onnxscript (`make test-data` installs them into
.venv-bench/ and runs this script).
"""

import argparse
import copy
import os
import sys
import warnings
from collections import Counter

import numpy as np
import onnx
import onnx.numpy_helper
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                          LlamaForCausalLM, T5Config, T5ForConditionalGeneration, ViTConfig,
                          ViTForImageClassification)

# worker/tests/data/torch_oracle.py: what the export scripts share.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch_oracle  # noqa: E402

SEED = 24
BATCH, BATCHES, SEQ, VOCAB, CLASSES, IMAGE = 4, 2, 8, 64, 10, 16
STEPS = 20
SGD = {"lr": 0.05, "momentum": 0.9, "weightDecay": 5e-4}
ADAMW = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "weightDecay": 0.01}
IGNORE = -100


class Logits(nn.Module):
    """A transformers model called with named inputs, returning only the logits."""

    def __init__(self, model, names, **fixed):
        super().__init__()
        self.model, self.names, self.fixed = model, names, fixed

    def forward(self, *args):
        return self.model(**dict(zip(self.names, args)), **self.fixed, return_dict=False)[0]


class Recurrent(nn.Module):
    """Embedding -> 2-layer bidirectional LSTM or GRU -> linear head on the last step."""

    def __init__(self, cell):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.rnn = cell(8, 12, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(24, CLASSES)

    def forward(self, input_ids):
        out, _ = self.rnn(self.embed(input_ids))
        return self.head(out[:, -1])


def build_models():
    """name -> (module, graph input names, whether its labels are per position)."""
    torch.manual_seed(SEED)
    lm = ["input_ids", "attention_mask"]
    tiny = dict(vocab_size=VOCAB)
    return {
        "gpt2": (Logits(GPT2LMHeadModel(GPT2Config(**tiny, bos_token_id=0, eos_token_id=0, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                                   resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)), lm,
                        use_cache=False), lm, True),
        "bert": (Logits(BertForMaskedLM(BertConfig(**tiny, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                                   intermediate_size=32, max_position_embeddings=16,
                                                   hidden_dropout_prob=0, attention_probs_dropout_prob=0)), lm),
                 lm, True),
        "llama": (Logits(LlamaForCausalLM(LlamaConfig(**tiny, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                                      num_attention_heads=4, num_key_value_heads=2,
                                                      max_position_embeddings=16)), lm, use_cache=False), lm, True),
        "vit": (Logits(ViTForImageClassification(ViTConfig(image_size=IMAGE, patch_size=4, hidden_size=16,
                                                           num_hidden_layers=2, num_attention_heads=2,
                                                           intermediate_size=32, num_labels=CLASSES,
                                                           hidden_dropout_prob=0, attention_probs_dropout_prob=0)),
                       ["pixel_values"]), ["pixel_values"], False),
        "t5": (Logits(T5ForConditionalGeneration(T5Config(**tiny, d_model=16, d_kv=8, d_ff=32, num_layers=2,
                                                          num_heads=2, dropout_rate=0, decoder_start_token_id=0,
                                                          attn_implementation="eager")),

                      lm + ["decoder_input_ids"], use_cache=False), lm + ["decoder_input_ids"], True),
        "lstm": (Recurrent(nn.LSTM), ["input_ids"], False),
        "gru": (Recurrent(nn.GRU), ["input_ids"], False),
    }


def make_batches(name, inputs, per_position, gen):
    """Per batch: the inputs by name and the labels."""
    batches = []
    for b in range(BATCHES):
        feeds = {}
        for n in inputs:
            if n == "pixel_values":
                feeds[n] = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=gen)
            elif n == "attention_mask":
                feeds[n] = torch.ones(BATCH, SEQ, dtype=torch.int64)
                if b == 1:
                    feeds[n][:, -2:] = 0
            else:
                feeds[n] = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        if per_position:
            labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
            if "attention_mask" in feeds:
                labels[feeds["attention_mask"] == 0] = IGNORE
            if name == "bert":
                labels[torch.rand(BATCH, SEQ, generator=gen) > 1 / 3] = IGNORE
                labels[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=gen)  # no row without a label
        else:
            labels = torch.randint(0, CLASSES, (BATCH,), generator=gen)
        batches.append((feeds, labels))
    return batches


def export(model, feeds, path, exporter):
    """Exports a copy of `model` in train mode; returns the options used, as text."""
    m = copy.deepcopy(model).train()
    args = tuple(feeds.values())
    names = dict(input_names=list(feeds), output_names=["logits"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "torchscript":
            opts = dict(dynamo=False, opset_version=17, training=torch.onnx.TrainingMode.TRAINING,
                        do_constant_folding=False)
        else:
            opts = dict(dynamo=True, optimize=False, external_data=False)
        torch.onnx.export(m, args, path, **names, **opts)
    if exporter == "dynamo":
        proto = onnx.load(path)
        for n in proto.graph.node:
            del n.metadata_props[:]
        onnx.save(proto, path)
    return ", ".join(f"{k}={v}" for k, v in opts.items())


def describe(path, model):
    """Op counts, and which float initializers are the module's parameters (a tied parameter
    under any of its names) and which its buffers, each checked to hold the module's value."""
    proto = onnx.load(path)
    g = proto.graph
    params = {k: v.detach().numpy() for k, v in model.named_parameters(remove_duplicate=False)}
    buffers = {k: v.detach().numpy() for k, v in model.named_buffers(remove_duplicate=False)}
    kinds = {"parameterInitializers": [], "bufferInitializers": [], "otherFloatInitializers": []}
    for i in g.initializer:
        if i.data_type != onnx.TensorProto.FLOAT:
            continue
        state = params if i.name in params else buffers if i.name in buffers else None
        if state is not None:
            np.testing.assert_array_equal(onnx.numpy_helper.to_array(i), state[i.name], err_msg=i.name)
        kind = "parameter" if state is params else "buffer" if state is buffers else "otherFloat"
        kinds[f"{kind}Initializers"].append(i.name)
    return {
        "ops": dict(sorted(Counter(n.op_type for n in g.node).items())),
        "opset": next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")),
        **{k: sorted(v) for k, v in kinds.items()},
        "paddingIdx": padding_idx(model, kinds["parameterInitializers"]),
    }


def padding_idx(model, initializers):
    """The padding rows of the module's nn.Embedding layers, by the name their weight has in
    the export (what a user puts in model.onnx.paddingIdx: ONNX exports lose padding_idx). A
    tied weight is written under one of its names, not always the embedding's."""
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    rows = {}
    for m in model.modules():
        if isinstance(m, nn.Embedding) and m.padding_idx is not None:
            (name,) = [n for n in names[id(m.weight)] if n in initializers]
            rows[name] = m.padding_idx
    return rows


def train(model, kind, dtype, batches):
    """PyTorch's training: per step the loss before the update; the first step's gradient norm."""
    m = copy.deepcopy(model).to(dtype).train()
    opt = torch_oracle.optimizer(kind, m, SGD, ADAMW)
    losses, grad_norm = [], None
    for step in range(STEPS):
        feeds, labels = batches[step % BATCHES]
        args = [t.to(dtype) if t.is_floating_point() else t for t in feeds.values()]
        logits = m(*args)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        if step == 0:
            grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in m.parameters() if p.grad is not None))
        opt.step()
    return {"losses": losses, "gradNorm": grad_norm.item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default=os.path.dirname(os.path.abspath(__file__)))
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    gen = torch.Generator().manual_seed(SEED + 1)
    out = {
        "about": "PyTorch's training of the modules exported here; see export.py",
        "torch": torch.__version__, "transformers": transformers.__version__, "onnx": onnx.__version__,
        "batch": BATCH, "batches": BATCHES, "steps": STEPS, "ignoreIndex": IGNORE,
        "sgd": SGD, "adamw": ADAMW, "weightDecayOn": "weights of rank 2 or more",
        "models": {},
    }
    for name, (model, inputs, per_position) in build_models().items():
        batches = make_batches(name, inputs, per_position, gen)
        data = f"{name}.pb"
        torch_oracle.write_samples(os.path.join(args.out_dir, data), (
            [*((n, v[i].numpy()) for n, v in feeds.items()), ("labels", labels[i].numpy())]
            for feeds, labels in batches for i in range(BATCH)))
        entry = {"data": data, "inputs": inputs, "parameters": sum(p.numel() for p in model.parameters()),
                 "exports": {}}
        for exporter in ("torchscript", "dynamo"):
            path = os.path.join(args.out_dir, f"{name}_{exporter}.onnx")
            try:
                used = export(model, batches[0][0], path, exporter)
                onnx.checker.check_model(onnx.load(path), full_check=True)
                entry["exports"][exporter] = {"file": os.path.basename(path), "options": used,
                                              **describe(path, model)}
            except Exception as e:  # recorded, so that the test can say why the case is absent
                if os.path.exists(path):
                    os.remove(path)
                entry["exports"][exporter] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        for kind in ("sgd", "adamw"):
            entry[kind] = {"float32": train(model, kind, torch.float32, batches),
                           "float64": train(model, kind, torch.float64, batches)}
        out["models"][name] = entry

    torch_oracle.write_expected(os.path.join(args.out_dir, "expected.json"), out)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, onnx {onnx.__version__}")
    for name, entry in out["models"].items():
        for exporter, e in entry["exports"].items():
            size = os.path.getsize(os.path.join(args.out_dir, e["file"])) if "file" in e else 0
            print(f"{name} {exporter}: {e.get('error') or f'{size} bytes'}")
        for kind in ("sgd", "adamw"):
            r = entry[kind]
            worst = max(abs(a - b) / abs(b) for a, b in zip(r["float32"]["losses"], r["float64"]["losses"]))
            print(f"{name} {kind}: losses {r['float32']['losses'][0]:.4f} -> {r['float32']['losses'][-1]:.4f}; "
                  f"fp32 vs fp64 {worst:.1e}")


if __name__ == "__main__":
    main()
