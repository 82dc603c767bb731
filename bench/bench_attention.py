"""Attention benchmark: portattn against SDPA (FA2, cuDNN), FlexAttention and flash-attn-4, side by side.

  python bench/bench_attention.py [--backward] [--quick] [--seqlens 1024,4096] [--head-dims 128]
                                  [--impls portattn,sdpa_cudnn,fa4] [--out bench/results/latest] [--dry-run]

1. FA2 paper grid (issue #6): bf16, hidden 2048 (32 heads x 64 or 16 heads x 128),
   batch x seqlen = 16k tokens, seqlen 512..16k, causal and not. Forward TFLOP/s
   (4 * B * H * Sq * Sk * D FLOPs, halved for causal) from triton.testing.do_bench
   medians; `--backward` adds forward+backward (torch.autograd.grad; FLOPs = 3.5 x
   forward) and the backward alone derived from both. Columns (bench/peers.py): portattn
   through the public API (with the backend dispatch chose), portattn with the sm80+
   path forced, SDPA flash and cuDNN, compiled FlexAttention, flash-attn-4 where its
   wheels are installed; ratios portattn / cuDNN, / FA4, / FA2. A column that cannot run
   is "n/a" with its reason.
2. Small-problem host overhead: wall time per call including Python, many calls with one
   synchronize at the end, for portattn.flash_attn_func, CudaBackend.forward alone and
   SDPA with no backend forced (forcing one through sdpa_kernel adds ~30 us).
3. Peak memory of one forward (and with --backward one forward+backward) at B=1, H=16,
   S=32k, hd 128.
Results: <out>/<name>.{json,md,png} (default hopper_bench) with device, date, commit
(PORTATTN_COMMIT) and versions; a compact table is printed last. `--dry-run` runs on the
CPU with fake timings (checks the plumbing, measures nothing).
"""
from __future__ import annotations

import argparse
import os
import time

import torch

import peers

GRID_BUDGET_S = 300  # the device call's hard limit is 600 s; the grid stops here, tables still written


def _wall_us(fn, calls):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def bench_overhead(batches, head_dims, seqlens, calls):
    import torch.nn.functional as F

    import portattn

    kernel_bind, why = peers.load_impl("sm80_kernel")
    rows = []
    for batch in batches:
        for head_dim in head_dims:
            for seqlen in seqlens:
                q, k, v = (torch.randn(batch, seqlen, 16, head_dim, device="cuda", dtype=torch.bfloat16)
                           for _ in range(3))
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                ours = _wall_us(lambda: portattn.flash_attn_func(q, k, v), calls)
                backend_only = _wall_us(kernel_bind(q, k, v, False), calls) if kernel_bind else None
                sdpa = _wall_us(lambda: F.scaled_dot_product_attention(qt, kt, vt), calls)
                rows.append({"batch": batch, "heads": 16, "head_dim": head_dim, "seqlen": seqlen,
                             "portattn_us": ours, "backend_only_us": backend_only, "sdpa_auto_us": sdpa,
                             "ratio": ours / sdpa})
                print(f"overhead b{batch} hd{head_dim} s{seqlen}: portattn {ours:7.1f} us  backend.forward "
                      f"{peers.fmt_num(backend_only, 1):>7} us  sdpa {sdpa:7.1f} us", flush=True)
    if why:
        print(f"overhead: CudaBackend.forward n/a: {why}")
    return rows


