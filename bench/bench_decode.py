"""Decode benchmark: one new query token (or a few) against a KV cache, portattn vs SDPA.

  python bench/bench_decode.py [--batches 1,16,64] [--caches 4096,8192,32768] [--head-dims 64,128,256]
                               [--heads 32/8,32/32] [--short-query] [--kv-dtype bf16|fp8]
                               [--out bench/results/latest] [--dry-run]

Columns, side by side in one run (bf16):
- portattn `flash_attn_with_kvcache` on a contiguous cache (batch, cache, Hk, D) with
  `cache_seqlens`, and on paged caches (page 16 and 256, pages shuffled) over the same
  storage; eager calls, and the same step replayed from a CUDA graph (no host cost);
- SDPA (default backend choice, `enable_gqa=True`) on the same keys laid out as it wants
  them, (batch, Hk, cache, D) contiguous, eager and graphed.
"bound" is the time to read K and V once at the HBM peak (3.35 TB/s on an H100 SXM; set
--hbm-tbps for another part); "share" is bound / time. Timing: triton's do_bench (median,
L2 flushed between calls). `--short-query` adds flash_attn_func with seqlen_q 1-16 against
4k-8k keys (GQA 32/8, hd 128) vs SDPA. `--kv-dtype fp8` measures instead, CUDA-graph replay
only, an FP8 (e4m3) cache with per-(sequence, head) descales (contiguous and paged 16) against
the bf16 cache holding the same (dequantised) values and SDPA on that bf16 cache; each
column's share is its own bytes of K and V (1 byte a value for FP8, 2 for bf16) / time / peak.
Results: <out>/decode_bench.{json,md,png} (--name names them).
`--dry-run` runs tiny shapes on the CPU with fake timings (plumbing only).
"""
from __future__ import annotations

import argparse
import math
import zlib

import torch

import peers

MAX_CACHE_BYTES = 12 << 30  # K+V of one layout; SDPA's copy doubles it (80 GB part)


def _timer(dry_run):
    def ms(fn, salt):
        if dry_run:
            fn()
            return 0.01 + zlib.crc32(salt.encode()) % 1000 / 1000.0
        from triton.testing import do_bench

        return do_bench(fn, warmup=10, rep=60, return_mode="median")
    return ms


