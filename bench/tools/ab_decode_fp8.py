"""The FP8 decode's two paths timed against each other on one GPU (PORTATTN_DECODE_FP8_PATH:
"smem", the conversion pass through a 16-bit stage, and "regs", the register fragments; Note
[portattn fp8 register fragments] in docs/decode.md).

  python bench/tools/ab_decode_fp8.py [--batches 1,8,64] [--caches 4096,32768,131072] [--heads 32/8]
                                      [--head-dim 128] [--rounds 5] [--hbm-tbps auto] [--out DIR]

One build serves both: the path is switched in-process (`_C.decode_fp8_path`) and each path's decode
step, bf16 query on an e4m3 cache with per-(sequence, head) descales (bench_decode.py's fp8_point
inputs), is captured in its own CUDA graph (the path is taken when the launch is recorded). Rounds
alternate the two graphs, starting with the other path each round, so that clock and thermal drift
hit both alike; a cell's time is the median over rounds of bench_decode.py's timer (triton do_bench
median of replays, L2 flushed). Layouts: a contiguous cache and a 16-token paged cache over the same
storage (pages shuffled). The bf16 cache holding the same values is timed once per cell for the
FP8 / bf16 speedup, where it fits.

Before any timing, each cell checks the regs path against the smem path: both outputs of the full
call, and against a float64 oracle on batch entry 0 with the tests' error rule (tests/error_rule.py:
max|out - oracle| <= 2 x bf16 torch's error + 1e-5). A failing cell is not timed, is reported, and
makes the exit status 1.

share = bytes of K and V (1 a value) / time / peak DRAM bandwidth (--hbm-tbps; "auto" knows the
H100 SXM's 3.35 and the H200's 4.8 TB/s). Cells whose FP8 K+V exceed bench_decode.py's
MAX_CACHE_BYTES are skipped with the reason. Writes <out>/ab_decode_fp8.{json,md}.
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

PATHS = ("smem", "regs")
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
        C.decode_fp8_path(before if before != "invalid" else "smem")


def _oracle(q, k, v, compute_dtype):
    """Attention of q (1, 1, Hq, D) over k, v (n, Hk, D) computed in compute_dtype: (1, 1, Hq, D)."""
    heads, dim = q.shape[2], q.shape[3]
    heads_k = k.shape[1]
    qg = q[0, 0].to(compute_dtype).view(heads_k, heads // heads_k, dim)
    k, v = k.to(compute_dtype), v.to(compute_dtype)
    s = torch.einsum("hgd,nhd->hgn", qg, k) * (1.0 / math.sqrt(dim))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("hgn,nhd->hgd", p, v).reshape(1, 1, heads, dim)


def _check(C, calls, logical_k, logical_v, q):
    """None when both paths pass the error rule on batch entry 0 and agree elsewhere; else the reason."""
    outs = {path: _with_path(C, path, calls) for path in PATHS}
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
    gap = max_error(outs["regs"], outs["smem"])
    scale = outs["smem"].double().abs().max().item()
    if gap > 4 * base + FLOOR * max(1.0, scale):
        return f"regs and smem outputs differ by {gap:.3e} (4 x bf16 torch error on entry 0: {4 * base:.3e})"
    return None


def ab_point(C, batch, cache, heads, heads_k, head_dim, ms, rounds, hbm_tbps):
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
            why = _check(C, call, logical_k, logical_v, q)
            del logical_k, logical_v
            if why is not None:
                row["na"][layout] = "CHECK FAILED: " + why
                row["failed"] = True
                continue
            graphs = {path: _with_path(C, path, lambda: bench_decode._graphed(call)) for path in PATHS}
            times = {path: [] for path in PATHS}
            for r in range(rounds):
                for path in (PATHS if r % 2 == 0 else PATHS[::-1]):
                    times[path].append(ms(graphs[path], f"{layout}{path}{batch}{cache}{r}") * 1e3)
            for path in PATHS:
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


def markdown(rows) -> list:
    lines = ["| batch | cache | Hq/Hk | hd | layout | smem us | share | regs us | share | regs / smem (time) | "
             "bf16 cache us | bf16 / smem | bf16 / regs |", "|---" * 13 + "|"]
    notes = []
    for row in rows:
        head = f"| {row['batch']} | {row['cache']} | {row['heads']}/{row['heads_k']} | {row['head_dim']} |"
        if "all" in row["na"]:
            lines.append(head + " all |" + " n/a |" * 8)
            notes.append(f"{row['batch']} x {row['cache']}: {row['na']['all']}")
            continue
        bf16 = row["us"].get("bf16")
        for layout in ("contiguous", "paged16"):
            smem, regs = row["us"].get(f"{layout}_smem"), row["us"].get(f"{layout}_regs")
            share = lambda us: None if us is None else row["bound_us"] / us  # noqa: E731
            speed = lambda a, b: None if a is None or b is None else a / b  # noqa: E731
            bf = bf16 if layout == "contiguous" else None
            lines.append(f"{head} {layout} | {_fmt(smem, 1)} | {_fmt(share(smem), 2)} | {_fmt(regs, 1)} | "
                         f"{_fmt(share(regs), 2)} | {_fmt(speed(regs, smem), 3)} | {_fmt(bf, 1)} | "
                         f"{_fmt(speed(bf, smem), 2)} | {_fmt(speed(bf, regs), 2)} |")
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
    parser.add_argument("--out", default=peers.SCRATCH)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: the A/B times kernels on a GPU")
    from portattn.backends.cuda import _C

    if _C is None or not hasattr(_C, "decode_fp8_path"):
        raise SystemExit("this build of the CUDA backend has no _C.decode_fp8_path (build this tree first)")
    hbm_tbps = _peak_tbps(args.hbm_tbps)
    ms = bench_decode._timer(False)
    rows = []
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]
    for batch in peers.parse_ints(args.batches):
        for cache in peers.parse_ints(args.caches):
            for hq, hk in heads:
                row = ab_point(_C, batch, cache, hq, hk, args.head_dim, ms, args.rounds, hbm_tbps)
                rows.append(row)
                print("\n".join(line for line in markdown([row])[2:] if line), flush=True)
                torch.cuda.empty_cache()
    failed = [r for r in rows if r.get("failed")]
    result = dict(peers.header(False), title="FP8 decode: smem (conversion pass) vs regs (register fragments)",
                  note=(f"bf16 query, e4m3 cache with descales, CUDA-graph replay; median over {args.rounds} "
                        f"interleaved rounds of do_bench medians; share = FP8 K+V bytes / time / {hbm_tbps} TB/s; "
                        "regs / smem < 1: regs faster. Each cell checked regs against smem and a float64 oracle "
                        "before timing" + (f"; {len(failed)} cell(s) FAILED the check" if failed else ".")),
                  hbm_tbps=hbm_tbps, rows=rows)
    lines = markdown(rows)
    path = peers.write_results(result, args.out, "ab_decode_fp8", lines)
    print("\n".join(lines))
    print("wrote", path)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