def bench_memory(seqlen=32768, heads=16, head_dim=128):
    import portattn

    q, k, v = (torch.randn(1, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    portattn.flash_attn_func(q, k, v)  # warm-up: dispatch and self-check allocate once
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = portattn.flash_attn_func(q, k, v)
    torch.cuda.synchronize()
    peak_extra = torch.cuda.max_memory_allocated() - before
    element = q.element_size()
    expected = seqlen * heads * head_dim * element + heads * seqlen * 4  # out + lse
    del out
    return {"batch": 1, "heads": heads, "seqlen": seqlen, "head_dim": head_dim,
            "inputs_bytes": 3 * q.numel() * element, "peak_extra_bytes": peak_extra,
            "out_plus_lse_bytes": expected}


def merge_processes(results: list) -> list:
    """The grid rows of several processes' runs of the same grid: per cell and implementation the
    median TFLOP/s and ms over the processes that measured it, and `spread` = [min, max] TFLOP/s."""
    import statistics

    rows = [dict(row) for row in results[0]["grid"]]
    for index, row in enumerate(rows):
        row["tflops"], row["ms"], row["spread"] = {}, {}, {}
        for mode in results[0]["grid"][index]["tflops"]:
            for impl in set().union(*(r["grid"][index]["tflops"].get(mode, {}) for r in results)):
                tflops = [r["grid"][index]["tflops"][mode][impl] for r in results
                          if r["grid"][index]["tflops"].get(mode, {}).get(impl) is not None]
                times = [r["grid"][index]["ms"][mode][impl] for r in results
                         if r["grid"][index]["ms"].get(mode, {}).get(impl) is not None]
                if not tflops:
                    continue
                row["tflops"].setdefault(mode, {})[impl] = statistics.median(tflops)
                row["ms"].setdefault(mode, {})[impl] = statistics.median(times)
                row["spread"].setdefault(mode, {})[impl] = [min(tflops), max(tflops)]
    return rows


def spread_markdown(result) -> list:
    """Per cell, portattn's and the first peer's lowest and highest TFLOP/s across the processes."""
    if not result.get("processes") or result["processes"] < 2:
        return []
    peer = next((name for name in result["impls"] if name != "portattn"), None)
    lines = ["## Spread across processes (lowest - highest TFLOP/s)", "",
             f"Each cell above is the median of {result['processes']} fresh processes' runs of the grid.", "",
             "| hd | seqlen | causal | mode | portattn | " + (peer or "") + " |", "|---|---|---|---|---|---|"]
    for row in result["grid"]:
        for mode, by_impl in row.get("spread", {}).items():
            cells = [f"{by_impl[name][0]:.1f} - {by_impl[name][1]:.1f}" if name in by_impl else "n/a"
                     for name in ("portattn", peer)]
            lines.append(f"| {row['head_dim']} | {row['seqlen']} | {row['causal']} | {mode} | {cells[0]} | {cells[1]} |")
    return lines + [""]


def run_in_processes(args, count: int) -> list:
    """The grid in `count` fresh processes (this script with --processes 1, --grid-only), their results."""
    import json
    import subprocess
    import sys
    import tempfile

    forwarded, skip_value = [], False
    for arg in sys.argv[1:]:  # every argument but --processes (and its value)
        if skip_value:
            skip_value = False
        elif arg == "--processes":
            skip_value = True
        elif not arg.startswith("--processes="):
            forwarded.append(arg)
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for index in range(count):
            out = os.path.join(scratch, f"p{index}")
            command = [sys.executable, os.path.abspath(__file__), *forwarded, "--processes", "1", "--grid-only",
                       "--out", out, "--name", "grid", "--tag", ""]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"grid process {index} failed: {(done.stderr or done.stdout)[-2000:]}")
            with open(os.path.join(out, "grid.json")) as handle:
                results.append(json.load(handle))
            print(f"grid process {index + 1} of {count} done", flush=True)
    return results


def extra_markdown(result) -> list:
    lines = spread_markdown(result)
    if result.get("overhead"):
        lines += ["## Small-problem wall time per call (us, host included, no sync in the loop)", "",
                  "backend.forward = CudaBackend.forward alone with preallocated outputs (no validation, "
                  "dispatch or allocation).", "",
                  "| batch | hd | seqlen | portattn | backend.forward | SDPA (auto) | portattn / SDPA |",
                  "|---|---|---|---|---|---|---|"]
        for r in result["overhead"]:
            lines.append(f"| {r['batch']} | {r['head_dim']} | {r['seqlen']} | {r['portattn_us']:.1f} | "
                         f"{peers.fmt_num(r['backend_only_us'], 1)} | {r['sdpa_auto_us']:.1f} | {r['ratio']:.2f} |")
        lines.append("")
    if result.get("memory"):
        m = result["memory"]
        lines += ["## Memory", "",
                  f"Forward, B=1, H={m['heads']}, S={m['seqlen']}, hd {m['head_dim']}: peak allocated beyond the "
                  f"inputs {m['peak_extra_bytes'] / 2**20:.1f} MiB; out + lse = {m['out_plus_lse_bytes'] / 2**20:.1f} "
                  f"MiB (inputs {m['inputs_bytes'] / 2**20:.1f} MiB).", ""]
    if result.get("memory_fwd_bwd"):
        import bench_backward

        lines += bench_backward.memory_markdown(result["memory_fwd_bwd"])
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backward", action="store_true", help="also forward+backward (and backward alone)")
    parser.add_argument("--quick", action="store_true", help="seqlens 512, 2048, 8192 (smoke run)")
    parser.add_argument("--seqlens", default=None, help="grid seqlens, comma separated (default 512..16384)")
    parser.add_argument("--head-dims", default="128,64",
                        help="grid head dims, comma separated, in run order (hd128 first: if the time budget "
                             "runs out, the points it cuts are hd64's)")
    parser.add_argument("--impls", default="portattn,portattn_sm80,sdpa_flash,sdpa_cudnn,flex,fa4",
                        help=f"columns, comma separated, from: {', '.join(peers.IMPLS)}")
    parser.add_argument("--skip", default="", help="columns to leave out of --impls (e.g. flex)")
    parser.add_argument("--kernel-only", action="store_true",
                        help="tuning runs: only CudaBackend.forward, grid only (= --impls sm80_kernel --grid-only)")
    parser.add_argument("--grid-only", action="store_true", help="skip the overhead and memory parts")
    parser.add_argument("--budget-s", type=float, default=GRID_BUDGET_S,
                        help="grid time budget; cells after it are n/a (default %(default)s)")
    parser.add_argument("--rep-ms", type=int, default=80, help="do_bench rep (ms) per cell")
    parser.add_argument("--warmup-ms", type=int, default=20, help="do_bench warmup (ms) per cell")
    parser.add_argument("--out", default=peers.LATEST)
    parser.add_argument("--name", default="hopper_bench", help="result file name (without extension)")
    parser.add_argument("--tag", default="", help="suffix of the result file names")
    parser.add_argument("--processes", type=int, default=1,
                        help="run the grid in this many fresh processes and report each cell's median (and the "
                             "spread); a single process's cell moves by up to 6%% from one process to the next "
                             "(docs/kernels-hopper.md)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, fake timings: checks the plumbing only")
    args = parser.parse_args()
    peers.require_device(args.dry_run)
    if args.kernel_only:
        args.impls, args.grid_only = "sm80_kernel", True
    skipped = set(args.skip.split(","))
    impls = [impl for impl in peers.select(args.impls) if impl.name not in skipped]
    seqlens = (peers.parse_ints(args.seqlens) if args.seqlens
               else [512, 2048, 8192] if args.quick else list(peers.SEQLENS))
    modes = ["fwd", "fwd_bwd"] if args.backward else ["fwd"]
    name = args.name + args.tag

    result = dict(peers.header(args.dry_run), title="Attention benchmark: portattn and its peers",
                  impls=[impl.name for impl in impls], modes=modes, grid=[],
                  note="TFLOP/s; n/a = could not run (reason below the tables).")

    def save(rows):  # after every point, so a killed run still leaves its tables
        result["grid"] = rows
        peers.write_results(result, args.out, name, extra_markdown(result))

    if args.processes > 1:
        result["processes"] = args.processes
        result["note"] += f" Each cell: the median of {args.processes} fresh processes (spread below the tables)."
        save(merge_processes(run_in_processes(args, args.processes)))
    else:
        timer = peers.Timer(args.warmup_ms, args.rep_ms, dry_run=args.dry_run)
        save(peers.run_grid(peers.grid(peers.parse_ints(args.head_dims), seqlens), impls, modes, timer,
                            args.budget_s, on_point=save))
    if not args.grid_only and not args.dry_run:
        result["overhead"] = bench_overhead([2, 512], [16, 64], [50, 150, 300], 200 if args.quick else 2000)
        result["memory"] = bench_memory()
        if args.backward:
            import bench_backward

            result["memory_fwd_bwd"] = bench_backward.bench_memory()
        save(result["grid"])
    print(peers.compact_table(result))
    print(f"results: {os.path.join(args.out, name)}.{{json,md,png}}")


if __name__ == "__main__":
    main()
