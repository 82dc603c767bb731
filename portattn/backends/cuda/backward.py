"""Backward marshalling: tensors -> `_C.bwd` (csrc/bwd_*.cuh, Note [portattn cuda backward]).

Vendor-neutral: the CUDA and ROCm modules export the same `bwd` and
`bwd_workspace_bytes` over the one C ABI, so both backends call this. The
scratch the kernels need (fp32 dQ accumulator, rowsum(dO * O) and, for GQA,
fp32 dK/dV accumulators) is one uint8 tensor from torch's caching allocator,
sized by the module's own `bwd_workspace_bytes` (its layout function, so the
size cannot drift from what the launch carves). Deterministic mode trades
workspace for order: see bwd_workspace_layout in csrc/bwd_entry.cu.
"""
from __future__ import annotations

import torch

from ..abi import fwd_args

# (batch, nheads, nheads_k, headdim, seqlen_q, seqlen_k) inside fwd_args' tuple
# (PORTATTN_FWD_ARGS order), the shape bwd_workspace_bytes takes.
_SHAPE = slice(12, 18)


def _aligned(t: torch.Tensor) -> bool:
    # The kernels read 16-byte chunks: pointer and every non-unit stride must allow it.
    return t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1])


def cuda_backward(_C, dout, q, k, v, out, lse, dq, dk, dv, *, cu_seqlens_q, cu_seqlens_k,
                  max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap,
                  alibi_slopes, dropout_p, rng_seed, rng_offset, deterministic) -> None:
    args = fwd_args(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p,
                    rng_seed, rng_offset)
    # dout comes from autograd (the user did not choose its layout): copy rather than fail.
    if not _aligned(dout):
        dout = dout.contiguous()
    deterministic = bool(deterministic)
    workspace_bytes = _C.bwd_workspace_bytes(*args[_SHAPE], deterministic)
    workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=q.device)
    _C.bwd(dout.data_ptr(), dout.stride(), dq.data_ptr(), dq.stride(), dk.data_ptr(), dk.stride(),
           dv.data_ptr(), dv.stride(), workspace.data_ptr(), workspace_bytes, deterministic, *args)
