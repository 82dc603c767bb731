"""Every check of user input, in one place, before any backend sees a call.

Each failure raises TypeError (wrong kind of object or dtype) or ValueError
(wrong value or shape) whose message names the argument, what it got and
what is accepted. The constants a message quotes are the ones the check uses.

These checks run on every call, so they stay cheap: attribute reads and
integer comparisons only. The one check that must read tensor *values*
(cu_seqlens) lives in `check_cu_seqlens_values`, called from the op body
(ops.py) so that it also runs under torch.compile.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

# flash-attn's limit; the compiled backends declare their own (<=) maximum in
# the support matrix and larger valid head dims would fall back, but above this
# no backend's memory plan is meaningful.
MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DTYPE_NAMES = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)


def _require_tensor(name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def check_qkv(q, k, v, varlen: bool):
    """Shapes, dtypes and devices of q, k, v.

    Returns (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim); for varlen
    calls batch is None and the seqlens are the packed totals. Written to read
    each tensor attribute once: this runs on every call.
    """
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        for name, value in (("q", q), ("k", k), ("v", v)):
            _require_tensor(name, value)
    q_shape, k_shape, v_shape = q.shape, k.shape, v.shape
    rank = 3 if varlen else 4
    if len(q_shape) != rank or len(k_shape) != rank or len(v_shape) != rank:
        layout = "(total, nheads, headdim)" if varlen else "(batch, seqlen, nheads, headdim)"
        for name, shape in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
            if len(shape) != rank:
                raise ValueError(f"{name} must have {rank} dimensions {layout}, got shape {tuple(shape)}")
    dtype = q.dtype
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q has dtype {dtype}; supported dtypes: {_DTYPE_NAMES}")
    if k.dtype != dtype or v.dtype != dtype:
        raise TypeError(f"q, k, v must share one dtype, got q {dtype}, k {k.dtype}, v {v.dtype}")
    device = q.device
    if k.device != device or v.device != device:
        raise ValueError(f"q, k, v must be on one device, got q {device}, k {k.device}, v {v.device}")
    if k_shape != v_shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k_shape)} and v {tuple(v_shape)}")
    *q_lead, nheads, head_dim = q_shape
    *k_lead, nheads_k, head_dim_k = k_shape
    if head_dim_k != head_dim:
        raise ValueError(f"q and k must have the same head dim, got {head_dim} and {head_dim_k}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if nheads_k == 0 or nheads == 0 or nheads % nheads_k != 0:
        raise ValueError(
            f"number of query heads ({nheads}) must be a positive multiple of the number of "
            f"key/value heads ({nheads_k}) (GQA/MQA)"
        )
    if varlen:
        return None, q_lead[0], k_lead[0], nheads, nheads_k, head_dim
    batch, seqlen_q = q_lead
    batch_k, seqlen_k = k_lead
    if batch_k != batch:
        raise ValueError(f"q and k must have the same batch size, got {batch} and {batch_k}")
    return batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim


def check_options(
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    batch: Optional[int],
    nheads: int,
    head_dim: int,
    device: torch.device,
):
    """The scalar options. Returns (softmax_scale, window_left, window_right) normalised:
    causal becomes window_right = 0, as in flash-attn."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    elif isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    elif not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float, got {type(softcap).__name__}")
    if not (math.isfinite(softcap) and softcap >= 0.0):
        raise ValueError(f"softcap must be a finite value >= 0 (0 disables it), got {softcap}")
    window_left, window_right = _check_window(window_size)
    if causal:
        window_right = 0
    if alibi_slopes is not None:
        _check_alibi(alibi_slopes, batch, nheads, device)
    return float(softmax_scale), window_left, window_right


def _check_window(window_size):
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a (left, right) pair of ints, got {window_size!r}")
    left, right = window_size
    for side, value in (("left", left), ("right", right)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"window_size {side} must be an int (-1 = unbounded), got {value!r}")
        if value < -1:
            raise ValueError(f"window_size {side} must be >= -1 (-1 = unbounded), got {value}")
    return left, right


def _check_alibi(alibi_slopes, batch, nheads, device):
    _require_tensor("alibi_slopes", alibi_slopes)
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
    if alibi_slopes.device != device:
        raise ValueError(f"alibi_slopes must be on {device}, got {alibi_slopes.device}")
    shape = tuple(alibi_slopes.shape)
    allowed = [(nheads,)] + ([(batch, nheads)] if batch is not None else [])
    if shape not in allowed:
        expect = " or ".join(str(s) for s in allowed)
        raise ValueError(f"alibi_slopes must have shape {expect}, got {shape}")


def check_cu_seqlens(name: str, cu_seqlens, max_seqlen, total: int, device: torch.device) -> int:
    """Type, dtype, shape and device of one cu_seqlens tensor; returns the batch size."""
    _require_tensor(name, cu_seqlens)
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"{name} must be 1-D with batch + 1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != device:
        raise ValueError(f"{name} must be on {device} like q, got {cu_seqlens.device}")
    max_name = name.replace("cu_seqlens", "max_seqlen")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
        raise TypeError(f"{max_name} must be an int, got {type(max_seqlen).__name__}")
    if max_seqlen < 0:
        raise ValueError(f"{max_name} must be >= 0, got {max_seqlen}")
    return cu_seqlens.shape[0] - 1


def check_cu_seqlens_values(name: str, cu_seqlens: torch.Tensor, max_seqlen: int, total: int) -> None:
    """Values of cu_seqlens: 0 first, non-decreasing, last <= total rows, lengths <= max_seqlen.

    Reading the values costs one small device-to-host copy; kernels index memory
    with them, so a wrong value would be an out-of-bounds read. Set
    PORTATTN_TRUST_CU_SEQLENS=1 to skip (ops.py reads it once).
    """
    values = cu_seqlens.tolist()
    if values[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {values[0]}")
    lengths = [b - a for a, b in zip(values, values[1:])]
    if min(lengths) < 0:
        where = lengths.index(min(lengths))
        raise ValueError(f"{name} must be non-decreasing, but {name}[{where + 1}] < {name}[{where}] ({values[where + 1]} < {values[where]})")
    if values[-1] > total:
        raise ValueError(f"{name}[-1] = {values[-1]} exceeds the {total} packed rows of the tensor")
    longest = max(lengths)
    max_name = name.replace("cu_seqlens", "max_seqlen")
    if longest > max_seqlen:
        raise ValueError(f"{max_name} = {max_seqlen} is smaller than the longest sequence in {name} ({longest})")
