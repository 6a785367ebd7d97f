#!/usr/bin/env python3
"""Reads TensorBoard event files with TensorBoard's own reader and prints what it found.

    python read_tensorboard.py LOGDIR

Prints JSON: {"scalars": {tag: [[step, value], ...]},
              "histograms": {tag: [[step, num, min, max, sum, sum_squares, buckets], ...]}}.
A file TensorBoard cannot read makes the reader fail loudly (it raises on a bad CRC).
"""
import json
import sys

from tensorboard.backend.event_processing import event_accumulator as ea


def main():
    acc = ea.EventAccumulator(sys.argv[1], size_guidance={ea.SCALARS: 0, ea.HISTOGRAMS: 0})
    acc.Reload()
    tags = acc.Tags()
    out = {
        "scalars": {t: [[e.step, e.value] for e in acc.Scalars(t)] for t in tags["scalars"]},
        "histograms": {
            t: [
                [e.step, h.num, h.min, h.max, h.sum, h.sum_squares, len(h.bucket)]
                for e in acc.Histograms(t)
                for h in [e.histogram_value]
            ]
            for t in tags["histograms"]
        },
    }
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
