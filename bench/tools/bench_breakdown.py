"""Where one forward+backward step's GPU time goes, kernel by kernel, per implementation.

  python bench/tools/bench_breakdown.py [--points 128:2048:causal,64:4096:causal] [--impls ...] [--out DIR]

The grid's ratio says how far apart two implementations are; this says which of their kernels
differ (the backward's main kernel, or the preprocess / memset / dQ conversion around it).
Points are head_dim:seqlen:causal|full on the FA2 grid's 16k tokens (bench/peers.py). Torch
profiler times of one step after three warm-up steps, so a few microseconds of spread per
kernel. Results: <out>/kernel_breakdown.md.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for peers.py
import peers  # noqa: E402


def parse_points(text: str) -> list:
    return [peers.parse_point(part) for part in text.split(",")]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", default="128:2048:causal,128:8192:causal,64:4096:causal,64:512:causal")
    parser.add_argument("--impls", default="portattn,sdpa_cudnn")
    parser.add_argument("--top", type=int, default=8, help="kernels listed per implementation")
    parser.add_argument("--out", default=peers.SCRATCH)
    args = parser.parse_args()
    peers.require_device(False)
    impls = peers.select(args.impls)
    head = peers.header(False)
    lines = ["# Kernel breakdown of one forward+backward step", "",
             f"Device {head['device']}, {head['date']}, commit {head['commit']}, torch {head['torch']}.", ""]
    for point in parse_points(args.points):
        lines += peers.kernel_breakdown(point, impls, top_n=args.top)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "kernel_breakdown.md")
    with open(path, "w") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print("wrote", path)


if __name__ == "__main__":
    main()
