"""ROCm backend: MFMA tiled attention for AMD CDNA2/CDNA3 (gfx90a, gfx942); csrc/, built by build.py.

Never run on hardware by us (no AMD GPU is reachable): every ROCm entry of the
support matrix is "compiled", and selfcheck.py verifies it on first use. The
module `_C` has the CUDA module's `fwd` argument list (backends/common/params.h
as Python ints and stride tuples). ROCm's torch exposes HIP streams through the
torch.cuda namespace, hence `_cuda_getCurrentRawStream`.

Import never raises: a module that is not built, or whose HIP runtime
(libamdhip64) cannot be loaded, leaves `unavailable_reason` saying so, and
dispatch falls back.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...capability.callspec import CallSpec
from ..base import Backend

try:
    from . import _C  # type: ignore[attr-defined]

    _IMPORT_ERROR = ""
except ImportError as error:  # not built, built for another Python, or libamdhip64 missing
    _C = None
    _IMPORT_ERROR = f"the ROCm module is not built or cannot load its HIP runtime ({error})"

_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _availability() -> str:
    """Why this process cannot use the ROCm kernels at all; "" = it can."""
    if _IMPORT_ERROR:
        return _IMPORT_ERROR
    if torch.version.hip is None:
        return "this torch is not a ROCm build (torch.version.hip is None); the ROCm backend needs PyTorch for ROCm"
    count, status = _C.device_count()
    if count == 0:
        return f"no AMD GPU visible to the HIP runtime ({status})"
    return ""


class RocmBackend(Backend):
    name = "rocm"

    def __init__(self) -> None:
        self.unavailable_reason = _availability()
        self._build_config = _C.build_config() if _C is not None else None

    def build_config(self) -> Optional[dict]:
        return self._build_config

    def unsupported_reasons(self, call: CallSpec) -> list[str]:
        from ...capability.matrix import check_call
        from ...capability.probe import device_info

        if self.unavailable_reason:
            return [self.unavailable_reason]
        return check_call("rocm", device_info(), call, self._build_config)

    def forward(self, q, k, v, out, lse, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p,
                rng_seed, rng_offset) -> None:
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
        alibi = 0 if alibi_slopes is None else alibi_slopes.data_ptr()
        alibi_batch_stride = alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0
        _C.fwd(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
            q.stride(), k.stride(), v.stride(), out.stride(), lse_batch_stride, lse_head_stride,
            _DTYPE_CODES[q.dtype], batch, nheads, nheads_k, headdim, seqlen_q, seqlen_k,
            cu_q, cu_k, 0, softmax_scale, softcap, window_left, window_right,
            alibi, alibi_batch_stride, dropout_p, rng_seed, rng_offset,
            _raw_stream(q.device.index),
        )

    def backward(self, dout, q, k, v, out, lse, dq, dk, dv, **options) -> None:
        # The tensors -> _C.bwd marshalling is vendor-neutral (the modules share the signature).
        from ..cuda.backward import cuda_backward

        cuda_backward(_C, _DTYPE_CODES[q.dtype], _raw_stream, dout, q, k, v, out, lse, dq, dk, dv, **options)
