"""Context-parallel throughput: zigzag ring attention (ring-flash-attn on portattn) over N GPUs.

    torchrun --nproc_per_node N bench/bench_context_parallel.py [--tokens 131072,262144] [--out DIR]

Each rank holds a zigzag shard of one causal sequence (bf16, 16 heads x 128); ring-flash-attn
passes K/V around the ring over NCCL and portattn runs every step's attention. Times the
forward and forward+backward with CUDA events (median of --reps after warm-up, a barrier
before each) and, on the same ranks, one GPU's whole call at the per-rank token count
(weak-scaling baseline) and at the total when it fits (strong-scaling baseline). Rank 0
prints and writes <out>/context_parallel_<N>gpu.{json,md} through peers.write_results:

    weak efficiency   = time of one GPU on tokens/N / time of N GPUs on tokens (causal work
                        per GPU is the same when the whole causal call's work is split N ways:
                        a causal call on tokens/N does 1/N^2 of the work, so it is scaled by N)
    strong efficiency = time of one GPU on tokens / (N x time of N GPUs on tokens)
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist

import peers
import portattn  # noqa: F401
from portattn.compat import import_ring_flash_attn

HEADS, HEAD_DIM = 16, 128


def _time_ms(fn, reps):
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _step(attention, q, k, v, dout, backward):
    def run():
        out = attention(q, k, v, causal=True)
        if backward:
            torch.autograd.grad(out, (q, k, v), dout)
    return run


def _inputs(tokens, device, grad=True):
    shape = (1, tokens, HEADS, HEAD_DIM)
    q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=grad) for _ in range(3))
    return q, k, v, torch.randn(shape, device=device, dtype=torch.bfloat16)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="131072,262144")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "latest"))
    args = parser.parse_args(argv)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    ring = import_ring_flash_attn()
    rows = []
    for tokens in peers.parse_ints(args.tokens):
        local = tokens // world
        row = {"tokens": tokens, "world": world, "ms": {}}
        q, k, v, dout = _inputs(local, device)
        for backward in (False, True):
            mode = "fwd_bwd" if backward else "fwd"
            row["ms"][f"ring_{mode}"] = _time_ms(_step(ring.zigzag_ring_flash_attn_func, q, k, v, dout, backward),
                                                 args.reps)
            # One GPU on the per-rank token count, every rank at once (no communication).
            row["ms"][f"single_local_{mode}"] = _time_ms(_step(portattn.flash_attn_func, q, k, v, dout, backward),
                                                         args.reps)
        del q, k, v, dout
        torch.cuda.empty_cache()
        try:
            q, k, v, dout = _inputs(tokens, device)
            for backward in (False, True):
                mode = "fwd_bwd" if backward else "fwd"
                row["ms"][f"single_total_{mode}"] = _time_ms(
                    _step(portattn.flash_attn_func, q, k, v, dout, backward), args.reps)
            del q, k, v, dout
        except torch.cuda.OutOfMemoryError:
            row["note"] = "the whole sequence does not fit one GPU"
        torch.cuda.empty_cache()
        for mode in ("fwd", "fwd_bwd"):
            ring_ms = row["ms"][f"ring_{mode}"]
            # A causal call on tokens/N does 1/N^2 of the whole call's work; N GPUs share the
            # whole work, 1/N each: so one GPU's time for 1/N of the work is N x the local time.
            row[f"weak_efficiency_{mode}"] = world * row["ms"][f"single_local_{mode}"] / ring_ms
            if f"single_total_{mode}" in row["ms"]:
                row[f"strong_efficiency_{mode}"] = row["ms"][f"single_total_{mode}"] / (world * ring_ms)
        rows.append(row)
        if rank == 0:
            print(row, flush=True)
    if rank == 0:
        result = dict(peers.header(False), title=f"Context parallelism: zigzag ring attention on {world} GPUs",
                      note=f"bf16, causal, batch 1, {HEADS} heads x {HEAD_DIM}; ring-flash-attn on portattn over NCCL",
                      rows=rows, modes=[], impls=[], grid=[])
        lines = ["| tokens | GPUs | ring fwd ms | ring fwd+bwd ms | 1 GPU, tokens/N: fwd / fwd+bwd ms | "
                 "1 GPU, all tokens: fwd / fwd+bwd ms | weak eff. fwd / fwd+bwd | strong eff. fwd / fwd+bwd |",
                 "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            ms = r["ms"]
            total = (f"{ms['single_total_fwd']:.1f} / {ms['single_total_fwd_bwd']:.1f}"
                     if "single_total_fwd" in ms else r.get("note", "n/a"))
            strong = (f"{r['strong_efficiency_fwd']:.2f} / {r['strong_efficiency_fwd_bwd']:.2f}"
                      if "strong_efficiency_fwd" in r else "n/a")
            lines.append(f"| {r['tokens']} | {world} | {ms['ring_fwd']:.1f} | {ms['ring_fwd_bwd']:.1f} | "
                         f"{ms['single_local_fwd']:.1f} / {ms['single_local_fwd_bwd']:.1f} | {total} | "
                         f"{r['weak_efficiency_fwd']:.2f} / {r['weak_efficiency_fwd_bwd']:.2f} | {strong} |")
        peers.write_results(result, args.out, f"context_parallel_{world}gpu", extra_markdown=lines)
        print("\n".join(lines))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
