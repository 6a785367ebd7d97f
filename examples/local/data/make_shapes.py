#!/usr/bin/env python3
"""Writes "shapes", the image-classification set of the SqueezeNet and imported-ONNX demos, as
ONNX Runtime-style sample shards (*.pb). There is no download: every image is drawn here, so
the demos run offline and the set is the same on every machine (seeded).

    .venv/bin/python make_shapes.py --output shapes [--size 32] [--train 2048] [--val 256]

Eight classes, one drawing each, on a random background colour, in a random foreground colour,
at a random place and size, with pixel noise:

    0 disk   1 ring   2 square   3 triangle   4 cross
    5 horizontal stripes   6 vertical stripes   7 checkerboard

Colours carry no information about the class, so a model has to learn form (edges, curvature,
orientation, periodicity) rather than colour statistics; the noise and the random geometry keep
the set from being memorised in a few steps.

Output: OUTPUT/train/part_NNN.pb and OUTPUT/val/part_NNN.pb. Every sample holds two tensors,
named after the graph inputs they feed: `image`, float32 [3, size, size] (channels first, about
zero mean and unit spread), and `labels`, an int64 scalar (the class). Shard framing (what
tensorfleet-worker's onnxSamples reader expects): per sample a u32 LE byte count of the rest,
then per tensor a u32 LE length and a serialized TensorProto.

Needs numpy and onnx (the project's .venv has both).
"""

import argparse
import os
import shutil
import struct

import numpy as np
from onnx import numpy_helper

CLASSES = ["disk", "ring", "square", "triangle", "cross",
           "horizontal stripes", "vertical stripes", "checkerboard"]
# The pixel values lie in [0, 1]; this maps them to about zero mean and unit spread, which is
# what the demos' initializations (Kaiming) assume of their input.
MEAN, STD = 0.5, 0.25


def mask(kind, size, rng):
    """A boolean [size, size] mask of class `kind`, at a random place, size and phase."""
    yy, xx = np.mgrid[0:size, 0:size] + 0.5
    # Objects: centred in the middle 40% of the image, radius 15-30% of its side, so they
    # always fit and never shrink below a few pixels at 32 px.
    cx, cy = rng.uniform(0.3, 0.7, 2) * size
    r = rng.uniform(0.15, 0.3) * size
    dx, dy = xx - cx, yy - cy
    d = np.hypot(dx, dy)
    # Textures: a period of 4-10 px spans a few cycles at any size the demos use.
    period = rng.uniform(4.0, 10.0)
    phase = rng.uniform(0.0, period)
    if kind == 0:
        return d <= r
    if kind == 1:
        return (d <= r) & (d >= 0.55 * r)
    if kind == 2:
        return np.maximum(np.abs(dx), np.abs(dy)) <= 0.85 * r
    if kind == 3:
        # Apex up, base at cy + 0.7r: the width grows linearly from the apex to the base.
        top, bottom = cy - r, cy + 0.7 * r
        return (yy >= top) & (yy <= bottom) & (np.abs(dx) <= 0.6 * (yy - top))
    if kind == 4:
        arm = 0.3 * r
        return ((np.abs(dx) <= arm) & (np.abs(dy) <= r)) | ((np.abs(dy) <= arm) & (np.abs(dx) <= r))
    if kind == 5:
        return np.sin(2 * np.pi * (yy + phase) / period) > 0
    if kind == 6:
        return np.sin(2 * np.pi * (xx + phase) / period) > 0
    if kind == 7:
        half = period / 2
        return (np.floor((xx + phase) / half) + np.floor((yy + phase) / half)) % 2 == 0
    raise ValueError(f"no class {kind}")


def image(kind, size, rng):
    """float32 [3, size, size], normalized."""
    bg = rng.uniform(0.0, 1.0, 3)
    # Redraw the foreground until it differs visibly from the background; otherwise some
    # samples would carry no drawing at all and only teach the model to guess.
    fg = rng.uniform(0.0, 1.0, 3)
    while np.linalg.norm(fg - bg) < 0.45:
        fg = rng.uniform(0.0, 1.0, 3)
    m = mask(kind, size, rng)[None, :, :]
    pixels = np.where(m, fg[:, None, None], bg[:, None, None])
    pixels = np.clip(pixels + rng.normal(0.0, 0.08, pixels.shape), 0.0, 1.0)
    return ((pixels - MEAN) / STD).astype(np.float32)


def write_shard(path, samples):
    """samples: a list of {input name: numpy array of one sample (no batch dimension)}."""
    # Written out here rather than imported from the test oracles (worker/tests/oracle), so
    # that this script stands alone as a template for converting other data to shards.
    with open(path, "wb") as f:
        for sample in samples:
            body = b""
            for name, arr in sample.items():
                blob = numpy_helper.from_array(np.asarray(arr), name=name).SerializeToString()
                body += struct.pack("<I", len(blob)) + blob
            f.write(struct.pack("<I", len(body)) + body)


def write_split(directory, count, size, shard_size, rng):
    os.makedirs(directory)
    # Every class equally often, in a random order.
    labels = rng.permutation(np.arange(count) % len(CLASSES))
    for first in range(0, count, shard_size):
        samples = [{"image": image(int(y), size, rng), "labels": np.array(y, dtype=np.int64)}
                   for y in labels[first:first + shard_size]]
        write_shard(os.path.join(directory, f"part_{first // shard_size:03d}.pb"), samples)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", required=True, help="directory to create (train/ and val/ inside)")
    ap.add_argument("--size", type=int, default=32, help="image height and width in pixels")
    ap.add_argument("--train", type=int, default=2048, help="training samples")
    ap.add_argument("--val", type=int, default=256, help="evaluation samples")
    ap.add_argument("--shard-size", type=int, default=512, help="samples per .pb file")
    ap.add_argument("--seed", type=int, default=20240520)
    a = ap.parse_args()
    if a.size < 16 or a.train < 1 or a.val < 1 or a.shard_size < 1:
        ap.error("--size must be at least 16, and --train, --val and --shard-size at least 1")
    rng = np.random.default_rng(a.seed)
    # Written under a temporary name and renamed when complete: make treats an existing
    # directory as done, so an interrupted run must not leave a half-written one behind.
    tmp = a.output.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    write_split(os.path.join(tmp, "train"), a.train, a.size, a.shard_size, rng)
    write_split(os.path.join(tmp, "val"), a.val, a.size, a.shard_size, rng)
    shutil.rmtree(a.output, ignore_errors=True)
    os.rename(tmp, a.output)
    print(f"{a.output}: {a.train} training and {a.val} evaluation images of {a.size}x{a.size}, "
          f"{len(CLASSES)} classes")


if __name__ == "__main__":
    main()
