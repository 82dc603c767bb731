"""Same-call A/B of two builds from their benchmark files, round by round.

  python bench/tools/ab_table.py DIR KIND A B ROUNDS [--peer sdpa_cudnn] [--impl portattn]

An A/B device call runs one benchmark (bench_attention.py --grid-only or bench_short.py) for build A
and build B in turns, ROUNDS times, each writing <DIR>/<KIND>_<build>_r<round>/*.json (KIND is the
run's prefix, e.g. grid or short). This prints, per mode and point, portattn's TFLOP/s of every
round of A and of B, B / A on the round means, and B / the peer measured in B's first round (when it
ran there). Rounds side by side show the spread, which is what says whether a ratio is a change.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics


def load(directory: str, impl: str) -> dict:
    """{(head_dim, seqlen, causal, mode): TFLOP/s} of one run folder ({} where impl did not run)."""
    files = glob.glob(os.path.join(directory, "*.json"))
    if not files:
        raise SystemExit(f"no benchmark json in {directory}")
    with open(files[0]) as handle:
        result = json.load(handle)
    out = {}
    for row in result["grid"]:
        for mode, by_impl in row["tflops"].items():
            if by_impl.get(impl) is not None:
                out[(row["head_dim"], row["seqlen"], row["causal"], mode)] = by_impl[impl]
    return out


def table(directory: str, kind: str, a: str, b: str, rounds: int, peer: str, impl: str = "portattn") -> str:
    runs_a = [load(os.path.join(directory, f"{kind}_{a}_r{r}"), impl) for r in range(1, rounds + 1)]
    runs_b = [load(os.path.join(directory, f"{kind}_{b}_r{r}"), impl) for r in range(1, rounds + 1)]
    peer_b = load(os.path.join(directory, f"{kind}_{b}_r1"), peer)
    lines = []
    for mode in sorted({key[3] for key in runs_a[0]}):
        lines += ["", f"### {kind}, {mode} (TFLOP/s)", "",
                  f"| hd | seqlen | mask | {a} rounds | {b} rounds | {b} / {a} | {b} / {peer} |", "|---|---|---|---|---|---|---|"]
        for key in sorted(k for k in runs_a[0] if k[3] == mode):
            values_a = [run[key] for run in runs_a if key in run]
            values_b = [run[key] for run in runs_b if key in run]
            if not values_a or not values_b:
                continue
            mean_b = statistics.mean(values_b)
            versus_peer = f"{mean_b / peer_b[key]:.3f}" if key in peer_b else ""
            lines.append(f"| {key[0]} | {key[1]} | {'causal' if key[2] else 'none'} | "
                         f"{' '.join(f'{v:.1f}' for v in values_a)} | {' '.join(f'{v:.1f}' for v in values_b)} | "
                         f"{mean_b / statistics.mean(values_a):.3f} | {versus_peer} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory")
    parser.add_argument("kind")
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("rounds", type=int)
    parser.add_argument("--peer", default="sdpa_cudnn")
    parser.add_argument("--impl", default="portattn", help="the column compared (e.g. portattn_sm80)")
    args = parser.parse_args()
    print(table(args.directory, args.kind, args.a, args.b, args.rounds, args.peer, args.impl))


if __name__ == "__main__":
    main()
