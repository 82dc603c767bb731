"""Hopper forward schedules side by side (Note [portattn hopper forward schedule]).

Needs a tuning build of the CUDA backend, which carries every bf16 schedule:
  PORTATTN_CUDA_ARCHS=90 PORTATTN_NVCC_FLAGS=-DPORTATTN_HOPPER_TUNING python3 portattn/backends/cuda/build.py
and picks one per call through PORTATTN_HOPPER_FWD_SCHEDULE (read on every call). A schedule
here is what that variable is set to (csrc/hopper_fwd_schedule.h; the build reports the values
it accepts per head dim in build_config()["hopper"]["fwd_tuning"]):
  default  unset: the launch's own choices (run_default in hopper_fwd_launch.cuh)
  <bits>   one schedule for every call (bf16, no mask or causal), e.g. 5 = pipe+pers
  +<bits>  the default choices with <bits> added where admitted, e.g. +64 = three consumer
           warpgroups (192-row tiles) at hd64: what a change of kDefaultAddedBits would launch
For each schedule: a correctness check on shapes that exercise many tiles per CTA,
empty causal tiles and ragged blocks (the error rule of tests/gpu), then TFLOP/s over
the issue's grid (bf16, 16k tokens, hidden 2048) next to SDPA cuDNN and flash.
  python bench/tools/hopper_fwd_tuning.py [--schedules default,5,+64,...] [--head-dims 64,128] [--out DIR]
Writes <out>/hopper_fwd_tuning.{json,md} through peers.write_results (default --out
/tmp/portattn-bench-tools: a tuning sweep is not a table of bench/results/latest/).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [BENCH, os.path.join(os.path.dirname(BENCH), "tests")]  # peers.py; tests/error_rule.py, naive.py
from error_rule import FLOOR, OUT_FACTOR, max_error  # noqa: E402
from naive import naive_attention  # noqa: E402

import peers  # noqa: E402

from portattn.backends.abi import fwd_args  # noqa: E402
from portattn.backends.cuda import _C  # noqa: E402

BITS = ((1, "pipe"), (2, "pp"), (4, "pers"), (8, "3st"), (16, "poly4"), (32, "poly8"), (64, "3wg"), (128, "xtile"), (256, "n176"), (512, "pairs"), (1024, "n80"))


def schedule_name(schedule: str) -> str:
    """'default', '5' -> 'pipe+pers', '+64' -> 'default+3wg'."""
    if schedule == "default":
        return "default"
    bits = int(schedule.lstrip("+"))
    names = "+".join(name for bit, name in BITS if bits & bit) or "serial"
    return "default+" + names if schedule.startswith("+") else names


def built_schedules(head_dim: int) -> list:
    """The schedules this build runs at head_dim: 'default' plus what it reports (as strings)."""
    tuning = _C.build_config()["hopper"].get("fwd_tuning", {})
    return ["default"] + [str(value) for value in tuning.get(head_dim, [])]


def _set_schedule(schedule: str) -> None:
    if schedule == "default":
        os.environ.pop("PORTATTN_HOPPER_FWD_SCHEDULE", None)
    else:
        os.environ["PORTATTN_HOPPER_FWD_SCHEDULE"] = schedule


CHECK_SHAPES = [  # batch, seqlen_q, seqlen_k, heads
    (3, 777, 513, 20), (2, 1000, 1000, 3), (1, 4097, 1000, 2), (2, 17, 113, 3), (1, 128, 128, 1),
    (2, 193, 385, 3), (3, 640, 640, 45)]


# Timed cases: (window_left, window_right, softcap). "softcap" and "window" (--cases) run only
# with default and +<bits> (a single schedule serves no-mask and causal calls without softcap),
# and SDPA has no softcap or window kernel to compare with.
CASES = {"full": (-1, -1, 0.0), "causal": (-1, 0, 0.0), "softcap": (-1, -1, 30.0), "window": (1024, 0, 0.0)}


def _run(q, k, v, out, lse, causal, case="full"):
    left, right, softcap = CASES["causal" if causal else case]
    _C.hopper_fwd(*fwd_args(q, k, v, out, lse, None, None, 0, 0, 1.0 / math.sqrt(q.shape[-1]), left,
                            right, softcap, None, 0.0, 0, 0))


def check(schedule: str, head_dims) -> str:
    _set_schedule(schedule)
    worst = 0.0
    for batch, sq, sk, heads in CHECK_SHAPES:
        for head_dim in head_dims:
            if schedule not in built_schedules(head_dim):
                continue
            for causal in (False, True):
                q = torch.randn(batch, sq, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(batch, sk, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                v = torch.randn(batch, sk, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                out = torch.full_like(q, float("nan"))
                lse = torch.full((batch, heads, sq), float("nan"), device="cuda")
                _run(q, k, v, out, lse, causal)
                ref, _ = naive_attention(q.double(), k.double(), v.double(), causal=causal)
                low, _ = naive_attention(q, k, v, compute_dtype=torch.bfloat16, causal=causal)
                if out.isnan().any() or lse.isnan().any():
                    return f"FAIL NaN at {(batch, sq, sk, heads, head_dim, causal)}"
                err, base = max_error(out, ref), max_error(low, ref)
                if err > OUT_FACTOR * base + FLOOR:
                    return f"FAIL err {err:.2e} > {OUT_FACTOR:g} x {base:.2e} at {(batch, sq, sk, heads, head_dim, causal)}"
                worst = max(worst, err / (base + 1e-12))
    return f"ok (worst err / torch bf16 err = {worst:.2f})"


def _visible_pairs(seqlen, case):
    """(query, key) pairs a case computes, for TFLOP/s: causal counts half the square, as the
    issue's grid does; a window counts the keys each row sees."""
    left, right, _ = CASES[case]
    if left < 0 and right < 0:
        return seqlen * seqlen
    if left < 0 and right == 0:
        return seqlen * seqlen / 2
    rows = torch.arange(seqlen, dtype=torch.int64)
    hi = (rows + right).clamp(max=seqlen - 1) if right >= 0 else torch.full_like(rows, seqlen - 1)
    lo = (rows - left).clamp(min=0) if left >= 0 else torch.zeros_like(rows)
    return int((hi - lo + 1).clamp(min=0).sum())


