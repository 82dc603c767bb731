"""Where the host time of one forward+backward step goes (Python and the launch calls), per implementation.

  python bench/tools/profile_host.py [--short 16:50:causal | --point 128:1024:causal] [--impls portattn,sdpa_cudnn]
                               [--steps 200] [--out DIR] [--dry-run]

Why: a step whose GPU time is shorter than the host's time to issue it runs at the host's pace, and
the host's pace differs between processes (bench/tools/probe_process_variance.py: portattn's forward+backward
issue time 205-346 us across fresh processes at batch 512 x 50 rows, hd16, whose GPU time is 285 us).
For each implementation: the host time to issue the forward and the backward (autograd.grad) of one
step, medians over --steps steps issued in groups of 10 with a synchronize between groups (so the
launch queue never fills and blocks the host; the synchronize is not timed), then a cProfile of the
same loop: the functions with the most own time and the most cumulative time. Results:
<out>/host_profile.{md,json}.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for peers.py
import peers  # noqa: E402

GROUP = 10  # steps issued between two synchronizes


def issue_times(torch, call, grad_inputs, dout, steps: int, dry_run: bool) -> dict:
    """Median host microseconds to issue the forward and the backward of one step."""
    forward_us, backward_us = [], []
    for group in range(0, steps, GROUP):
        if not dry_run:
            torch.cuda.synchronize()
        for _ in range(min(GROUP, steps - group)):
            begin = time.perf_counter()
            out = call()
            middle = time.perf_counter()
            torch.autograd.grad(out, grad_inputs, dout)
            end = time.perf_counter()
            forward_us.append((middle - begin) * 1e6)
            backward_us.append((end - middle) * 1e6)
    if not dry_run:
        torch.cuda.synchronize()
    return {"forward_us": statistics.median(forward_us), "backward_us": statistics.median(backward_us),
            "step_us": statistics.median(f + b for f, b in zip(forward_us, backward_us))}


def profile_text(torch, call, grad_inputs, dout, steps: int, dry_run: bool, lines: int = 22) -> dict:
    profiler = cProfile.Profile()
    for group in range(0, steps, GROUP):
        if not dry_run:
            torch.cuda.synchronize()
        profiler.enable()
        for _ in range(min(GROUP, steps - group)):
            torch.autograd.grad(call(), grad_inputs, dout)
        profiler.disable()
    if not dry_run:
        torch.cuda.synchronize()
    texts = {}
    for key in ("tottime", "cumulative"):
        stream = io.StringIO()
        pstats.Stats(profiler, stream=stream).strip_dirs().sort_stats(key).print_stats(lines)
        texts[key] = stream.getvalue()
    return texts


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--point", default=None, help="head_dim:seqlen:causal|full at 16k tokens")
    where.add_argument("--short", default=None, help="head_dim:seqlen:causal|full at batch 512 x 16 heads")
    parser.add_argument("--impls", default="portattn,sdpa_cudnn")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default=peers.SCRATCH)
    parser.add_argument("--dry-run", action="store_true", help="CPU: checks the plumbing, times the CPU proxy")
    args = parser.parse_args()
    peers.require_device(args.dry_run)
    import torch

    text = args.short or args.point or "16:50:causal"
    point = peers.parse_point(text, args.point is None)
    q, k, v, dout = peers.make_inputs(point, args.dry_run)
    result = dict(peers.header(args.dry_run), cell=("short " if args.point is None else "") + text, impls={})
    lines = [f"# Host time of one forward+backward step: {result['cell']}", "",
             f"device: {result['device']}; date: {result['date']}; commit: {result['commit']}; torch {result['torch']}",
             "", f"Medians over {args.steps} steps issued {GROUP} at a time (synchronize between groups, untimed).", "",
             "| impl | forward issue us | backward issue us | step issue us |", "|---|---|---|---|"]
    profiles = []
    for impl in peers.select(args.impls):
        bind, why = peers.load_impl(impl.name)
        if bind is None:
            lines.append(f"| {impl.name} | n/a: {why} | | |")
            continue
        with impl.context():
            call = bind(q, k, v, point.causal)
            for _ in range(20):  # warm-up: first-call work (dispatch caches, cuDNN plans)
                torch.autograd.grad(call(), (q, k, v), dout)
            times = issue_times(torch, call, (q, k, v), dout, args.steps, args.dry_run)
            texts = profile_text(torch, call, (q, k, v), dout, min(args.steps, 100), args.dry_run)
        result["impls"][impl.name] = dict(times, profile=texts)
        lines.append(f"| {impl.name} | {times['forward_us']:.1f} | {times['backward_us']:.1f} | {times['step_us']:.1f} |")
        profiles += ["", f"## {impl.name}: cProfile of {min(args.steps, 100)} steps, by own time", "", "```",
                     texts["tottime"].strip(), "```", "", f"## {impl.name}: by cumulative time", "", "```",
                     texts["cumulative"].strip(), "```"]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "host_profile.json"), "w") as handle:
        json.dump(result, handle, indent=1)
    with open(os.path.join(args.out, "host_profile.md"), "w") as handle:
        handle.write("\n".join(lines + profiles) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
