"""The sm80+ forward's two tile shapes side by side (Note [portattn sm80 narrow tiles], and above
head dim 128 Note [portattn sm80 narrow tiles above 128]).

Needs a build with -DPORTATTN_FWD_TUNING, whose forward reads PORTATTN_FWD_SHAPE on every call
(wide: the 128-row tiles; narrow: the 64 x 64 tiles; unset: the launch's own rule, reported as
the "rule" column):
  PORTATTN_CUDA_ARCHS=90 PORTATTN_NVCC_FLAGS=-DPORTATTN_FWD_TUNING python3 portattn/backends/cuda/build.py
Times CudaBackend.forward alone (bench/peers.py `sm80_kernel`) with each shape, next to SDPA
cuDNN and flash, over many short sequences (batch 512, 16 heads, bf16: bench_short.py's shape)
and a few longer points, rounds interleaved so that clock drift hits both shapes alike. The
crossover it shows is what fwd_launch.cuh's rule (narrow_pays) is set from.
  python bench/tools/sm80_narrow_ab.py [--seqlens 50,...] [--head-dims 16,32,64] [--rounds 2] [--out DIR]
Above head dim 128 the rule was set on the FA2 grid's shapes (--tokens: batch = tokens / seqlen,
heads = 2048 / head dim):
  python bench/tools/sm80_narrow_ab.py --head-dims 160,192,224,256 --seqlens 512,1024,4096,16384 --tokens 16384
Writes <out>/sm80_narrow_ab.{json,md}.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for peers.py
import peers  # noqa: E402

SHAPES = {"wide": "wide", "narrow": "narrow", "rule": ""}
BATCH, HEADS = 512, 16


def _shape(head_dim: int, seqlen: int, tokens: int):
    """(batch, heads): bench_short.py's 512 x 16, or with tokens the FA2 grid's (hidden 2048)."""
    return (max(1, tokens // seqlen), 2048 // head_dim) if tokens else (BATCH, HEADS)


def _inputs(head_dim: int, seqlen: int, tokens: int):
    batch, heads = _shape(head_dim, seqlen, tokens)
    shape = (batch, seqlen, heads, head_dim)
    return [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3)]


def _time(call, timer) -> float:
    return timer.ms(call, 0.0, "")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", default="50,100,128,200,256,300,384,512")
    parser.add_argument("--head-dims", default="16,32,64")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=0, help="batch = tokens / seqlen, heads = 2048 / head dim "
                        "(default: batch 512, 16 heads)")
    parser.add_argument("--out", default=peers.SCRATCH)
    args = parser.parse_args()
    peers.require_device(False)
    bind_ours, why = peers.load_impl("sm80_kernel")
    if bind_ours is None:
        raise SystemExit(f"sm80_kernel: {why}")
    peer_impls = [impl for impl in peers.select("sdpa_cudnn,sdpa_flash")]
    timer = peers.Timer()
    points = [(hd, s, c) for hd in peers.parse_ints(args.head_dims) for s in peers.parse_ints(args.seqlens)
              for c in (False, True)]
    times = {}  # (point, column) -> [ms per round]
    for round_index in range(args.rounds):
        for point in points:
            hd, seqlen, causal = point
            q, k, v = _inputs(hd, seqlen, args.tokens)
            call = bind_ours(q, k, v, causal)
            for shape, limit in SHAPES.items():
                os.environ["PORTATTN_FWD_SHAPE"] = limit
                times.setdefault((point, shape), []).append(_time(call, timer))
            os.environ.pop("PORTATTN_FWD_SHAPE", None)
            if round_index == 0:
                for impl in peer_impls:
                    bind, _ = peers.load_impl(impl.name)
                    if bind is None:
                        continue
                    with impl.context():
                        peer_call = bind(q, k, v, causal)
                        with torch.no_grad():
                            times.setdefault((point, impl.name), []).append(_time(peer_call, timer))
            del q, k, v
    rows = []
    for point in points:
        hd, seqlen, causal = point
        batch, heads = _shape(hd, seqlen, args.tokens)
        row = dict(head_dim=hd, seqlen=seqlen, causal=causal, batch=batch, heads=heads)
        for column in ("wide", "narrow", "rule", "sdpa_cudnn", "sdpa_flash"):
            if (point, column) in times:
                row[column + "_ms"] = times[(point, column)]
        row["narrow_over_wide"] = statistics.median(row["wide_ms"]) / statistics.median(row["narrow_ms"])
        row["rule_over_best"] = (min(statistics.median(row["wide_ms"]), statistics.median(row["narrow_ms"]))
                                 / statistics.median(row["rule_ms"]))
        rows.append(row)
    lines = ["| hd | seqlen | causal | wide us (rounds) | narrow us (rounds) | narrow speedup | rule us | "
             "rule / best | cuDNN us | rule / cuDNN (time ratio) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        fmt = lambda values: ", ".join(f"{1000 * value:.0f}" for value in values)  # noqa: E731
        cudnn = row.get("sdpa_cudnn_ms")
        vs = f"{cudnn[0] / statistics.median(row['rule_ms']):.3f}" if cudnn else "n/a"
        lines.append(f"| {row['head_dim']} | {row['seqlen']} | {row['causal']} | {fmt(row['wide_ms'])} | "
                     f"{fmt(row['narrow_ms'])} | {row['narrow_over_wide']:.3f} | {fmt(row['rule_ms'])} | "
                     f"{row['rule_over_best']:.3f} | {fmt(cudnn) if cudnn else 'n/a'} | {vs} |")
    shape_note = f"{args.tokens} tokens a batch, hidden 2048" if args.tokens else f"batch {BATCH}, {HEADS} heads"
    result = dict(peers.header(False), title="sm80+ forward: wide and narrow tiles",
                  note=f"CudaBackend.forward alone, {shape_note}, bf16; median of "
                       f"triton do_bench per round, {args.rounds} rounds interleaved. speedup = wide time / "
                       "narrow time; rule = the launch's own choice; rule / best = the faster shape's time / the "
                       "rule's; rule / cuDNN = cuDNN time / the rule's time.", rows=rows)
    path = peers.write_results(result, args.out, "sm80_narrow_ab", lines)
    print("\n".join(lines))
    print("wrote", path)


if __name__ == "__main__":
    main()
