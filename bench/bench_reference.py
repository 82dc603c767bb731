"""Time and peak memory of the pure-PyTorch reference backend (forward + backward).

    python bench/bench_reference.py [--device cuda] [--seqlens 2048 8192] [--dropout 0.1]

Peak memory is what one call adds over its inputs and outputs; the full fp32 score
matrix is printed beside it to show the chunking keeps memory O(seqlen).
"""
from __future__ import annotations

import argparse
import math
import time

import torch

from portattn.backends.reference import ReferenceBackend


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench(device, seqlen, batch, nheads, headdim, dtype, causal, dropout_p):
    q, k, v, dout = (torch.randn(batch, seqlen, nheads, headdim, dtype=dtype, device=device)
                     for _ in range(4))
    out = torch.empty_like(q)
    lse = torch.empty(batch, nheads, seqlen, device=device)
    grads = [torch.empty_like(x) for x in (q, k, v)]
    options = dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=seqlen,
                   max_seqlen_k=seqlen, softmax_scale=1 / math.sqrt(headdim), window_left=-1,
                   window_right=0 if causal else -1, softcap=0.0, alibi_slopes=None,
                   dropout_p=dropout_p, rng_seed=1, rng_offset=0)
    backend = ReferenceBackend()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    _sync(device)
    start = time.perf_counter()
    backend.forward(q, k, v, out, lse, **options)
    _sync(device)
    forward_s = time.perf_counter() - start
    backend.backward(dout, q, k, v, out, lse, *grads, deterministic=False, **options)
    _sync(device)
    backward_s = time.perf_counter() - start - forward_s
    flops = 4 * batch * nheads * seqlen * seqlen * headdim * (0.5 if causal else 1.0)
    line = (f"{device.type} S={seqlen} B={batch} H={nheads} D={headdim} {str(dtype)[6:]} "
            f"causal={causal} p={dropout_p}: fwd {forward_s * 1e3:.1f} ms "
            f"({flops / forward_s / 1e12:.2f} TFLOP/s), bwd {backward_s * 1e3:.1f} ms "
            f"({2.5 * flops / backward_s / 1e12:.2f} TFLOP/s)")
    if device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
        full = batch * nheads * seqlen * seqlen * 4 / 2**20
        line += f", peak extra {peak:.0f} MiB (one fp32 score matrix: {full:.0f} MiB)"
    print(line, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--nheads", type=int, default=16)
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--dropout", type=float, nargs="+", default=[0.0, 0.1])
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    bench(device, 256, 1, 2, 64, dtype, True, 0.1)  # warm-up: kernels, allocator
    for p in args.dropout:
        for causal in (False, True):
            for seqlen in args.seqlens:
                bench(device, seqlen, args.batch, args.nheads, args.headdim, dtype, causal, p)


if __name__ == "__main__":
    main()
