"""What the export.py scripts under worker/tests/data/ share: the onnxSamples writer, the
optimizers the engine's defaults mirror, and expected.json's compact layout. Each script puts
this directory on sys.path to import it (as tests/torch_oracle/ serves the Rust tests)."""

import json
import re

import onnx
import onnx.numpy_helper
import torch


def write_samples(path, samples):
    """onnxSamples: per sample a u32 byte count, then per tensor a u32 length and a TensorProto.
    `samples` yields one list of (name, numpy array) per sample."""
    with open(path, "wb") as f:
        for tensors in samples:
            body = b""
            for name, value in tensors:
                enc = onnx.numpy_helper.from_array(value, name).SerializeToString()
                body += len(enc).to_bytes(4, "little") + enc
            f.write(len(body).to_bytes(4, "little") + body)


def optimizer(kind, model, sgd, adamw):
    """SGD with momentum or AdamW, weight decay on weights of rank 2 or more only (the engine's
    default), with the hyperparameters expected.json records."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    if kind == "sgd":
        return torch.optim.SGD([{"params": decay, "weight_decay": sgd["weightDecay"]},
                                {"params": rest, "weight_decay": 0.0}], lr=sgd["lr"], momentum=sgd["momentum"])
    return torch.optim.AdamW([{"params": decay, "weight_decay": adamw["weightDecay"]},
                              {"params": rest, "weight_decay": 0.0}],
                             lr=adamw["lr"], betas=(adamw["beta1"], adamw["beta2"]), eps=adamw["epsilon"])


def write_expected(path, out):
    """`out` as indented JSON with every list of numbers on one line: readable and small."""
    text = json.dumps(out, indent=1)
    text = re.sub(r"\[\s+(-?[0-9][^\[\]{}]*?)\s+\]", lambda m: "[" + re.sub(r"\s+", " ", m.group(1)) + "]", text)
    with open(path, "w") as f:
        f.write(text + "\n")