def _graphed(fn):
    """A CUDA graph of one call (warmed up on a side stream first); returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def decode_point(batch, cache, heads, heads_k, head_dim, device, ms, dry_run, hbm_tbps):
    import torch.nn.functional as F

    import portattn

    row = {"batch": batch, "cache": cache, "heads": heads, "heads_k": heads_k, "head_dim": head_dim,
           "us": {}, "na": {}}
    kv_bytes = 2 * batch * cache * heads_k * head_dim * 2
    row["bound_us"] = kv_bytes / (hbm_tbps * 1e12) * 1e6
    if kv_bytes > MAX_CACHE_BYTES:
        row["na"]["all"] = f"K+V = {kv_bytes / 2**30:.0f} GiB > the benchmark's {MAX_CACHE_BYTES >> 30} GiB cap"
        return row
    dtype = torch.bfloat16
    q = torch.randn(batch, 1, heads, head_dim, device=device, dtype=dtype)
    k = torch.randn(batch, cache, heads_k, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    seqlens = torch.full((batch,), cache, dtype=torch.int32, device=device)
    calls = {
        "contiguous": lambda: portattn.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens),
    }
    for page in (16, 256):
        if cache % page:
            row["na"][f"paged{page}"] = f"cache {cache} is not a multiple of the page size {page}"
            continue
        pages = batch * cache // page
        table = torch.randperm(pages, device=device).reshape(batch, cache // page).to(torch.int32)
        kp, vp = k.view(pages, page, heads_k, head_dim), v.view(pages, page, heads_k, head_dim)
        calls[f"paged{page}"] = (lambda kp=kp, vp=vp, table=table:
                                 portattn.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=seqlens, block_table=table))
    qt = q.transpose(1, 2).contiguous()
    kt, vt = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    calls["sdpa"] = lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=heads != heads_k)
    for name, fn in calls.items():
        try:
            with torch.no_grad():
                row["us"][name] = ms(fn, f"{name}{batch}{cache}{head_dim}") * 1e3
                if not dry_run:
                    row["us"][name + "_graph"] = ms(_graphed(fn), f"g{name}{batch}{cache}") * 1e3
        except Exception as error:  # one cell's failure must not end the run
            row["na"][name] = peers._reason(error)
    del q, k, v, kt, vt, qt, calls
    return row


FP8_COLUMNS = ("fp8", "fp8_paged16", "bf16", "sdpa")


def fp8_point(batch, cache, heads, heads_k, head_dim, device, ms, dry_run, hbm_tbps):
    """CUDA-graph times of one decode step on an FP8 cache, the same values in a bf16 cache, and
    SDPA on that bf16 cache; bytes and share of the bound per column."""
    import torch.nn.functional as F

    import portattn

    values = batch * cache * heads_k * head_dim
    row = {"batch": batch, "cache": cache, "heads": heads, "heads_k": heads_k, "head_dim": head_dim,
           "us": {}, "na": {}, "bytes": {"fp8": 2 * values, "fp8_paged16": 2 * values, "bf16": 4 * values,
                                          "sdpa": 4 * values}}
    row["bound_us"] = {name: nbytes / (hbm_tbps * 1e12) * 1e6 for name, nbytes in row["bytes"].items()}
    if 2 * values > MAX_CACHE_BYTES:
        row["na"]["all"] = f"FP8 K+V = {2 * values / 2**30:.0f} GiB > the benchmark's {MAX_CACHE_BYTES >> 30} GiB cap"
        return row
    dtype = torch.bfloat16
    q = torch.randn(batch, 1, heads, head_dim, device=device, dtype=dtype)
    k8 = (torch.randn(batch, cache, heads_k, head_dim, device=device) * 8).clamp(-448, 448).to(torch.float8_e4m3fn)
    v8 = (torch.randn(batch, cache, heads_k, head_dim, device=device) * 8).clamp(-448, 448).to(torch.float8_e4m3fn)
    k_descale = torch.rand(batch, heads_k, device=device) / 8
    v_descale = torch.rand(batch, heads_k, device=device) / 8
    seqlens = torch.full((batch,), cache, dtype=torch.int32, device=device)
    calls = {"fp8": lambda: portattn.flash_attn_with_kvcache(q, k8, v8, cache_seqlens=seqlens, k_descale=k_descale,
                                                             v_descale=v_descale)}
    if cache % 16 == 0:
        pages = batch * cache // 16
        table = torch.randperm(pages, device=device).reshape(batch, cache // 16).to(torch.int32)
        kp, vp = k8.view(pages, 16, heads_k, head_dim), v8.view(pages, 16, heads_k, head_dim)
        calls["fp8_paged16"] = lambda: portattn.flash_attn_with_kvcache(
            q, kp, vp, cache_seqlens=seqlens, block_table=table, k_descale=k_descale, v_descale=v_descale)
    # The bf16 cache (and SDPA's (batch, Hk, cache, D) copy of it) only where they fit beside the FP8 one.
    if 4 * values * 2 <= 2 * MAX_CACHE_BYTES:
        kb = (k8.float() * k_descale[:, None, :, None]).to(dtype)
        vb = (v8.float() * v_descale[:, None, :, None]).to(dtype)
        calls["bf16"] = lambda: portattn.flash_attn_with_kvcache(q, kb, vb, cache_seqlens=seqlens)
        qt, kt, vt = q.transpose(1, 2).contiguous(), kb.transpose(1, 2).contiguous(), vb.transpose(1, 2).contiguous()
        calls["sdpa"] = lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=heads != heads_k)
    else:
        for name in ("bf16", "sdpa"):
            row["na"][name] = f"bf16 K+V = {4 * values / 2**30:.0f} GiB beside the FP8 cache exceeds the cap"
    for name, fn in calls.items():
        try:
            with torch.no_grad():
                row["us"][name] = ms(fn if dry_run else _graphed(fn), f"f{name}{batch}{cache}{head_dim}") * 1e3
        except Exception as error:  # one cell's failure must not end the run
            row["na"][name] = peers._reason(error)
    del calls
    return row


def fp8_markdown(result) -> list:
    lines = ["## Decode on an FP8 (e4m3) KV cache, bf16 query; CUDA-graph replay, us per call "
             "(share = bytes of K and V / time / peak)", "",
             "| batch | cache | Hq/Hk | hd | FP8 | share | FP8 paged 16 | share | bf16 cache | share | "
             "SDPA (bf16) | share | bf16 / FP8 | SDPA / FP8 |", "|---" * 14 + "|"]
    for r in result["fp8"]:
        us = r["us"]
        share = lambda name: None if us.get(name) is None else r["bound_us"][name] / us[name]
        ratio = lambda a: None if us.get(a) is None or us.get("fp8") is None else us[a] / us["fp8"]
        cells = " | ".join(f"{_fmt(us.get(name), 1)} | {_fmt(share(name), 2)}" for name in FP8_COLUMNS)
        lines.append(f"| {r['batch']} | {r['cache']} | {r['heads']}/{r['heads_k']} | {r['head_dim']} | {cells} | "
                     f"{_fmt(ratio('bf16'), 2)} | {_fmt(ratio('sdpa'), 2)} |"
                     + (f" n/a: {'; '.join(r['na'].values())}" if r["na"] else ""))
    return lines + [""]


def short_query_point(batch, seqlen_q, seqlen_k, device, ms):
    import torch.nn.functional as F

    import portattn

    heads, heads_k, head_dim, dtype = 32, 8, 128, torch.bfloat16
    q = torch.randn(batch, seqlen_q, heads, head_dim, device=device, dtype=dtype)
    k = torch.randn(batch, seqlen_k, heads_k, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    row = {"batch": batch, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k, "us": {}}
    with torch.no_grad():
        row["us"]["portattn"] = ms(lambda: portattn.flash_attn_func(q, k, v, causal=True), f"s{batch}{seqlen_q}") * 1e3
        # flash-attn's causal is bottom-right aligned; SDPA's is_causal is top-left, so the
        # same mask is the lower-right causal bias (one query token sees every key: no mask).
        mask = None
        if seqlen_q > 1:
            from torch.nn.attention.bias import causal_lower_right

            mask = causal_lower_right(seqlen_q, seqlen_k)
        try:
            F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True)
            sdpa = lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True)
        except (RuntimeError, ValueError, TypeError):  # the causal bias may not take GQA: expand the heads
            ke, ve = (x.repeat_interleave(heads // heads_k, dim=1) for x in (kt, vt))
            sdpa = lambda: F.scaled_dot_product_attention(qt, ke, ve, attn_mask=mask)
            row["sdpa_note"] = "K/V heads expanded (the lower-right causal bias does not take enable_gqa)"
        row["us"]["sdpa"] = ms(sdpa, f"t{batch}{seqlen_q}") * 1e3
    return row


def _fmt(x, digits=0):
    return "n/a" if x is None else f"{x:.{digits}f}"


def markdown(result) -> list:
    lines = ["## Decode: one query token, bf16; time per call (us), eager and CUDA-graph replay", "",
             "| batch | cache | Hq/Hk | hd | bound | portattn | graph | paged 16 | paged 256 | SDPA | SDPA graph "
             "| SDPA / portattn | SDPA / portattn (graphs) | portattn share of bound (graph) | SDPA share (graph) | paged16 / contig |",
             "|---" * 16 + "|"]
    for r in result["decode"]:
        us = r["us"]
        def ratio(a, b):
            return None if us.get(a) is None or us.get(b) is None else us[a] / us[b]
        share = lambda name: None if us.get(name) is None else r["bound_us"] / us[name]
        lines.append(
            f"| {r['batch']} | {r['cache']} | {r['heads']}/{r['heads_k']} | {r['head_dim']} | {r['bound_us']:.0f} | "
            f"{_fmt(us.get('contiguous'))} | {_fmt(us.get('contiguous_graph'))} | {_fmt(us.get('paged16'))} | "
            f"{_fmt(us.get('paged256'))} | {_fmt(us.get('sdpa'))} | {_fmt(us.get('sdpa_graph'))} | "
            f"{_fmt(ratio('sdpa', 'contiguous'), 2)} | {_fmt(ratio('sdpa_graph', 'contiguous_graph'), 2)} | "
            f"{_fmt(share('contiguous_graph'), 2)} | {_fmt(share('sdpa_graph'), 2)} | "
            f"{_fmt(ratio('paged16_graph', 'contiguous_graph'), 2)} |"
            + (f" n/a: {'; '.join(r['na'].values())}" if r["na"] else ""))
    if result.get("short_query"):
        lines += ["", "## Short query through flash_attn_func (causal, GQA 32/8, hd 128), us per call", "",
                  "| batch | seqlen_q | seqlen_k | portattn | SDPA | SDPA / portattn |", "|---" * 6 + "|"]
        for r in result["short_query"]:
            p, s = r["us"]["portattn"], r["us"]["sdpa"]
            lines.append(f"| {r['batch']} | {r['seqlen_q']} | {r['seqlen_k']} | {p:.0f} | {s:.0f} | {s / p:.2f} |")
    return lines + [""]


def plot(result, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [r for r in result["decode"] if r["us"]]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(11, 4))
    labels = [f"b{r['batch']} {r['cache'] // 1024}k {r['heads']}/{r['heads_k']} d{r['head_dim']}" for r in rows]
    for name, label in (("contiguous_graph", "portattn (graph)"), ("paged16_graph", "portattn paged 16 (graph)"),
                        ("sdpa_graph", "SDPA (graph)"), ("contiguous", "portattn eager"), ("sdpa", "SDPA eager")):
        ys = [r["bound_us"] / r["us"][name] if r["us"].get(name) else math.nan for r in rows]
        ax.plot(range(len(rows)), ys, marker="o", label=label)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, rotation=75, fontsize=6)
    ax.set_ylabel("share of the HBM bound")
    ax.axhline(0.85, color="grey", linestyle=":", linewidth=1)
    ax.legend(fontsize=7)
    ax.set_title(f"decode, {result['device']} {result['date']} ({result['commit']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--caches", default="4096,8192,32768")
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--heads", default="32/8,32/32")
    parser.add_argument("--short-query", action="store_true")
    parser.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16")
    parser.add_argument("--hbm-tbps", type=float, default=3.35)
    parser.add_argument("--out", default=peers.LATEST)
    parser.add_argument("--name", default="decode_bench")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    peers.require_device(args.dry_run)
    device = "cpu" if args.dry_run else "cuda"
    ms = _timer(args.dry_run)
    result = dict(peers.header(args.dry_run), title="Decode benchmark: portattn vs SDPA", decode=[], short_query=[],
                  hbm_tbps=args.hbm_tbps, modes=[], impls=[], grid=[])
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]
    caches = peers.parse_ints(args.caches)
    if args.dry_run:
        caches = [min(c, 512) for c in caches]
    if args.kv_dtype == "fp8":
        return _fp8_main(args, result, heads, caches, device, ms)
    for batch in peers.parse_ints(args.batches):
        for cache in caches:
            for head_dim in peers.parse_ints(args.head_dims):
                for hq, hk in heads:
                    if args.dry_run:  # a small CPU proxy: 4 query heads, grouped or not
                        batch, hq, hk = 1, 4, (4 if hk == hq else 2)
                    row = decode_point(batch, cache, hq, hk, head_dim, device, ms, args.dry_run, args.hbm_tbps)
                    result["decode"].append(row)
                    print(markdown(dict(result, decode=[row], short_query=[]))[-2], flush=True)
                    if not args.dry_run:
                        torch.cuda.empty_cache()
    if args.short_query:
        for batch, seqlen_q, seqlen_k in ((1, 1, 8192), (8, 1, 8192), (32, 1, 4096), (8, 4, 8192), (8, 16, 8192),
                                          (4, 16, 4096)):
            result["short_query"].append(short_query_point(batch if not args.dry_run else 1, seqlen_q,
                                                           seqlen_k if not args.dry_run else 64, device, ms))
    lines = markdown(result)
    peers.write_results(result, args.out, args.name, extra_markdown=lines, plot=plot)
    print("\n".join(lines))
    return 0


def fp8_plot(result, path):
    """Share of each cache's bandwidth bound per grid point (FP8, FP8 paged 16, bf16, SDPA)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [r for r in result["fp8"] if r["us"].get("fp8")]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4))
    names = [n for n in ("fp8", "fp8_paged16", "bf16", "sdpa") if any(r["us"].get(n) for r in rows)]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        shares = [r["bound_us"][name] / r["us"][name] if r["us"].get(name) else float("nan") for r in rows]
        ax.bar([x + i * width for x in range(len(rows))], shares, width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))])
    ax.set_xticklabels([f"b{r['batch']}\n{r['cache'] // 1024}k" for r in rows], fontsize=8)
    ax.set_ylabel("share of the bandwidth bound")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.set_title(f"decode, FP8 vs bf16 KV cache: {result['device']} {result['date']} ({result['commit']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _fp8_main(args, result, heads, caches, device, ms) -> int:
    result.update(title="Decode benchmark: FP8 KV cache vs bf16 cache vs SDPA", fp8=[])
    for batch in peers.parse_ints(args.batches):
        for cache in caches:
            for head_dim in peers.parse_ints(args.head_dims):
                for hq, hk in heads:
                    if args.dry_run:
                        batch, hq, hk = 1, 4, 2
                    row = fp8_point(batch, cache, hq, hk, head_dim, device, ms, args.dry_run, args.hbm_tbps)
                    result["fp8"].append(row)
                    print(fp8_markdown(dict(result, fp8=[row]))[-2], flush=True)
                    if not args.dry_run:
                        torch.cuda.empty_cache()
    lines = fp8_markdown(result)
    peers.write_results(result, args.out, args.name, extra_markdown=lines, plot=fp8_plot)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
