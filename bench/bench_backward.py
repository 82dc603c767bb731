"""Forward+backward benchmark: portattn (default and deterministic) vs SDPA flash and cuDNN.

  python bench/bench_backward.py [--quick] [--impls ...] [--out bench/results/latest]   -> cuda_fwd_bwd.{json,md,png}
  python bench/bench_backward.py --determinism                                   -> determinism.{json,md}
  python bench/bench_attention.py --backward   (every peer, forward and forward+backward, in one run)

1. FA2 paper grid (bench/peers.py): one forward + backward (torch.autograd.grad, so no
   .grad accumulation kernel) timed by triton.testing.do_bench medians; TFLOP/s with the
   FA2 convention fwd+bwd = 3.5 x forward FLOPs; the forward is timed too, so the backward
   alone is derived (fwd+bwd time - forward time).
2. `--determinism`: the cost of deterministic=True at hd 64 and 128 (`--head-dims`), seqlen 4k/8k/16k (batch x
   seqlen = 16k, 16 heads), causal and not: fwd+bwd and backward-alone times, default vs
   deterministic, and their ratio.
3. Peak memory of forward+backward at B=1, H=16, S=32k, hd 128, portattn vs SDPA flash:
   the peak allocated beyond q, k, v and dout.
`--dry-run` runs on the CPU with fake timings (checks the plumbing, measures nothing).
"""
from __future__ import annotations

import argparse
import os

import torch

import peers

DETERMINISM_SEQLENS = (4096, 8192, 16384)


def _peak_extra(step, q, k, v, dout):
    step(q, k, v, dout)  # warm-up: dispatch, self-check and allocator pools settle
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    grads = step(q, k, v, dout)
    torch.cuda.synchronize()
    del grads
    return torch.cuda.max_memory_allocated() - before


def bench_memory(seqlen=32768, head_dim=128):
    point = peers.Point(head_dim, seqlen, False)  # batch 1, 16 heads at hd 128
    q, k, v, dout = peers.make_inputs(point, dry_run=False)
    result = {"batch": point.batch, "heads": point.heads, "seqlen": seqlen, "head_dim": head_dim,
              "inputs_bytes": 4 * q.numel() * q.element_size()}
    for name in ("portattn", "sdpa_flash"):
        impl = peers.IMPLS[name]
        bind, why = peers.load_impl(name)
        if bind is None:
            result[f"{name}_peak_extra_bytes"], result[f"{name}_why"] = None, why
            continue
        with impl.context():
            call = bind(q, k, v, False)
            result[f"{name}_peak_extra_bytes"] = _peak_extra(
                lambda q, k, v, dout: torch.autograd.grad(call(), (q, k, v), dout), q, k, v, dout)
    return result


def memory_markdown(m) -> list:
    def mib(key):
        value = m.get(f"{key}_peak_extra_bytes")
        return f"{value / 2**20:.1f} MiB" if value is not None else f"n/a ({m.get(f'{key}_why')})"

    return ["## Peak memory of forward+backward", "",
            f"B=1, H={m['heads']}, S={m['seqlen']}, hd {m['head_dim']}, beyond q, k, v, dout "
            f"({m['inputs_bytes'] / 2**20:.0f} MiB): portattn {mib('portattn')}, SDPA flash {mib('sdpa_flash')}.", ""]


def determinism_markdown(rows) -> list:
    """Default vs deterministic=True: fwd+bwd and backward-alone ms, and the cost ratio."""
    lines = ["## Deterministic backward: cost against the default", "",
             "| hd | seqlen | batch | causal | fwd+bwd ms default | fwd+bwd ms det | det / default "
             "| bwd ms default | bwd ms det | det / default (bwd) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in peers.in_order(rows):
        lines.append(f"| {row['head_dim']} | {row['seqlen']} | {row['batch']} | {row['causal']} | "
                     + " | ".join(peers.fmt_num(value, digits) for value, digits in determinism_numbers(row)) + " |")
    return lines + [""]


def determinism_numbers(row):
    both = row["ms"].get("fwd_bwd", {})
    fwd = row["ms"].get("fwd", {}).get("portattn")
    default, det = both.get("portattn"), both.get("portattn_det")
    bwd_default = default - fwd if default and fwd else None
    bwd_det = det - fwd if det and fwd else None
    return [(default, 2), (det, 2), (det / default if det and default else None, 2),
            (bwd_default, 2), (bwd_det, 2), (bwd_det / bwd_default if bwd_det and bwd_default else None, 2)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="seqlens 1024, 4096, 16384 (smoke run)")
    parser.add_argument("--seqlens", default=None, help="grid seqlens, comma separated")
    parser.add_argument("--head-dims", default="64,128", help="grid head dims, comma separated")
    parser.add_argument("--impls", default="portattn,portattn_det,sdpa_flash,sdpa_cudnn",
                        help=f"columns, comma separated, from: {', '.join(peers.IMPLS)}")
    parser.add_argument("--determinism", action="store_true",
                        help="only the deterministic-mode cost (--head-dims, seqlen 4k/8k/16k) -> determinism.{json,md}")
    parser.add_argument("--no-memory", action="store_true", help="skip the 32k peak-memory case")
    parser.add_argument("--memory-only", action="store_true", help="only the 32k peak-memory case")
    parser.add_argument("--budget-s", type=float, default=300, help="grid time budget (cells after it are n/a)")
    parser.add_argument("--rep-ms", type=int, default=80, help="do_bench rep (ms) per cell")
    parser.add_argument("--out", default=peers.LATEST)
    parser.add_argument("--dry-run", action="store_true", help="CPU, fake timings: checks the plumbing only")
    args = parser.parse_args()
    peers.require_device(args.dry_run)
    timer = peers.Timer(rep_ms=args.rep_ms, dry_run=args.dry_run)

    if args.determinism:
        name, title = "determinism", "Deterministic backward: cost against the default"
        points = peers.grid(peers.parse_ints(args.head_dims),
                            peers.parse_ints(args.seqlens) if args.seqlens else DETERMINISM_SEQLENS)
        impls, modes = peers.select("portattn,portattn_det"), ["fwd", "fwd_bwd"]
    else:
        name, title = "cuda_fwd_bwd", "CUDA forward+backward benchmark"
        seqlens = (peers.parse_ints(args.seqlens) if args.seqlens
                   else [1024, 4096, 16384] if args.quick else list(peers.SEQLENS))
        points = [] if args.memory_only else peers.grid(peers.parse_ints(args.head_dims), seqlens)
        impls, modes = peers.select(args.impls), ["fwd", "fwd_bwd"]
    result = dict(peers.header(args.dry_run), title=title, impls=[impl.name for impl in impls], modes=modes, grid=[])

    def extra(result):
        lines = determinism_markdown(result["grid"]) if "portattn_det" in result["impls"] else []
        return lines + (memory_markdown(result["memory"]) if result.get("memory") else [])

    def save(rows):
        result["grid"] = rows
        peers.write_results(result, args.out, name, extra(result))

    save(peers.run_grid(points, impls, modes, timer, args.budget_s, on_point=save))
    if not (args.no_memory or args.determinism or args.dry_run):
        result["memory"] = bench_memory()
        save(result["grid"])
    if result["grid"]:
        print(peers.compact_table(result))
    print("\n".join(extra(result)))
    print(f"results: {os.path.join(args.out, name)}.{{json,md,png}}")


if __name__ == "__main__":
    main()
