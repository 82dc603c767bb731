"""Does a grid cell's time depend on the process it runs in? One cell, N fresh processes.

  python bench/tools/probe_process_variance.py [--point 128:1024:causal | --short 16:50:causal]
                                         [--processes 8] [--impls portattn,sdpa_cudnn] [--out DIR] [--dry-run]

Why: two backward cells have read 15-35% slow in one process and normal in the next
(docs/kernels-hopper.md: hd16 50 rows causal in one fresh process of three, hd128 1k causal
in one grid run), with their forward cells normal. A benchmark process differs from the next in
its allocator's state and so in where the workspace, the dQ accumulator and the inputs land.
Each child process times the cell's forward and forward+backward (do_bench medians), then
profiles one forward+backward step and reports its kernels' GPU time, the median of
CUDA-event-timed steps run back to back (no L2 flush between them, unlike do_bench; minus the
kernels' sum, the time the GPU sat idle inside a step: launch gaps, or a host that fell behind),
the host's time to issue one step (a step whose GPU time is below it is host-bound), the SM clock
after the run, and the data pointers of the
inputs (their alignment mod 2 MiB). The table says whether the slow processes share a kernel, an idle
gap, a clock or an address pattern. With several --impls the processes alternate between them (a
peer's spread measured the same way, in the same call). Points: head_dim:seqlen:causal|full, on the FA2 grid's 16k tokens (--point) or at
batch 512 x 16 heads (--short, bench_short.py's shape). Results: <out>/process_variance.{md,json}.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for peers.py
import peers  # noqa: E402


def _sm_clock_mhz() -> str:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else "n/a"
    except (OSError, subprocess.SubprocessError):
        return "n/a"


def _event_median_ms(torch, step, reps: int = 30) -> float:
    """Median of CUDA-event-timed steps issued back to back (no cache flush between them)."""
    import statistics
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, stop in pairs:
        start.record()
        step()
        stop.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(stop) for start, stop in pairs)


def _host_issue_us(torch, step, reps: int = 20) -> float:
    """Host time to issue one step (no synchronize inside: the queue is deep enough for 20 steps)."""
    import time
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(reps):
        step()
    issued = time.perf_counter() - begin
    torch.cuda.synchronize()
    return issued / reps * 1e6


def child(args) -> dict:
    """One process's measurements of the cell (printed as one JSON line)."""
    import torch

    point = peers.parse_point(args.short or args.point, bool(args.short))
    impl = peers.IMPLS[args.impl]
    bind, why = peers.load_impl(impl.name)
    if bind is None:
        return {"error": why}
    q, k, v, dout = peers.make_inputs(point, args.dry_run)
    timer = peers.Timer(dry_run=args.dry_run)
    salt = f"{args.index}:{args.impl}"  # a dry run's fake times differ by process, as a real spread would
    with impl.context():
        call = bind(q, k, v, point.causal)

        def step():
            return torch.autograd.grad(call(), (q, k, v), dout)
        fwd_ms = timer.ms(call, point.flops("fwd"), salt + "fwd")
        step_ms = timer.ms(step, point.flops("fwd_bwd"), salt + "fwd_bwd")
        # (No span from the profiler's timeline: under the profiler the host is the bottleneck,
        # so its kernels sit milliseconds apart.)
        kernels, events_ms, issue_us, clock = {}, None, None, "dry run"
        if not args.dry_run:
            from torch.profiler import ProfilerActivity, profile

            events_ms = _event_median_ms(torch, step)
            issue_us = _host_issue_us(torch, step)
            step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            for event in prof.key_averages():
                if event.device_time_total > 0:
                    kernels[event.key[:70]] = round(event.device_time_total, 1)
            clock = _sm_clock_mhz()
    mib2 = 2 << 20
    return {"impl": args.impl, "fwd_ms": fwd_ms, "fwd_bwd_ms": step_ms, "kernels_us": kernels,
            "kernel_sum_us": round(sum(kernels.values()), 1) if kernels else None,
            "back_to_back_ms": events_ms, "host_issue_us": issue_us, "clock": clock,
            "ptr_mod_2mib": {name: t.data_ptr() % mib2 for name, t in (("q", q), ("k", k), ("v", v), ("dout", dout))}}


def _num(value, digits: int) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--point", default="128:1024:causal", help="head_dim:seqlen:causal|full at 16k tokens")
    where.add_argument("--short", default=None, help="head_dim:seqlen:causal|full at batch 512 x 16 heads")
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--impls", default="portattn",
                        help="comma-separated (bench/peers.py names); processes alternate between them")
    parser.add_argument("--impl", default="portattn", choices=sorted(peers.IMPLS), help=argparse.SUPPRESS)
    parser.add_argument("--out", default=peers.SCRATCH)
    parser.add_argument("--dry-run", action="store_true", help="CPU, fake timings: checks the plumbing only")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return
    peers.require_device(args.dry_run)
    impls = [name.strip() for name in args.impls.split(",") if name.strip()]
    unknown = [name for name in impls if name not in peers.IMPLS]
    if not impls or unknown:
        raise SystemExit(f"--impls: unknown {unknown or 'none given'}; choose from {', '.join(sorted(peers.IMPLS))}")
    rows = []
    for index in range(args.processes):
        impl = impls[index % len(impls)]
        command = [sys.executable, os.path.abspath(__file__), "--child", "--index", str(index), "--impl", impl]
        command += ["--short", args.short] if args.short else ["--point", args.point]
        command += ["--dry-run"] if args.dry_run else []
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        rows.append(json.loads(lines[-1]) if done.returncode == 0 and lines
                    else {"impl": impl, "error": (done.stderr or done.stdout)[-400:]})
        print(f"process {index}: {rows[-1]}", flush=True)
    cell = f"{'short ' + args.short if args.short else args.point}, {', '.join(impls)}"
    result = dict(peers.header(args.dry_run), cell=cell, processes=rows)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "process_variance.json"), "w") as handle:
        json.dump(result, handle, indent=1)
    kernels = sorted({name for row in rows for name in row.get("kernels_us", {})})
    lines = [f"# One cell in {args.processes} fresh processes: {cell}", "",
             f"device: {result['device']}; date: {result['date']}; commit: {result['commit']}; torch {result['torch']}", ""]
    header = (["process", "impl", "fwd ms", "fwd+bwd ms", "back to back ms", "kernel sum us", "idle us",
               "host issue us"] + [f"{name[:40]} us" for name in kernels] + ["clock", "q, dout mod 2 MiB"])
    lines += ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for index, row in enumerate(rows):
        if "error" in row:
            lines.append(f"| {index} | error: {row['error'][:120]} |")
            continue
        step_ms, total = row.get("back_to_back_ms"), row.get("kernel_sum_us")
        cells = [str(index), row["impl"], f"{row['fwd_ms']:.3f}", f"{row['fwd_bwd_ms']:.3f}", _num(step_ms, 3),
                 _num(total, 1), _num(step_ms * 1e3 - total if step_ms is not None and total is not None else None, 1),
                 _num(row.get("host_issue_us"), 1)]
        cells += [str(row["kernels_us"].get(name, "")) for name in kernels]
        cells += [str(row.get("clock", "")), f"{row['ptr_mod_2mib']['q']}, {row['ptr_mod_2mib']['dout']}"]
        lines.append("| " + " | ".join(cells) + " |")
    for impl in impls:
        good = [row["fwd_bwd_ms"] for row in rows if "error" not in row and row["impl"] == impl]
        if good:
            lines += ["", f"{impl} forward+backward: slowest / fastest process = {max(good) / min(good):.2f}"]
    with open(os.path.join(args.out, "process_variance.md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
