"""CudaBackend.backward: tensors -> the `_C.bwd` call (csrc/bwd_*.cuh, Note [portattn cuda backward]).

The scratch the kernels need (fp32 dQ accumulator, rowsum(dO * O), the LSE in
log2 units and, for GQA, fp32 dK/dV accumulators) is one uint8 tensor from
torch's caching allocator, sized by `_C.bwd_workspace_bytes` (the module's
own layout function, so the size cannot drift from what the launch carves).
Deterministic mode trades workspace for order: see bwd_workspace_layout in
csrc/bwd_entry.cu.
"""
from __future__ import annotations

import torch


def _aligned(t: torch.Tensor) -> bool:
    # The kernels read 16-byte chunks: pointer and every non-unit stride must allow it.
    return t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1])


def cuda_backward(_C, dtype_code: int, raw_stream, dout, q, k, v, out, lse, dq, dk, dv, *,
                  cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                  window_left, window_right, softcap, alibi_slopes, dropout_p, rng_seed,
                  rng_offset, deterministic) -> None:
    if cu_seqlens_q is None:
        batch, seqlen_q, nheads, headdim = q.shape
        seqlen_k, nheads_k = k.shape[1], k.shape[2]
        cu_q = cu_k = 0
        lse_batch_stride, lse_head_stride = lse.stride(0), lse.stride(1)
    else:
        _, nheads, headdim = q.shape
        nheads_k = k.shape[1]
        batch = cu_seqlens_q.shape[0] - 1
        seqlen_q, seqlen_k = max_seqlen_q, max_seqlen_k
        cu_q, cu_k = cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr()
        lse_batch_stride, lse_head_stride = 0, lse.stride(0)
    if alibi_slopes is None:
        alibi, alibi_batch_stride = 0, 0
    else:
        alibi = alibi_slopes.data_ptr()
        alibi_batch_stride = alibi_slopes.stride(0) if alibi_slopes.dim() == 2 else 0
    # dout comes from autograd (the user did not choose its layout): copy rather than fail.
    if not _aligned(dout):
        dout = dout.contiguous()
    workspace_bytes = _C.bwd_workspace_bytes(batch, nheads, nheads_k, headdim, seqlen_q, seqlen_k,
                                             bool(deterministic))
    workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=q.device)
    _C.bwd(
        dout.data_ptr(), dout.stride(), dq.data_ptr(), dq.stride(), dk.data_ptr(), dk.stride(),
        dv.data_ptr(), dv.stride(), workspace.data_ptr(), workspace_bytes, bool(deterministic),
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
        q.stride(), k.stride(), v.stride(), out.stride(), lse_batch_stride, lse_head_stride,
        dtype_code, batch, nheads, nheads_k, headdim, seqlen_q, seqlen_k,
        cu_q, cu_k, 0, softmax_scale, softcap, window_left, window_right,
        alibi, alibi_batch_stride, dropout_p, rng_seed, rng_offset,
        raw_stream(q.device.index),
    )
