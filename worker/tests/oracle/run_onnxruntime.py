#!/usr/bin/env python3
"""Checks an exported model with the ONNX checker and runs it in ONNX Runtime.

    python run_onnxruntime.py --model model.onnx --inputs inputs.json --output outputs.json

inputs.json: {name: {"dtype": "int64"|"float32", "shape": [...], "data": [flat values]}}.
outputs.json: {name: {"shape": [...], "data": [flat values]}} for every graph output.
Exits non-zero (with the checker's or ORT's message) when the model is invalid or fails to run.
"""
import argparse
import json

import numpy as np
import onnx
import onnxruntime as ort


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--output", required=True)
    a = ap.parse_args()
    onnx.checker.check_model(onnx.load(a.model), full_check=True)
    with open(a.inputs) as f:
        spec = json.load(f)
    feeds = {k: np.array(v["data"], dtype=v["dtype"]).reshape(v["shape"]) for k, v in spec.items()}
    sess = ort.InferenceSession(a.model, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    results = sess.run(names, feeds)
    out = {n: {"shape": list(r.shape), "data": r.astype(np.float64).ravel().tolist()} for n, r in zip(names, results)}
    with open(a.output, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
