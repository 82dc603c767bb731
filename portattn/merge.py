"""`portattn.merge_attention_states`: fold one partial attention result into another, in place.

Two attention calls of the same queries over disjoint key sets (ring attention's steps,
cascade attention's shared prefix and per-request suffix, split-KV decoding) each give an
output and a log-sum-exp of the scores; their union's attention is

    lse' = log(exp(lse) + exp(block_lse))
    out' = exp(lse - lse') * out + exp(block_lse - lse') * block_out

computed here as ring-flash-attn computes it (update_out_and_lse: sigmoid / logsigmoid in
fp32, op for op; Note [portattn merge attention states] in backends/common/merge.h), so the
fused kernel can stand in for it. An infinite LSE (-inf from portattn, +inf from
flash-attn 2's empty rows) marks a result over no keys, which contributes nothing: never
NaN, and two empty results merge to lse = -inf.

On NVIDIA GPUs one kernel does it in one pass (out and block_out read once, out written
once), on the caller's stream, without allocating or reading tensor values on the host
(safe inside CUDA-graph capture). Its body (backends/common/merge_kernel.h) is written for
HIP too, but the ROCm module does not export `merge` yet; there, on the CPU and with a CUDA
build without the entry, the same arithmetic runs as torch operations.
"""
from __future__ import annotations

import torch

from .backends.abi import raw_stream
from .backends.compiled import launch

__all__ = ["merge_attention_states", "merge_attention_states_reference"]

_OUT_DTYPES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}  # PortattnDtype, PORTATTN_MERGE_FP32
_UNSET = object()
_module = _UNSET


def _compiled():
    """The GPU module with `merge` for this torch (CUDA or ROCm build), or None."""
    global _module
    if _module is _UNSET:
        module = None
        try:
            if torch.version.hip is not None:
                from .backends.rocm import _C as module
            else:
                from .backends.cuda import _C as module
        except ImportError:
            module = None
        _module = module if module is not None and hasattr(module, "merge") else None
    return _module


def _lse_strides(name, lse, out_shape):
    """(batch, token, head) element strides of an LSE for an output of out_shape.

    Dense out (B, S, H, D): lse (B, H, S) as flash-attn returns it, or (B, S, H, 1) as
    ring-flash-attn accumulates it. Varlen out (T, H, D): lse (H, T), or (T, H, 1)."""
    if not isinstance(lse, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(lse).__name__}")
    if lse.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {lse.dtype}")
    shape, strides = tuple(lse.shape), lse.stride()
    if len(out_shape) == 4:
        batch, seqlen, heads, _ = out_shape
        if shape == (batch, heads, seqlen):
            return (strides[0], strides[2], strides[1])
        if shape == (batch, seqlen, heads, 1):
            return strides[:3]
        expected = f"({batch}, {heads}, {seqlen}) or ({batch}, {seqlen}, {heads}, 1)"
    else:
        total, heads, _ = out_shape
        if shape == (heads, total):
            return (0, strides[1], strides[0])
        if shape == (total, heads, 1):
            return (0, strides[0], strides[1])
        expected = f"({heads}, {total}) or ({total}, {heads}, 1)"
    raise ValueError(f"{name} has shape {shape}; for an output of shape {tuple(out_shape)} it must be {expected}")