def _tflops(ms, batch, heads, seqlen, head_dim, case):
    return 4 * batch * heads * _visible_pairs(seqlen, case) * head_dim / ms / 1e9


def time_grid(schedules, seqlens, head_dims, cases, batch_size=None, heads_count=None):
    rows = []
    for head_dim in head_dims:
        heads = heads_count or 2048 // head_dim
        here = [s for s in schedules if s in built_schedules(head_dim)]
        for seqlen in seqlens:
            batch = batch_size or 16384 // seqlen
            q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            out = torch.empty_like(q)
            lse = torch.empty(batch, heads, seqlen, device="cuda")
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            for case in cases:
                causal, sdpa = case == "causal", case in ("full", "causal")
                row = {"head_dim": head_dim, "seqlen": seqlen, "case": case}
                for schedule in here:
                    if not sdpa and schedule != "default" and not schedule.startswith("+"):
                        continue
                    _set_schedule(schedule)
                    ms = do_bench(lambda: _run(q, k, v, out, lse, causal, case), warmup=25, rep=100,
                                  return_mode="median")
                    row[schedule_name(schedule)] = _tflops(ms, batch, heads, seqlen, head_dim, case)
                _set_schedule("default")
                for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                    if not sdpa:
                        continue
                    with sdpa_kernel(backend):
                        ms = do_bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal),
                                      warmup=25, rep=100, return_mode="median")
                    row[name] = _tflops(ms, batch, heads, seqlen, head_dim, case)
                rows.append(row)
                print({key: (round(val, 1) if isinstance(val, float) else val) for key, val in row.items()},
                      flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schedules", default=None,
                        help="comma-separated: default, <bits>, +<bits> (default: every one the build has)")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--repeats", type=int, default=1, help="time the grid this many times (spread)")
    parser.add_argument("--seqlens", default="1024,4096,16384")
    parser.add_argument("--cases", default="full,causal", help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--batch", type=int, default=None,
                        help="a fixed batch (e.g. 512 for many short sequences) instead of 16k tokens")
    parser.add_argument("--heads", type=int, default=None, help="instead of hidden 2048 / head dim")
    parser.add_argument("--out", default=peers.SCRATCH)
    args = parser.parse_args()
    head_dims = [int(d) for d in args.head_dims.split(",")]
    if args.schedules is None:
        schedules = list(dict.fromkeys(s for d in head_dims for s in built_schedules(d)))
    else:
        schedules = args.schedules.split(",")
    unknown = [s for s in schedules if not any(s in built_schedules(d) for d in head_dims)]
    if unknown:
        sys.exit(f"this build has no schedule {unknown} at head dims {head_dims} "
                 f"(build_config()['hopper'].get('fwd_tuning'): {_C.build_config()['hopper'].get('fwd_tuning')})")
    checks = {schedule_name(s): check(s, head_dims) for s in schedules}
    for name, verdict in checks.items():
        print(f"check {name}: {verdict}", flush=True)
    good = [s for s in schedules if checks[schedule_name(s)].startswith("ok")]
    rows = []
    for repeat in range(args.repeats):
        for row in time_grid(good, [int(s) for s in args.seqlens.split(",")], head_dims, args.cases.split(","),
                             args.batch, args.heads):
            rows.append(dict(row, repeat=repeat))
    names = [schedule_name(s) for s in good]
    shape = (f"batch {args.batch}" if args.batch else "16k tokens") + ", " + (
        f"{args.heads} heads" if args.heads else "hidden 2048")
    result = dict(peers.header(dry_run=False), title=f"Hopper forward schedules (bf16 TFLOP/s, {shape})",
                  checks=checks, rows=rows)
    lines = ["checks: " + "; ".join(f"{k}: {v}" for k, v in checks.items()), "",
             "| hd | seqlen | case | rep | " + " | ".join(names) + " | cuDNN | flash | best / cuDNN | best / default |",
             "|" + "---|" * (len(names) + 8)]

    def cell(row, key):
        return f"{row[key]:.0f}" if key in row else "-"

    for row in rows:
        best = max(row[n] for n in names if n in row)
        lines.append(f"| {row['head_dim']} | {row['seqlen']} | {row['case']} | {row['repeat']} | "
                     + " | ".join(cell(row, n) for n in names)
                     + f" | {cell(row, 'cudnn')} | {cell(row, 'flash')}"
                     + (f" | {best / row['cudnn']:.3f}" if "cudnn" in row else " | -")
                     + (f" | {best / row['default']:.3f} |" if "default" in row else " | - |"))
    print(open(peers.write_results(result, args.out, "hopper_fwd_tuning", lines)).read())


if __name__ == "__main__":
    main()
