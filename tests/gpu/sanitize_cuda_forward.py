"""A few small CUDA forward launches for compute-sanitizer (not collected by pytest).

    compute-sanitizer --tool memcheck  python tests/gpu/sanitize_cuda_forward.py
    compute-sanitizer --tool racecheck python tests/gpu/sanitize_cuda_forward.py

The cases cover the code paths that index memory differently: sequence tails
(17, 113 rows), a head dim served by a larger variant (40 -> 64, 200 -> 224),
GQA, varlen with empty and single-row sequences, strided inputs, the extras
kernel (softcap + ALiBi + dropout) and both tile configurations (4 and 8 warps).
Exits non-zero if any result is wrong; the sanitizer reports access errors.
"""
from __future__ import annotations

import math
import sys

import torch

from portattn.backends.cuda import CudaBackend

BACKEND = CudaBackend()


def run(q, k, v, **options):
    out = torch.full_like(q, float("nan"))
    varlen = options.get("cu_seqlens_q") is not None
    lse_shape = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
    lse = torch.full(lse_shape, float("nan"), device=q.device)
    args = dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
                softmax_scale=1 / math.sqrt(q.shape[-1]), window_left=-1, window_right=-1, softcap=0.0,
                alibi_slopes=None, dropout_p=0.0, rng_seed=0, rng_offset=0)
    args.update(options)
    BACKEND.forward(q, k, v, out, lse, **args)
    torch.cuda.synchronize()
    return out, lse


def main() -> int:
    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    failures = 0
    for head_dim, sq, sk, hk, options in [
        (40, 17, 113, 2, dict(window_right=0)),
        (128, 113, 17, 1, dict()),
        (200, 130, 70, 2, dict(window_left=20, window_right=3)),
        (64, 65, 129, 2, dict(softcap=5.0, alibi_slopes=torch.rand(2, device="cuda"), dropout_p=0.3,
                              rng_seed=7, rng_offset=3)),
    ]:
        q = torch.randn(2, sq, 2, head_dim, **bf16)
        k = torch.randn(2, sk, hk, head_dim, **bf16)
        v = torch.randn(2, sk, hk, head_dim, **bf16)
        out, lse = run(q, k, v, **options)
        failures += int(out.isnan().any().item() or lse.isnan().any().item())
    lens = [0, 1, 17, 130]
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(sum(lens), 4, 96, **bf16)
    kv = torch.randn(sum(lens), 2, 2, 96, **bf16)
    out, lse = run(q, kv[:, :, 0], kv[:, :, 1], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=130,
                   max_seqlen_k=130, window_right=0)
    failures += int(out.isnan().any().item() or lse.isnan().any().item())
    print(f"sanitize_cuda_forward: {failures} case(s) with NaN")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
