"""Forward+backward benchmark: portattn (default and deterministic) vs SDPA flash and cuDNN.

The backward columns of bench_attention.py (issue #4), measured side by side in one run:
  python bench/bench_backward.py [--quick] [--out bench/results]
  python bench/bench_attention.py --backward   (forward tables, then these)

1. FA2 paper grid: bf16, hidden 2048 (32 x 64 or 16 x 128 heads), batch x seqlen
   = 16k tokens, seqlen 512..16k, causal and not. One forward + backward
   (torch.autograd.grad, so no .grad accumulation kernel) timed by
   triton.testing.do_bench medians; TFLOP/s with the FA2 convention
   fwd+bwd = 3.5 x forward FLOPs (backward = 2.5 x). portattn's deterministic
   mode is a column of its own (its cost: ratio det / default).
2. Peak memory of forward+backward at B=1, H=16, S=32k, hd 128, portattn vs
   SDPA flash: the peak allocated beyond q, k, v and dout.
Results: <out>/cuda_fwd_bwd.{json,md,png}, with the device, date and git commit.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import portattn

try:  # the forward benchmark's helpers: same grid, same timing, same commit stamp
    from bench_attention import HIDDEN, TOKENS, _commit, _flops, _median_ms
except ImportError:  # run from the repository root as a module
    from bench.bench_attention import HIDDEN, TOKENS, _commit, _flops, _median_ms

FWD_BWD_FACTOR = 3.5  # FA2 convention: backward = 2.5 x forward FLOPs


def _leaves(batch, seqlen, heads, head_dim):
    return [torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True) for _ in range(3)]


def _portattn_step(q, k, v, dout, causal, deterministic):
    out = portattn.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)
    return torch.autograd.grad(out, (q, k, v), dout)


def _sdpa_step(q, k, v, dout, causal):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=causal)
    return torch.autograd.grad(out, (q, k, v), dout.transpose(1, 2))


def bench_grid(seqlens, head_dims):
    rows = []
    for head_dim in head_dims:
        heads = HIDDEN // head_dim
        for seqlen in seqlens:
            batch = max(1, TOKENS // seqlen)
            for causal in (False, True):
                q, k, v = _leaves(batch, seqlen, heads, head_dim)
                dout = torch.randn_like(q)
                flops = FWD_BWD_FACTOR * _flops(batch, heads, seqlen, head_dim, causal)
                row = {"head_dim": head_dim, "heads": heads, "batch": batch, "seqlen": seqlen, "causal": causal}
                for name, det in (("portattn", False), ("portattn_det", True)):
                    ms = _median_ms(lambda: _portattn_step(q, k, v, dout, causal, det))
                    row[name] = flops / ms / 1e9
                    row[f"{name}_ms"] = ms
                for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                                      ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
                    try:
                        with sdpa_kernel(backend):
                            ms = _median_ms(lambda: _sdpa_step(q, k, v, dout, causal))
                        row[name] = flops / ms / 1e9
                        row[f"{name}_ms"] = ms
                    except RuntimeError as error:
                        row[name] = None
                        row[f"{name}_error"] = str(error)[:200]
                # The backward alone = fwd+bwd minus a forward (no grad), for both.
                with torch.no_grad():
                    fwd_ms = _median_ms(lambda: portattn.flash_attn_func(q, k, v, causal=causal))
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        flash_fwd_ms = _median_ms(lambda: F.scaled_dot_product_attention(
                            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal))
                bwd_flops = (FWD_BWD_FACTOR - 1) * flops / FWD_BWD_FACTOR
                row["portattn_bwd"] = bwd_flops / (row["portattn_ms"] - fwd_ms) / 1e9
                row["sdpa_flash_bwd"] = (bwd_flops / (row["sdpa_flash_ms"] - flash_fwd_ms) / 1e9
                                         if row["sdpa_flash"] else None)
                row["ratio_vs_flash"] = row["portattn"] / row["sdpa_flash"] if row["sdpa_flash"] else None
                row["det_cost"] = row["portattn"] / row["portattn_det"]
                rows.append(row)
                print(f"fwd+bwd hd{head_dim} s{seqlen:5d} {'causal' if causal else 'full  '} portattn "
                      f"{row['portattn']:6.1f} (det {row['portattn_det']:6.1f})  flash {row['sdpa_flash'] or 0:6.1f}  "
                      f"cudnn {row['sdpa_cudnn'] or 0:6.1f}  ratio {row['ratio_vs_flash'] or 0:.3f}  bwd only "
                      f"{row['portattn_bwd']:6.1f} vs flash {row['sdpa_flash_bwd'] or 0:6.1f}", flush=True)
                del q, k, v, dout
    return rows


def _peak_extra(step, q, k, v, dout):
    step(q, k, v, dout)  # warm-up: dispatch, self-check and allocator pools settle
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    grads = step(q, k, v, dout)
    torch.cuda.synchronize()
    del grads
    return torch.cuda.max_memory_allocated() - before


def bench_memory(seqlen=32768, heads=16, head_dim=128):
    q, k, v = _leaves(1, seqlen, heads, head_dim)
    dout = torch.randn_like(q)
    result = {"batch": 1, "heads": heads, "seqlen": seqlen, "head_dim": head_dim,
              "inputs_bytes": 4 * q.numel() * q.element_size()}
    result["portattn_peak_extra_bytes"] = _peak_extra(
        lambda *a: _portattn_step(*a, causal=False, deterministic=False), q, k, v, dout)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        result["sdpa_flash_peak_extra_bytes"] = _peak_extra(lambda *a: _sdpa_step(*a, causal=False), q, k, v, dout)
    return result


def write_results(result, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, "cuda_fwd_bwd")
    with open(base + ".json", "w") as handle:
        json.dump(result, handle, indent=1)
    lines = ["# CUDA forward+backward benchmark", "",
             f"device: {result['device']}; date: {result['date']}; commit: {result['commit']}; "
             f"torch {result['torch']}", "",
             "## Forward+backward TFLOP/s (bf16, batch x seqlen = 16k, hidden 2048, FLOPs = 3.5 x forward)", "",
             "| hd | seqlen | causal | portattn | portattn det | SDPA flash | SDPA cuDNN | portattn / flash "
             "| default / det | bwd only: portattn | bwd only: flash |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["grid"]:
        lines.append(f"| {r['head_dim']} | {r['seqlen']} | {r['causal']} | {r['portattn']:.1f} | "
                     f"{r['portattn_det']:.1f} | {r['sdpa_flash'] or 0:.1f} | {r['sdpa_cudnn'] or 0:.1f} | "
                     f"{r['ratio_vs_flash'] or 0:.3f} | {r['det_cost']:.2f} | {r['portattn_bwd']:.1f} | "
                     f"{r['sdpa_flash_bwd'] or 0:.1f} |")
    lines += ["", "bwd only = (backward FLOPs = 2.5 x forward) / (fwd+bwd time - forward time)."]
    if not result["grid"]:
        lines = lines[:4]
    if result.get("memory"):
        m = result["memory"]
        lines += ["", "## Peak memory of forward+backward", "",
                  f"B=1, H={m['heads']}, S={m['seqlen']}, hd {m['head_dim']}, beyond q, k, v, dout "
                  f"({m['inputs_bytes'] / 2**20:.0f} MiB): portattn {m['portattn_peak_extra_bytes'] / 2**20:.1f} MiB, "
                  f"SDPA flash {m['sdpa_flash_peak_extra_bytes'] / 2**20:.1f} MiB."]
    with open(base + ".md", "w") as handle:
        handle.write("\n".join(lines) + "\n")
    if not result["grid"]:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    panels = [(hd, c) for hd in sorted({r["head_dim"] for r in result["grid"]}) for c in (False, True)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), sharey=True)
    for ax, (hd, causal) in zip(axes, panels):
        rows = [r for r in result["grid"] if r["head_dim"] == hd and r["causal"] == causal]
        xs = [str(r["seqlen"]) for r in rows]
        for key, label in (("portattn", "portattn"), ("portattn_det", "portattn deterministic"),
                           ("sdpa_flash", "SDPA flash (FA2)"), ("sdpa_cudnn", "SDPA cuDNN")):
            ax.plot(xs, [r[key] or 0 for r in rows], marker="o", label=label)
        ax.set_title(f"hd {hd}, {'causal' if causal else 'full'}")
        ax.set_xlabel("seqlen")
    axes[0].set_ylabel("forward+backward TFLOP/s (bf16)")
    axes[0].legend()
    fig.suptitle(f"{result['device']} {result['date']} ({result['commit']})")
    fig.tight_layout()
    fig.savefig(base + ".png", dpi=90)


def run(out_dir, seqlens, memory=True, grid=True):
    """Grid and/or memory case -> <out_dir>/cuda_fwd_bwd.{json,md,png}; also called by bench_attention.py --backward."""
    result = {
        "device": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _commit(),
        "torch": torch.__version__,
        "grid": bench_grid(seqlens, [64, 128]) if grid else [],
        "memory": bench_memory() if memory else None,
    }
    write_results(result, out_dir)
    print(open(os.path.join(out_dir, "cuda_fwd_bwd.md")).read())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer points (smoke run)")
    parser.add_argument("--no-memory", action="store_true", help="skip the 32k peak-memory case")
    parser.add_argument("--memory-only", action="store_true", help="only the 32k peak-memory case")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    seqlens = [1024, 4096, 16384] if args.quick else [512, 1024, 2048, 4096, 8192, 16384]
    run(args.out, seqlens, memory=not args.no_memory, grid=not args.memory_only)


if __name__ == "__main__":
    main()
