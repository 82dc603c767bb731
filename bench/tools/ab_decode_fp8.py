"""The FP8 decode's paths timed against each other on one GPU (PORTATTN_DECODE_FP8_PATH: "smem", the
conversion pass through a 16-bit stage; "regs", the register fragments, the default; "regs_deep", the
same with a 5-stage ring; Notes [portattn fp8 register fragments] and [portattn fp8 deep pipeline] in
docs/decode.md).

  python bench/tools/ab_decode_fp8.py [--batches 1,8,64] [--caches 4096,32768,131072] [--heads 32/8]
                                      [--head-dim 128] [--rounds 5] [--hbm-tbps auto] [--paths ...] [--out DIR]

One build serves every path: the path is switched in-process (`_C.decode_fp8_path`) and each path's
decode step, bf16 query on an e4m3 cache with per-(sequence, head) descales (bench_decode.py's fp8_point
inputs), is captured in its own CUDA graph (the path and its split plan are taken when the launch is
recorded; each path plans with its own kernel's occupancy). Rounds go through the paths in turn, starting
one path later each round, so that clock and thermal drift hit all alike; a cell's time is the median over
rounds of bench_decode.py's timer (triton do_bench median of replays, L2 flushed). Layouts: a contiguous
cache and a 16-token paged cache over the same storage (pages shuffled). The bf16 cache holding the same
values is timed once per cell for the FP8 / bf16 speedup, where it fits.

Before any timing, each cell checks every path: the full call's output against the first path's, and
against a float64 oracle on batch entry 0 with the tests' error rule (tests/error_rule.py:
max|out - oracle| <= 2 x bf16 torch's error + 1e-5). A failing cell is not timed, is reported, and
makes the exit status 1.

share = bytes of K and V (1 a value) / time / peak DRAM bandwidth (--hbm-tbps; "auto" knows the
H100 SXM's 3.35 and the H200's 4.8 TB/s). Columns: each path's time and share, the bf16 cache's time,
regs_deep / regs (time; < 1: regs_deep faster) and bf16 / best (the bf16 cache's time over the fastest
FP8 path's: the FP8 speedup). Cells whose FP8 K+V exceed bench_decode.py's MAX_CACHE_BYTES are skipped
with the reason. Writes <out>/ab_decode_fp8.{json,md}.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

import torch

_BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _BENCH)  # peers.py, bench_decode.py
sys.path.insert(0, os.path.join(os.path.dirname(_BENCH), "tests"))  # error_rule.py
import bench_decode  # noqa: E402
import peers  # noqa: E402
from error_rule import FLOOR, OUT_FACTOR, max_error  # noqa: E402

PATHS = ("smem", "regs", "regs_deep")
PEAK_TBPS = {"H200": 4.8, "H100 80GB HBM3": 3.35}  # device-name substring -> DRAM peak, TB/s


def _peak_tbps(text: str) -> float:
    if text != "auto":
        return float(text)
    name = torch.cuda.get_device_name()
    for key, tbps in PEAK_TBPS.items():
        if key in name:
            return tbps
    raise SystemExit(f"--hbm-tbps auto does not know the peak of '{name}'; pass it")


def _with_path(C, path, fn):
    before = C.decode_fp8_path()
    C.decode_fp8_path(path)
    try:
        return fn()
    finally:
        C.decode_fp8_path(before if before != "invalid" else "regs")


def _oracle(q, k, v, compute_dtype):
    """Attention of q (1, 1, Hq, D) over k, v (n, Hk, D) computed in compute_dtype: (1, 1, Hq, D)."""
    heads, dim = q.shape[2], q.shape[3]
    heads_k = k.shape[1]
    qg = q[0, 0].to(compute_dtype).view(heads_k, heads // heads_k, dim)
    k, v = k.to(compute_dtype), v.to(compute_dtype)
    s = torch.einsum("hgd,nhd->hgn", qg, k) * (1.0 / math.sqrt(dim))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("hgn,nhd->hgd", p, v).reshape(1, 1, heads, dim)


def _check(C, paths, calls, logical_k, logical_v, q):
    """None when every path passes the error rule on batch entry 0 and they agree elsewhere; else the reason."""
    outs = {path: _with_path(C, path, calls) for path in paths}
    torch.cuda.synchronize()
    for path, out in outs.items():
        if out.isnan().any():
            return f"{path} output has NaN"
    k0, v0 = logical_k[0], logical_v[0]  # dequantised (cache, Hk, D) of batch entry 0
    oracle = _oracle(q[:1], k0.double(), v0.double(), torch.float64)
    low = _oracle(q[:1], k0.to(q.dtype), v0.to(q.dtype), q.dtype)
    base = max_error(low, oracle)
    for path, out in outs.items():
        err = max_error(out[:1], oracle)
        if err > OUT_FACTOR * base + FLOOR:
            return f"{path} error {err:.3e} > {OUT_FACTOR:g} x bf16 torch error {base:.3e} on batch entry 0"
    # Every batch entry: the paths differ only in fp32 summation order and the output's rounding.
    first = paths[0]
    scale = outs[first].double().abs().max().item()
    for path in paths[1:]:
        gap = max_error(outs[path], outs[first])
        if gap > 4 * base + FLOOR * max(1.0, scale):
            return f"{path} and {first} outputs differ by {gap:.3e} (4 x bf16 torch error on entry 0: {4 * base:.3e})"
    return None


def ab_point(C, paths, batch, cache, heads, heads_k, head_dim, ms, rounds, hbm_tbps):
    values = batch * cache * heads_k * head_dim
    fp8_bytes = 2 * values
    row = {"batch": batch, "cache": cache, "heads": heads, "heads_k": heads_k, "head_dim": head_dim,
           "bytes": fp8_bytes, "bound_us": fp8_bytes / (hbm_tbps * 1e12) * 1e6, "us": {}, "rounds": {}, "na": {}}
    if fp8_bytes > bench_decode.MAX_CACHE_BYTES:
        row["na"]["all"] = (f"FP8 K+V = {fp8_bytes / 2**30:.0f} GiB > the benchmark's "
                            f"{bench_decode.MAX_CACHE_BYTES >> 30} GiB cap")
        return row
    import portattn

    dtype, device = torch.bfloat16, "cuda"
    q = torch.randn(batch, 1, heads, head_dim, device=device, dtype=dtype)
    k8 = (torch.randn(batch, cache, heads_k, head_dim, device=device) * 8).clamp(-448, 448).to(torch.float8_e4m3fn)
    v8 = (torch.randn(batch, cache, heads_k, head_dim, device=device) * 8).clamp(-448, 448).to(torch.float8_e4m3fn)
    k_descale = torch.rand(batch, heads_k, device=device) / 8 + 0.01
    v_descale = torch.rand(batch, heads_k, device=device) / 8 + 0.01
    seqlens = torch.full((batch,), cache, dtype=torch.int32, device=device)
    pages = batch * cache // 16
    table = torch.randperm(pages, device=device).reshape(batch, cache // 16).to(torch.int32)
    # The paged layout over the same bytes: logical row j of sequence b lives on page table[b, j // 16].
    kp, vp = k8.view(pages, 16, heads_k, head_dim), v8.view(pages, 16, heads_k, head_dim)
    layouts = {
        "contiguous": (lambda: portattn.flash_attn_with_kvcache(
            q, k8, v8, cache_seqlens=seqlens, k_descale=k_descale, v_descale=v_descale), k8, v8),
        "paged16": (lambda: portattn.flash_attn_with_kvcache(
            q, kp, vp, cache_seqlens=seqlens, block_table=table, k_descale=k_descale, v_descale=v_descale),
            kp[table[0].long()].reshape(1, cache, heads_k, head_dim), vp[table[0].long()].reshape(1, cache, heads_k,
                                                                                                  head_dim)),
    }
    with torch.no_grad():
        for layout, (call, keys, vals) in layouts.items():
            logical_k = keys[:1].float() * k_descale[:1, None, :, None]
            logical_v = vals[:1].float() * v_descale[:1, None, :, None]
            why = _check(C, paths, call, logical_k, logical_v, q)
            del logical_k, logical_v
            if why is not None:
                row["na"][layout] = "CHECK FAILED: " + why
                row["failed"] = True
                continue
            graphs = {path: _with_path(C, path, lambda: bench_decode._graphed(call)) for path in paths}
            times = {path: [] for path in paths}
            for r in range(rounds):
                shift = r % len(paths)
                for path in paths[shift:] + paths[:shift]:
                    times[path].append(ms(graphs[path], f"{layout}{path}{batch}{cache}{r}") * 1e3)
            for path in paths:
                row["rounds"][f"{layout}_{path}"] = times[path]
                row["us"][f"{layout}_{path}"] = statistics.median(times[path])
            del graphs
        if 4 * values <= bench_decode.MAX_CACHE_BYTES:
            kb = (k8.float() * k_descale[:, None, :, None]).to(dtype)
            vb = (v8.float() * v_descale[:, None, :, None]).to(dtype)
            replay = bench_decode._graphed(lambda: portattn.flash_attn_with_kvcache(q, kb, vb, cache_seqlens=seqlens))
            row["us"]["bf16"] = ms(replay, f"bf16{batch}{cache}") * 1e3
            del kb, vb, replay
        else:
            row["na"]["bf16"] = f"bf16 K+V = {4 * values / 2**30:.0f} GiB > the cap"
    return row


def _fmt(x, digits):
    return "n/a" if x is None else f"{x:.{digits}f}"


def markdown(rows, paths=PATHS) -> list:
    columns = [f"{path} us | share" for path in paths] + ["bf16 cache us"]
    ratios = ["regs_deep / regs (time)"] if {"regs", "regs_deep"} <= set(paths) else []
    ratios.append("bf16 / best")
    header = "| batch | cache | Hq/Hk | hd | layout | " + " | ".join(columns + ratios) + " |"
    width = 5 + 2 * len(paths) + 1 + len(ratios)
    lines = [header, "|---" * width + "|"]
    notes = []
    for row in rows:
        head = f"| {row['batch']} | {row['cache']} | {row['heads']}/{row['heads_k']} | {row['head_dim']} |"
        if "all" in row["na"]:
            lines.append(head + " all |" + " n/a |" * (width - 5))
            notes.append(f"{row['batch']} x {row['cache']}: {row['na']['all']}")
            continue
        bf16 = row["us"].get("bf16")
        for layout in ("contiguous", "paged16"):
            us = {path: row["us"].get(f"{layout}_{path}") for path in paths}
            share = lambda t: None if t is None else row["bound_us"] / t  # noqa: E731
            speed = lambda a, b: None if a is None or b is None else a / b  # noqa: E731
            bf = bf16 if layout == "contiguous" else None
            timed = [t for t in us.values() if t is not None]
            best = min(timed) if timed else None
            cells = [f"{_fmt(us[path], 1)} | {_fmt(share(us[path]), 2)}" for path in paths] + [_fmt(bf, 1)]
            if ratios[0].startswith("regs_deep"):
                cells.append(_fmt(speed(us["regs_deep"], us["regs"]), 3))
            cells.append(_fmt(speed(bf, best), 2))
            lines.append(f"{head} {layout} | " + " | ".join(cells) + " |")
            if layout in row["na"]:
                notes.append(f"{row['batch']} x {row['cache']} {layout}: {row['na'][layout]}")
    return lines + [""] + [f"- {note}" for note in notes]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--caches", default="4096,32768,131072")
    parser.add_argument("--heads", default="32/8")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hbm-tbps", default="auto")
    parser.add_argument("--paths", default=",".join(PATHS), help="FP8 paths to time, comma-separated")
    parser.add_argument("--out", default=peers.SCRATCH)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: the A/B times kernels on a GPU")
    from portattn.backends.cuda import _C

    if _C is None or not hasattr(_C, "decode_fp8_path"):
        raise SystemExit("this build of the CUDA backend has no _C.decode_fp8_path (build this tree first)")
    paths = tuple(p for p in args.paths.split(",") if p)
    if not paths or any(p not in PATHS for p in paths):
        raise SystemExit(f"--paths: choose from {', '.join(PATHS)}")
    if len(set(paths)) != len(paths):
        raise SystemExit("--paths: each path once")
    hbm_tbps = _peak_tbps(args.hbm_tbps)
    ms = bench_decode._timer(False)
    rows = []
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]
    for batch in peers.parse_ints(args.batches):
        for cache in peers.parse_ints(args.caches):
            for hq, hk in heads:
                row = ab_point(_C, paths, batch, cache, hq, hk, args.head_dim, ms, args.rounds, hbm_tbps)
                rows.append(row)
                print("\n".join(line for line in markdown([row], paths)[2:] if line), flush=True)
                torch.cuda.empty_cache()
    failed = [r for r in rows if r.get("failed")]
    result = dict(peers.header(False), title="FP8 decode: " + " vs ".join(paths),
                  note=(f"bf16 query, e4m3 cache with descales, CUDA-graph replay; median over {args.rounds} "
                        f"rotated rounds of do_bench medians; share = FP8 K+V bytes / time / {hbm_tbps} TB/s; "
                        "regs_deep / regs < 1: regs_deep faster; bf16 / best: the bf16 cache's time over the "
                        "fastest FP8 path's. Each cell checked every path against the first and a float64 "
                        "oracle before timing" + (f"; {len(failed)} cell(s) FAILED the check" if failed else ".")),
                  hbm_tbps=hbm_tbps, paths=list(paths), rows=rows)
    lines = markdown(rows, paths)
    path = peers.write_results(result, args.out, "ab_decode_fp8", lines)
    print("\n".join(lines))
    print("wrote", path)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