def _check(out, lse, block_out, block_lse):
    for name, t in (("out", out), ("block_out", block_out)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _OUT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if out.dim() not in (3, 4):
        raise ValueError(f"out must be (batch, seqlen, nheads, headdim) or (total, nheads, headdim), got shape "
                         f"{tuple(out.shape)}")
    if block_out.shape != out.shape:
        raise ValueError(f"block_out has shape {tuple(block_out.shape)}, out {tuple(out.shape)}: they must match")
    lse_strides = _lse_strides("lse", lse, out.shape)
    block_lse_strides = _lse_strides("block_lse", block_lse, out.shape)
    for name, t in (("lse", lse), ("block_out", block_out), ("block_lse", block_lse)):
        if t.device != out.device:
            raise ValueError(f"{name} is on {t.device}, out on {out.device}: all four must be on one device")
    if out.shape[-1] > 1 and (out.stride(-1) != 1 or block_out.stride(-1) != 1):
        raise ValueError("out and block_out must be contiguous in their last (head) dimension")
    return lse_strides, block_lse_strides


def _token_major(lse, out_shape):
    """A (..., tokens, heads, 1) view of an LSE (see _lse_strides), broadcastable against out."""
    if lse.dim() == len(out_shape):
        return lse
    return lse.transpose(-2, -1).unsqueeze(-1)


def merge_attention_states_reference(out, lse, block_out, block_lse):
    """merge_attention_states as torch operations (any device); same contract, in place."""
    _check(out, lse, block_out, block_lse)
    _merge_torch(out, lse, block_out, block_lse)
    return out, lse


def _merge_torch(out, lse, block_out, block_lse):
    l = _token_major(lse, out.shape)
    bl = _token_major(block_lse, out.shape)
    o = out.to(torch.float32)
    b = block_out.to(torch.float32)
    # ring-flash-attn's expressions, so finite rows give its values bit for bit on the CPU.
    merged_out = o - torch.sigmoid(bl - l) * (o - b)
    merged_lse = l - torch.nn.functional.logsigmoid(l - bl)
    empty, block_empty = torch.isinf(l), torch.isinf(bl)
    merged_out = torch.where(block_empty, o, torch.where(empty, b, merged_out))
    neg_inf = torch.full((), float("-inf"), dtype=torch.float32, device=l.device)
    merged_lse = torch.where(block_empty, torch.where(empty, neg_inf, l), torch.where(empty, bl, merged_lse))
    out.copy_(merged_out)
    l.copy_(merged_lse)


def merge_attention_states(out, lse, block_out, block_lse):
    """Merge the partial attention result (block_out, block_lse) into (out, lse), in place.

    out: (batch, seqlen, nheads, headdim) or varlen (total, nheads, headdim); float32 (an
    accumulator, as ring attention keeps it), bfloat16 or float16; last dim contiguous.
    block_out: the same shape; float32, bfloat16 or float16 (any mix with out).
    lse, block_lse: float32, each either flash-attn's softmax_lse layout ((batch, nheads,
    seqlen) / (nheads, total)) or token-major with a trailing 1 ((batch, seqlen, nheads, 1)
    / (total, nheads, 1), ring-flash-attn's accumulator); any strides.

    Returns (out, lse), the same tensors, updated: lse' = log(exp(lse) + exp(block_lse)),
    out' = out - sigmoid(block_lse - lse) * (out - block_out). A row whose lse is infinite
    (a result over no keys) takes the block's row; a row whose block_lse is infinite keeps
    its own. Bad arguments raise TypeError / ValueError naming the argument."""
    lse_strides, block_lse_strides = _check(out, lse, block_out, block_lse)
    module = _compiled() if out.is_cuda else None
    if module is None:
        _merge_torch(out, lse, block_out, block_lse)
        return out, lse
    if out.dim() == 4:
        batch, seqlen, nheads, headdim = out.shape
        out_strides, block_strides = out.stride()[:3], block_out.stride()[:3]
    else:
        batch, (seqlen, nheads, headdim) = 1, out.shape
        out_strides, block_strides = (0, *out.stride()[:2]), (0, *block_out.stride()[:2])
    index = out.device.index
    launch(index, module.merge, (
        out.data_ptr(), lse.data_ptr(), block_out.data_ptr(), block_lse.data_ptr(), _OUT_DTYPES[out.dtype],
        _OUT_DTYPES[block_out.dtype], batch, seqlen, nheads, headdim, out_strides, block_strides, lse_strides,
        block_lse_strides, raw_stream(index)))
    return out, lse
