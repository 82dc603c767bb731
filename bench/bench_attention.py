"""Attention benchmark: portattn vs SDPA (FlashAttention-2 and cuDNN), side by side.

Forward (issue #3); the backward pass is added to the same tables later.
  python bench/bench_attention.py [--quick] [--out bench/results]

1. FA2 paper grid: bf16, hidden 2048 (32 heads x 64 or 16 heads x 128),
   batch x seqlen = 16k tokens, seqlen 512..16k, causal and not. Forward
   TFLOP/s from triton.testing.do_bench medians (4 * B * H * Sq * Sk * D
   flops, halved for causal), and the ratio portattn / SDPA flash.
2. Small-problem host overhead: wall time per call including Python, many
   calls with one synchronize at the end, for portattn.flash_attn_func and
   SDPA with no backend forced (forcing one through sdpa_kernel adds ~30 us).
3. Peak memory of one forward at B=1, H=16, S=32k, hd 128, against the bytes of
   q, k, v, out and lse.
Results: <out>/cuda_forward.{json,md,png}, with the device, date and git commit.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import portattn
from portattn import dispatch
from portattn.backends.cuda import CudaBackend

TOKENS = 16384
KERNEL_ONLY = False  # --kernel-only: time CudaBackend.forward only (tuning runs)
HIDDEN = 2048


def _commit() -> str:
    if os.environ.get("PORTATTN_COMMIT"):
        return os.environ["PORTATTN_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _flops(batch, heads, seqlen, head_dim, causal):
    return 4 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)


def _median_ms(fn):
    from triton.testing import do_bench

    return do_bench(fn, warmup=50, rep=200, return_mode="median")


def _chosen_backend(q, causal) -> str:
    bits = dispatch.feature_bits(-1, 0 if causal else -1, 0.0, False, 0.0, False, False)
    return dispatch.DISPATCHER.backend_for(q.device, q.dtype, q.shape[-1], bits).name


def _kernel_only(q, k, v, causal):
    """The CUDA backend called directly (no validation/dispatch), outputs preallocated."""
    backend = CudaBackend()
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device)
    options = dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
                   softmax_scale=q.shape[-1] ** -0.5, window_left=-1, window_right=0 if causal else -1,
                   softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_seed=0, rng_offset=0)
    return lambda: backend.forward(q, k, v, out, lse, **options)


def bench_grid(seqlens, head_dims):
    rows = []
    for head_dim in head_dims:
        heads = HIDDEN // head_dim
        for seqlen in seqlens:
            batch = max(1, TOKENS // seqlen)
            for causal in (False, True):
                q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                           for _ in range(3))
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # SDPA's (B, H, S, D) view
                flops = _flops(batch, heads, seqlen, head_dim, causal)
                row = {"head_dim": head_dim, "heads": heads, "batch": batch, "seqlen": seqlen, "causal": causal}
                if KERNEL_ONLY:
                    row["portattn"], row["backend"] = 0.0, "skipped"
                else:
                    row["portattn"] = flops / _median_ms(lambda: portattn.flash_attn_func(q, k, v, causal=causal)) / 1e9
                    row["backend"] = _chosen_backend(q, causal)
                row["kernel"] = flops / _median_ms(_kernel_only(q, k, v, causal)) / 1e9
                for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                                      ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
                    try:
                        with sdpa_kernel(backend):
                            ms = _median_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
                        row[name] = flops / ms / 1e9
                    except RuntimeError as error:
                        row[name] = None
                        row[f"{name}_error"] = str(error)[:200]
                ours = row["kernel"] if KERNEL_ONLY else row["portattn"]
                row["ratio_vs_flash"] = ours / row["sdpa_flash"] if row["sdpa_flash"] else None
                rows.append(row)
                print(f"hd{head_dim} s{seqlen:5d} {'causal' if causal else 'full  '} portattn "
                      f"{row['portattn']:6.1f} ({row['backend']}) kernel {row['kernel']:6.1f}  flash {row['sdpa_flash'] or 0:6.1f}  "
                      f"cudnn {row['sdpa_cudnn'] or 0:6.1f}  ratio {row['ratio_vs_flash'] or 0:.3f}", flush=True)
                del q, k, v, qt, kt, vt
    return rows


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
    rows = []
    for batch in batches:
        for head_dim in head_dims:
            for seqlen in seqlens:
                q, k, v = (torch.randn(batch, seqlen, 16, head_dim, device="cuda", dtype=torch.bfloat16)
                           for _ in range(3))
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                ours = _wall_us(lambda: portattn.flash_attn_func(q, k, v), calls)
                backend_only = _wall_us(_kernel_only(q, k, v, False), calls)
                sdpa = _wall_us(lambda: F.scaled_dot_product_attention(qt, kt, vt), calls)
                rows.append({"batch": batch, "heads": 16, "head_dim": head_dim, "seqlen": seqlen,
                             "portattn_us": ours, "backend_only_us": backend_only, "sdpa_auto_us": sdpa,
                             "ratio": ours / sdpa})
                print(f"overhead b{batch} hd{head_dim} s{seqlen}: portattn {ours:7.1f} us  backend.forward "
                      f"{backend_only:7.1f} us  sdpa {sdpa:7.1f} us", flush=True)
    return rows


def bench_memory(seqlen=32768, heads=16, head_dim=128):
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


def write_results(result, out_dir, name="cuda_forward"):
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, name)
    with open(base + ".json", "w") as handle:
        json.dump(result, handle, indent=1)
    lines = [f"# CUDA forward benchmark", "",
             f"device: {result['device']}; date: {result['date']}; commit: {result['commit']}; "
             f"torch {result['torch']}", "",
             "## Forward TFLOP/s (bf16, batch x seqlen = 16k, hidden 2048)", "",
             "portattn = the public `portattn.flash_attn_func` (backend it dispatched to in brackets); "
             "kernel = CudaBackend.forward called directly with preallocated outputs.", "",
             "| hd | seqlen | causal | portattn | kernel | SDPA flash | SDPA cuDNN | portattn / flash |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["grid"]:
        lines.append(f"| {r['head_dim']} | {r['seqlen']} | {r['causal']} | {r['portattn']:.1f} ({r['backend']}) | "
                     f"{r['kernel']:.1f} | "
                     f"{r['sdpa_flash'] or 0:.1f} | {r['sdpa_cudnn'] or 0:.1f} | {r['ratio_vs_flash'] or 0:.3f} |")
    if result.get("overhead"):
        lines += ["", "## Small-problem wall time per call (us, host included, no sync in the loop)", "",
                  "backend.forward = CudaBackend.forward alone with preallocated outputs (no validation, "
                  "dispatch or allocation).", "",
                  "| batch | hd | seqlen | portattn | backend.forward | SDPA (auto) | portattn / SDPA |",
                  "|---|---|---|---|---|---|---|"]
        for r in result["overhead"]:
            lines.append(f"| {r['batch']} | {r['head_dim']} | {r['seqlen']} | {r['portattn_us']:.1f} | "
                         f"{r['backend_only_us']:.1f} | {r['sdpa_auto_us']:.1f} | {r['ratio']:.2f} |")
    if result.get("memory"):
        m = result["memory"]
        lines += ["", "## Memory", "",
                  f"B=1, H={m['heads']}, S={m['seqlen']}, hd {m['head_dim']}: peak allocated beyond the inputs "
                  f"{m['peak_extra_bytes'] / 2**20:.1f} MiB; out + lse = {m['out_plus_lse_bytes'] / 2**20:.1f} MiB "
                  f"(inputs {m['inputs_bytes'] / 2**20:.1f} MiB)."]
    with open(base + ".md", "w") as handle:
        handle.write("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 4, figsize=(18, 4), sharey=True)
    panels = [(hd, c) for hd in sorted({r["head_dim"] for r in result["grid"]}) for c in (False, True)]
    for ax, (hd, causal) in zip(axes, panels):
        rows = [r for r in result["grid"] if r["head_dim"] == hd and r["causal"] == causal]
        xs = [str(r["seqlen"]) for r in rows]
        for key, label in (("portattn", "portattn"), ("sdpa_flash", "SDPA flash (FA2)"), ("sdpa_cudnn", "SDPA cuDNN")):
            ax.plot(xs, [r[key] or 0 for r in rows], marker="o", label=label)
        ax.set_title(f"hd {hd}, {'causal' if causal else 'full'}")
        ax.set_xlabel("seqlen")
    axes[0].set_ylabel("forward TFLOP/s (bf16)")
    axes[0].legend()
    fig.suptitle(f"{result['device']} {result['date']} ({result['commit']})")
    fig.tight_layout()
    fig.savefig(base + ".png", dpi=90)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer points (smoke run)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--head-dims", default="64,128", help="grid head dims (comma separated)")
    parser.add_argument("--grid-only", action="store_true", help="skip the overhead and memory parts")
    parser.add_argument("--tag", default="", help="suffix of the result file names")
    parser.add_argument("--kernel-only", action="store_true", help="grid: skip the public API (tuning runs)")
    parser.add_argument("--backward", action="store_true",
                        help="also forward+backward vs SDPA flash/cuDNN (bench_backward.py) in this run")
    args = parser.parse_args()
    global KERNEL_ONLY
    KERNEL_ONLY = args.kernel_only
    seqlens = [512, 2048, 8192] if args.quick else [512, 1024, 2048, 4096, 8192, 16384]
    result = {
        "device": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _commit(),
        "torch": torch.__version__,
        "grid": bench_grid(seqlens, [int(h) for h in args.head_dims.split(",")]),
    }
    if not args.grid_only:
        result["overhead"] = bench_overhead([2, 512], [16, 64], [50, 150, 300], 200 if args.quick else 2000)
        result["memory"] = bench_memory()
    write_results(result, args.out, "cuda_forward" + args.tag)
    print(open(os.path.join(args.out, f"cuda_forward{args.tag}.md")).read())
    if args.backward:
        import bench_backward  # issue #4's columns: fwd+bwd TFLOP/s, deterministic cost, memory

        bench_backward.run(args.out, seqlens, memory=not args.grid_only)


if __name__ == "__main__":
    main()
