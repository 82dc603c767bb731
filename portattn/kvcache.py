"""flash_attn_with_kvcache: validate, then attend in place (decode kernels) or by gathering.

On a compiled backend with decode kernels (dispatch.decode_backend_for), the new keys
and values are appended (and rotated) on the device, and the split-KV kernels read
the cache in place, contiguous or paged (Note [portattn decode]). Nothing on this path
reads a tensor's values on the host, so a decode step can be captured in a CUDA graph.

Elsewhere (the reference backend, CPU, float32, a backend without decode kernels for
the call) the same call is turned into a packed varlen call: rotate, append in place,
gather the live keys, attend. Gathering copies the live part of the cache once per
call and reads the lengths on the host.

Semantics (flash-attn 2): sequence b's live keys are cache rows [leftpad, cache_seqlens)
followed by the new ones; new key i is written at row cache_seqlens[b] + i and rotated
at that index (which counts the left padding); queries are rotated at cache_seqlens[b],
plus their own index when the attention is causal or local.

FP8 caches (FlashAttention-3's semantics; Note [portattn fp8 kv cache] in
backends/common/params.h): k_cache / v_cache of torch.float8_e4m3fn with a float16/bfloat16
query; the key attended to is k_cache[...] * k_descale[b, hk] (v likewise), and new keys and
values are stored as e4m3(x / descale), rounded to nearest even and saturated to +-448.
"""
from __future__ import annotations

import os

import torch

from . import dispatch
from .decode import run_decode
from .errors import error_buffer
from .validation import _DTYPE_NAMES, HOST_CHECKED_DEVICE_TYPE, MAX_HEAD_DIM, SUPPORTED_DTYPES, check_options, seq_first

# Opt-in host-side checks of the values the kernels otherwise clamp on the device.
_DEBUG_CHECKS = os.environ.get("PORTATTN_DEBUG_CHECKS", "0") == "1"


def _int32_vector(name, value, batch, device):
    if isinstance(value, int) and not isinstance(value, bool):
        return torch.full((batch,), value, dtype=torch.int32, device=device)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be an int or an int32 tensor of shape ({batch},), got {type(value).__name__}")
    if value.dtype != torch.int32 or value.shape != (batch,):
        raise ValueError(f"{name} must be an int32 tensor of shape ({batch},), got {value.dtype} {tuple(value.shape)}")
    if value.device != device:
        raise ValueError(f"{name} must be on {device} (with q), got {value.device}")
    return value


def apply_rotary(x, cos, sin, positions, interleaved):
    """Rotate the first rotary_dim features of x (batch, seqlen, heads, dim) at positions (batch, seqlen)."""
    rotary_dim = cos.shape[-1] * 2
    positions = positions.clamp(0, cos.shape[0] - 1)  # as the device kernel does
    cos_p = cos[positions].unsqueeze(2).to(torch.float32)  # (B, S, 1, rd/2)
    sin_p = sin[positions].unsqueeze(2).to(torch.float32)
    head, tail = x[..., :rotary_dim].to(torch.float32), x[..., rotary_dim:]
    if interleaved:  # pairs (0, 1), (2, 3), ...
        first, second = head[..., 0::2], head[..., 1::2]
        rotated = torch.stack((first * cos_p - second * sin_p, first * sin_p + second * cos_p), dim=-1).flatten(-2)
    else:  # GPT-NeoX halves
        first, second = head[..., : rotary_dim // 2], head[..., rotary_dim // 2 :]
        rotated = torch.cat((first * cos_p - second * sin_p, first * sin_p + second * cos_p), dim=-1)
    return torch.cat((rotated.to(x.dtype), tail), dim=-1)


def _cache_rows(block_table, batch_rows, page_size, positions):
    """Flat row index of sequence b's position p in a (num_blocks * page_size) paged cache."""
    blocks = torch.gather(block_table[batch_rows].long(), 1, positions // page_size)
    return blocks * page_size + positions % page_size


def check_block_table(block_table, batch, device) -> None:
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table must be an int32 tensor (batch, max_blocks), got {type(block_table).__name__}")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table must be int32 ({batch}, max_blocks), got {block_table.dtype} {tuple(block_table.shape)}")
    if block_table.device != device:
        raise ValueError(f"block_table must be on {device} (with q), got {block_table.device}")
    if block_table.stride(1) != 1:
        raise ValueError("block_table must be contiguous along its last dimension")


def gather_paged(k_cache, v_cache, block_table, cu_seqlens_k, max_seqlen_k=None):
    """Paged (num_blocks, page, Hk, D) caches + per-sequence lengths -> packed (total_k, Hk, D).

    Reads cu_seqlens_k and block_table on the host (the gather needs the lengths). CPU
    tensors with out-of-range values raise a ValueError naming the argument and entry; on a
    GPU a sequence whose pages are out of range is contained (no key read, output 0, recorded
    for portattn.check_errors(), portattn/errors.py) and cu_seqlens_k keeps flash-attn's
    clamping contract (a negative length counts as 0)."""
    if not isinstance(cu_seqlens_k, torch.Tensor) or cu_seqlens_k.dim() != 1 or cu_seqlens_k.shape[0] < 2:
        raise ValueError("cu_seqlens_k must be a 1-D int32 tensor with batch + 1 >= 2 entries")
    batch = cu_seqlens_k.shape[0] - 1
    check_block_table(block_table, batch, k_cache.device)
    if not isinstance(k_cache, torch.Tensor) or not isinstance(v_cache, torch.Tensor) or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"paged k_cache/v_cache must share shape (num_blocks, page_block_size, nheads_k, headdim), got {tuple(getattr(k_cache, 'shape', ()))} and {tuple(getattr(v_cache, 'shape', ()))}")
    if cu_seqlens_k.dtype != torch.int32 or cu_seqlens_k.device != k_cache.device:
        raise ValueError(f"cu_seqlens_k must be int32 on {k_cache.device}, got {cu_seqlens_k.dtype} on {cu_seqlens_k.device}")
    device = k_cache.device
    page, pages = k_cache.shape[1], k_cache.shape[0]
    capacity = block_table.shape[1] * page
    cu = cu_seqlens_k.tolist()
    if device.type == "cpu":
        from .validation import check_cu_seqlens_values

        check_cu_seqlens_values("cu_seqlens_k", cu_seqlens_k, capacity if max_seqlen_k is None else max_seqlen_k,
                                cu[-1])
    lengths = [max(0, b - a) for a, b in zip(cu, cu[1:])]
    longest = max(lengths, default=0)
    if longest > capacity:
        where = lengths.index(longest)
        raise ValueError(f"sequence {where} has {longest} keys (cu_seqlens_k) but block_table's "
                         f"{block_table.shape[1]} blocks of {page} hold {capacity}")
    table = block_table.tolist()
    for b, n in enumerate(lengths):
        for slot in range(-(-n // page)):
            number = table[b][slot]
            if not 0 <= number < pages:
                if device.type == "cpu":
                    raise ValueError(f"block_table[{b}, {slot}] = {number} is out of range: it must be in "
                                     f"[0, {pages - 1}] (k_cache has {pages} pages; sequence {b} has {n} keys)")
                from . import errors

                errors.record(device, "block_table", b, number)
                lengths[b] = 0
                break
    page_of = torch.tensor([table[b][pos // page] for b, n in enumerate(lengths) for pos in range(n)],
                           dtype=torch.long, device=device)
    row_of = torch.tensor([pos % page for n in lengths for pos in range(n)], dtype=torch.long, device=device)
    new_cu = torch.tensor([0] + lengths, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
    if _is_fp8_cache(k_cache):  # indexed as bytes (the same bits; indexing needs no float8 kernel)
        return (k_cache.view(torch.uint8)[page_of, row_of].view(k_cache.dtype),
                v_cache.view(torch.uint8)[page_of, row_of].view(v_cache.dtype), new_cu)
    return k_cache[page_of, row_of], v_cache[page_of, row_of], new_cu


def dequantize_packed(keys, values, cu_seqlens_k, k_descale, v_descale, dtype):
    """Packed FP8 keys and values (total_k, nheads_k, headdim) of a varlen call, times their
    sequence's descale, in `dtype`. The owner of each row comes from cu_seqlens_k on the
    device (rows past its last entry take the last sequence's scale; they are never read)."""
    batch = cu_seqlens_k.shape[0] - 1
    owner = None
    if k_descale is not None or v_descale is not None:
        rows = torch.arange(keys.shape[0], device=keys.device, dtype=cu_seqlens_k.dtype)
        owner = torch.searchsorted(cu_seqlens_k[1:], rows, right=True).clamp_(max=max(batch - 1, 0))
    return (dequantize_fp8(keys, k_descale, owner).to(dtype), dequantize_fp8(values, v_descale, owner).to(dtype))


# The FP8 cache dtype (OCP e4m3 "fn", torch's float8_e4m3fn) and its largest finite value.
FP8_KV_DTYPE = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0
# The decode kernels read e4m3 rows in 16-byte chunks (csrc/decode_kernel.cuh).
FP8_KERNEL_HEAD_DIM_MULTIPLE = 16


def _is_fp8_cache(t) -> bool:
    return FP8_KV_DTYPE is not None and t.dtype == FP8_KV_DTYPE


def _check_descales(q, k_cache, k_descale, v_descale, q_descale, batch=None):
    """The FP8 arguments: k_descale and v_descale are None (1.0) or fp32 (batch, nheads_k) on q's
    device, for an FP8 cache only. q_descale is folded away before this (fold_fp8_query); one
    that reaches it came with a float16/bfloat16 q. Any strides: a per-tensor or per-head scale
    may be an expand()ed view. `batch`: the sequence count (q.shape[0] unless given: varlen
    calls pass theirs)."""
    if q_descale is not None:
        raise TypeError(f"q_descale scales an FP8 (torch.float8_e4m3fn) query; q is {q.dtype} "
                        "(with a float16/bfloat16 q and an FP8 cache, pass k_descale/v_descale only)")
    if not _is_fp8_cache(k_cache):
        for name, t in (("k_descale", k_descale), ("v_descale", v_descale)):
            if t is not None:
                raise ValueError(f"{name} applies to FP8 (torch.float8_e4m3fn) caches only; k_cache is {k_cache.dtype}")
        return
    batch, nheads_k = q.shape[0] if batch is None else batch, k_cache.shape[-2]
    for name, t in (("k_descale", k_descale), ("v_descale", v_descale)):
        if t is not None:
            _check_scale(name, t, batch, nheads_k, q.device)


def _check_scale(name, t, batch, nheads_k, device):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a float32 tensor of shape ({batch}, {nheads_k}) or None, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {t.dtype}")
    if tuple(t.shape) != (batch, nheads_k):
        raise ValueError(f"{name} must have shape (batch, nheads_k) = ({batch}, {nheads_k}), got {tuple(t.shape)} "
                         f"(one scale for all: scale.expand({batch}, {nheads_k}))")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} (with q), got {t.device}")


def fold_fp8_query(q, q_descale, k_cache, k_descale, batch=None, new_keys=None):
    """An FP8 (e4m3) query, FlashAttention-3's: returns (q as bfloat16, the k_descale to use).

    Every e4m3 value is a bfloat16 value, so the widening is exact. q_descale is per (sequence,
    KV head), as k_descale is, and the kernels apply k_descale to the fp32 scores
    (softmax_scale * k_descale * q.k), so q_descale * k_descale there is the exact query scale
    up to one fp32 rounding. Only when new keys are appended (new_keys given) does k_descale
    keep its meaning for the quantisation of those keys; the query is then scaled in fp32 and
    rounded to bfloat16 instead (as a bfloat16 caller's own query is). The output is bfloat16.
    An FP8 query needs an FP8 cache (q, k and v share the FP8 dtype in FlashAttention-3).
    `batch`: the sequence count (q.shape[0] unless given: varlen calls pass theirs)."""
    if not isinstance(q, torch.Tensor) or q.dtype != FP8_KV_DTYPE:
        dtype = q.dtype if isinstance(q, torch.Tensor) else type(q).__name__
        raise TypeError(f"q_descale scales an FP8 (torch.float8_e4m3fn) query; q is {dtype} "
                        "(with a float16/bfloat16 q and an FP8 cache, pass k_descale/v_descale only)")
    if not isinstance(k_cache, torch.Tensor) or not _is_fp8_cache(k_cache):
        dtype = k_cache.dtype if isinstance(k_cache, torch.Tensor) else type(k_cache).__name__
        raise TypeError(f"an FP8 (torch.float8_e4m3fn) q attends FP8 keys and values only; k is {dtype}")
    if q.dim() not in (3, 4) or k_cache.dim() not in (3, 4):
        raise ValueError(f"q must have 4 dimensions (3 for varlen), got shape {tuple(q.shape)}")
    batch = q.shape[0] if batch is None else batch
    nheads, nheads_k = q.shape[-2], k_cache.shape[-2]
    if nheads_k == 0 or nheads % nheads_k:
        raise ValueError(f"nheads ({nheads}) must be a multiple of the cache's nheads_k ({nheads_k})")
    widened = q.to(torch.bfloat16)
    if q_descale is None:
        return widened, k_descale
    _check_scale("q_descale", q_descale, batch, nheads_k, q.device)
    if new_keys is None:
        return widened, q_descale if k_descale is None else k_descale * q_descale
    if new_keys.dtype != torch.bfloat16:
        raise TypeError(f"with an FP8 q, the new k and v are bfloat16 (stored as e4m3(x / descale)), got {new_keys.dtype}")
    per_head = q_descale.repeat_interleave(nheads // nheads_k, dim=1)
    return (q.float() * per_head[:, None, :, None]).to(torch.bfloat16), k_descale


def _check_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, block_table, cache_batch_idx, heads_first=False):
    """The tensors' shapes, dtypes and devices. Returns (q's shape, k_cache's shape, fp8, q's device):
    attend_to_cache runs once per layer of every decode step, so each attribute is read once
    and the per-tensor loops run only to name the culprit of a failed check. heads_first: q,
    k_cache and v_cache are 4-D (batch, heads, seq, dim) views, checked (and their shapes returned)
    as the (batch, seq, heads, dim) tensors they view (validation.seq_first)."""
    tensors = (("q", q), ("k_cache", k_cache), ("v_cache", v_cache))
    if not (isinstance(q, torch.Tensor) and isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)):
        for name, t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    q_shape, cache_shape, v_shape = q.shape, k_cache.shape, v_cache.shape
    if heads_first:
        q_shape, cache_shape, v_shape = seq_first(q_shape), seq_first(cache_shape), seq_first(v_shape)
    if len(q_shape) != 4 or len(cache_shape) != 4 or len(v_shape) != 4:
        for name, t in tensors:
            if t.dim() != 4:
                raise ValueError(f"{name} must have 4 dimensions, got shape {tuple(t.shape)}")
    batch, _, nheads, head_dim = q_shape
    dtype = q.dtype
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q has dtype {dtype}; supported dtypes: {_DTYPE_NAMES}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if cache_shape != v_shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {tuple(cache_shape)} and {tuple(v_shape)}")
    nheads_k = cache_shape[2]
    if cache_shape[3] != head_dim:
        raise ValueError(f"k_cache's head dim {cache_shape[3]} differs from q's {head_dim}")
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(f"nheads ({nheads}) must be a multiple of the cache's nheads_k ({nheads_k})")
    cache_dtype = k_cache.dtype
    fp8 = FP8_KV_DTYPE is not None and cache_dtype == FP8_KV_DTYPE
    if fp8 and dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"an FP8 (float8_e4m3fn) cache needs a float16 or bfloat16 q, got {dtype}")
    device = q.device
    if not fp8:
        cache_dtype = dtype
    if k_cache.dtype != cache_dtype or v_cache.dtype != cache_dtype or k_cache.device != device or v_cache.device != device:
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.dtype != cache_dtype or t.device != device:
                raise ValueError(f"{name} must have q's dtype or torch.float8_e4m3fn (both caches the same) and q's "
                                 f"device ({dtype}, {device}), got {t.dtype}, {t.device}")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new keys and values to append)")
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"{name} must be a 4-d tensor (batch, seqlen_new, nheads_k, headdim)")
            if (t.shape[0], t.shape[2], t.shape[3]) != (batch, nheads_k, head_dim) or t.shape[1] != k.shape[1]:
                raise ValueError(f"{name} must have shape ({batch}, seqlen_new, {nheads_k}, {head_dim}), got {tuple(t.shape)}")
            if t.dtype != q.dtype or t.device != q.device:
                raise ValueError(f"{name} must match q's dtype and device ({q.dtype}, {q.device})")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.device != q.device:
                raise ValueError(f"{name} must be a 2-d tensor (seqlen_ro, rotary_dim / 2) on {q.device}")
        if rotary_cos.shape != rotary_sin.shape or 2 * rotary_cos.shape[1] > head_dim or rotary_cos.shape[1] == 0:
            raise ValueError(f"rotary_cos/rotary_sin must share a shape (seqlen_ro, rotary_dim / 2) with rotary_dim <= headdim ({head_dim}), got {tuple(rotary_cos.shape)} and {tuple(rotary_sin.shape)}")
        if rotary_cos.stride(1) != 1 or rotary_sin.stride() != rotary_cos.stride():
            raise ValueError("rotary_cos and rotary_sin must be contiguous along their last dimension, with equal strides")
        if rotary_cos.dtype not in (torch.float16, torch.bfloat16, torch.float32) or rotary_sin.dtype != rotary_cos.dtype:
            raise TypeError(f"rotary_cos/rotary_sin must share a dtype among float16, bfloat16, float32, got {rotary_cos.dtype}, {rotary_sin.dtype}")
    if block_table is not None:
        check_block_table(block_table, batch, q.device)
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with block_table")
    elif cache_shape[0] < 1:
        raise ValueError("k_cache must hold at least one sequence")
    return q_shape, cache_shape, fp8, device


def attend_to_cache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                    cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                    window_size, softcap, rotary_interleaved, alibi_slopes, return_softmax_lse,
                    num_splits, varlen_attention, k_descale=None, v_descale=None, q_descale=None, sm_margin=0,
                    heads_first=False):
    """flash_attn_with_kvcache's eager body (api.py validated sm_margin and routed out=, s_aux and
    torch.compile elsewhere). heads_first: q, k_cache and v_cache are 4-D (batch, heads, seq, dim)
    views of the tensors flash_attn_with_kvcache takes (the transformers integration's key-bounds
    decode step): read as those by the checks and the decode launch (same pointers, the strides of
    dims 1 and 2 swapped), with no view made; new k / v, rotary tables, FP8 descales and paged
    caches take the (batch, seq, heads, dim) views first, as does the gather route."""
    if heads_first and (k is not None or rotary_cos is not None or block_table is not None
                        or k_descale is not None or v_descale is not None):
        q, k_cache, v_cache, heads_first = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2), False
    q_shape, cache_shape, fp8, device = _check_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, block_table,
                                                    cache_batch_idx, heads_first)
    if k_descale is not None or v_descale is not None or q_descale is not None or fp8:
        _check_descales(q, k_cache, k_descale, v_descale, q_descale)
    batch, seqlen_q, nheads, head_dim = q_shape
    paged = block_table is not None
    capacity = block_table.shape[1] * cache_shape[1] if paged else cache_shape[1]
    seqlen_new = 0 if k is None else k.shape[1]
    if rotary_cos is not None and rotary_cos.shape[0] < capacity:
        # flash-attn's rule (a shape check, no value read): every cache row has a position.
        raise ValueError(f"rotary_cos/rotary_sin must have at least as many rows as the cache capacity "
                         f"({capacity}), got {rotary_cos.shape[0]}")
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0 = chosen from the shapes), got {num_splits!r}")
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("cache_seqlens is required when appending k/v (where to write them)")
        cache_seqlens = capacity
    cache_seqlens = _int32_vector("cache_seqlens", cache_seqlens, batch, device)
    leftpad = None if cache_leftpad is None else _int32_vector("cache_leftpad", cache_leftpad, batch, device)
    if cache_batch_idx is not None:
        cache_batch_idx = _int32_vector("cache_batch_idx", cache_batch_idx, batch, device)
    scale, window_left, window_right = check_options(
        0.0, softmax_scale, causal, window_size, softcap, alibi_slopes, batch, nheads, head_dim, device)
    values = None
    if device.type == HOST_CHECKED_DEVICE_TYPE or _DEBUG_CHECKS:  # free on the CPU; a sync on a GPU (opt-in)
        values = _check_values(cache_seqlens, seqlen_new, leftpad, cache_batch_idx, block_table, capacity, k_cache)
    if batch == 0:
        out = q.new_empty(q_shape)
        lse = torch.empty((0, nheads, seqlen_q), dtype=torch.float32, device=device)
        return (out, lse) if return_softmax_lse else out
    q_per_token = window_left >= 0 or window_right >= 0

    bits = dispatch.feature_bits(window_left, window_right, softcap, alibi_slopes is not None, 0.0,
                                 nheads != cache_shape[2], False, paged, False, False, True, False, fp8)
    backend = dispatch.DISPATCHER.decode_backend_for(device, q.dtype, head_dim, bits)
    if fp8 and head_dim % FP8_KERNEL_HEAD_DIM_MULTIPLE:
        backend = None  # the e4m3 loads move 16 values at a time; the reference path serves it
    if backend is None:
        if heads_first:
            q, k_cache, v_cache = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)
        descales = None
        if fp8:
            # The gather path attends in float32 on the reference backend; this dispatch only
            # warns (once) why no kernel serves the call, or raises for a forced backend.
            dispatch.DISPATCHER.backend_for(device, q.dtype, head_dim, bits)
            descales = (k_descale, v_descale)
        return _gather_and_attend(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, leftpad,
            block_table, scale, window_left, window_right, softcap, rotary_interleaved, alibi_slopes,
            return_softmax_lse, q_per_token, varlen_attention, values, descales, sm_margin)

    errors = error_buffer(device)
    q_in = q
    if q.stride(-1) != 1:  # a heads-first q: the heads-first view of the seq-first call's copy
        q_in = q.transpose(1, 2).contiguous().transpose(1, 2) if heads_first else q.contiguous()
    rotate_q = rotary_cos is not None
    if k is not None or rotate_q:
        q_rot = torch.empty_like(q_in) if rotate_q else None
        backend.kvcache_append(
            k_cache, v_cache, None if k is None else _last_contiguous(k), None if v is None else _last_contiguous(v),
            q_in, q_rot, cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
            block_table=block_table, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
            rotary_interleaved=rotary_interleaved, q_position_per_token=q_per_token, errors=errors,
            k_descale=k_descale, v_descale=v_descale)
        if rotate_q:
            q_in = q_rot
    out, lse = run_decode(  # by position: the hot path of a static cache's decode step
        backend, q_in, k_cache, v_cache, return_softmax_lse, scale, window_left, window_right, float(softcap),
        alibi_slopes, num_splits, None, None, 0, 0, cache_seqlens, seqlen_new, leftpad, cache_batch_idx,
        block_table, None, None, errors, k_descale, v_descale, sm_margin, heads_first)
    return (out, lse) if return_softmax_lse else out


def quantize_fp8(x, descale, batch_rows=None):
    """e4m3(x / descale) of x (batch, seqlen, nheads_k, headdim): round to nearest even,
    saturated to +-FP8_MAX (torch's own cast would turn values past it into NaN). descale:
    None (1.0) or (batch, nheads_k), of which batch_rows picks x's rows."""
    scaled = x.float()
    if descale is not None:
        d = descale if batch_rows is None else descale[batch_rows]
        scaled = scaled / d[:, None, :, None]
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def _bytes_if_fp8(cache):
    return cache.view(torch.uint8) if _is_fp8_cache(cache) else cache


def dequantize_fp8(rows, descale, owner):
    """float32 rows (n, nheads_k, headdim) of an e4m3 cache times descale[owner[i], hk]."""
    values = rows.float()
    return values if descale is None else values * descale[owner][:, :, None]


def _reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, scale,
                      causal, window_size, softcap, alibi_slopes, deterministic, return_lse, sm_margin=0):
    """flash_attn_varlen_func's signature on the reference backend directly (the FP8 gather path's
    float32 call: dispatching it would warn about float32, not about what the caller asked).
    sm_margin: accepted and ignored, as the reference backend does."""
    out = torch.empty_like(q)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    dispatch.get_backend("reference").forward(
        q, k, v, out, lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, softmax_scale=scale, window_left=window_size[0], window_right=window_size[1],
        softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, rng_seed=0, rng_offset=0)
    return out, lse, None


def _last_contiguous(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def _host_values(cache_seqlens, leftpad, cache_batch_idx, block_table):
    """The per-sequence metadata as host lists (one read per tensor: a sync on a GPU)."""
    return (cache_seqlens.tolist(), None if leftpad is None else leftpad.tolist(),
            None if cache_batch_idx is None else cache_batch_idx.tolist(),
            None if block_table is None else block_table.tolist())


def _problem(b, cs, lp, bi, bt, seqlen_new, capacity, extent, page):
    """None, or (argument, value, message) for sequence b's first out-of-range value: the
    rule the decode kernels apply on the device (common/decode_sequence.h, Sequence::valid)."""
    c = cs[b]
    if not 0 <= c <= capacity - seqlen_new:
        return ("cache_seqlens", c, f"cache_seqlens[{b}] = {c} is out of range: it must be in "
                f"[0, {capacity - seqlen_new}] (the cache holds {capacity} rows per sequence and "
                f"{seqlen_new} new tokens are appended)")
    end = c + seqlen_new
    start = 0 if lp is None else lp[b]
    if not 0 <= start <= end:
        return ("cache_leftpad", start, f"cache_leftpad[{b}] = {start} is out of range: it must be in "
                f"[0, {end}] (cache_seqlens[{b}] + seqlen_new)")
    if bi is not None and not 0 <= bi[b] < extent:
        return ("cache_batch_idx", bi[b], f"cache_batch_idx[{b}] = {bi[b]} is out of range: it must be in "
                f"[0, {extent - 1}] (k_cache has {extent} entries)")
    first = min(start, c)
    if bt is not None and end > first:
        for slot in range(first // page, (end - 1) // page + 1):
            number = bt[b][slot]
            if not 0 <= number < extent:
                return ("block_table", number, f"block_table[{b}, {slot}] = {number} is out of range: it must "
                        f"be in [0, {extent - 1}] (k_cache has {extent} pages; sequence {b} uses rows "
                        f"[{first}, {end}) of its pages)")
    return None


def _problems(values, seqlen_new, capacity, k_cache, paged):
    cs, lp, bi, bt = values
    extent, page = k_cache.shape[0], k_cache.shape[1]
    return [_problem(b, cs, lp, bi, bt, seqlen_new, capacity, extent, page if paged else 1)
            for b in range(len(cs))]


def _check_values(cache_seqlens, seqlen_new, leftpad, cache_batch_idx, block_table, capacity, k_cache):
    """Host-side check of every per-sequence value: always for CPU tensors (free there), with
    PORTATTN_DEBUG_CHECKS=1 on a GPU (a sync). Raises the first problem's ValueError."""
    values = _host_values(cache_seqlens, leftpad, cache_batch_idx, block_table)
    for problem in _problems(values, seqlen_new, capacity, k_cache, block_table is not None):
        if problem is not None:
            raise ValueError(problem[2])
    return values


def _gather_and_attend(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                       leftpad, block_table, scale, window_left, window_right, softcap,
                       rotary_interleaved, alibi_slopes, return_softmax_lse, q_per_token,
                       varlen_attention, values=None, descales=None, sm_margin=0):
    """The reference path: check the metadata on the host (it reads the lengths anyway), append
    in place through the caller's own tensors (any strides: advanced-index writes into
    k_cache / v_cache themselves, never into a reshaped copy), gather the live keys, attend.

    A sequence with an out-of-range value (only possible on a GPU: CPU tensors were checked
    before) is contained as the decode kernels contain it (portattn/errors.py): nothing
    appended, no key read, output 0 and LSE -inf, and the device's error buffer records it.

    descales: None, or (k_descale, v_descale) of an FP8 cache: new rows are quantised into it,
    the gathered rows dequantised in float32 and attended to in float32 on the reference
    backend (the result rounded to q's dtype once)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    device = q.device
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    page = k_cache.shape[1] if paged else 1
    seqlen_new = 0 if k is None else k.shape[1]
    if values is None:
        values = _host_values(cache_seqlens, leftpad, cache_batch_idx, block_table)
    problems = _problems(values, seqlen_new, capacity, k_cache, paged)
    if any(problem is not None for problem in problems):  # a GPU: CPU tensors were checked before
        from . import errors

        recorded = set()
        for b, problem in enumerate(problems):
            if problem is not None and problem[0] not in recorded:
                recorded.add(problem[0])
                errors.record(device, problem[0], b, problem[1])
    cs, lp, bi, bt = values
    good = [b for b in range(batch) if problems[b] is None]

    def where(b, pos):  # (entry or page, row) of sequence b's cache position pos
        if paged:
            return bt[b][pos // page], pos % page
        return (b if bi is None else bi[b]), pos

    def index(pairs):
        firsts = torch.tensor([e for e, _ in pairs], dtype=torch.long, device=device)
        seconds = torch.tensor([r for _, r in pairs], dtype=torch.long, device=device)
        return firsts, seconds

    base = cache_seqlens.long().unsqueeze(1)  # flash-attn 2: absolute cache index
    if rotary_cos is not None:
        if k is not None:
            k = apply_rotary(k, rotary_cos, rotary_sin, base + torch.arange(seqlen_new, device=device), rotary_interleaved)
        q_offsets = torch.arange(seqlen_q, device=device) if q_per_token else torch.zeros(seqlen_q, dtype=torch.long, device=device)
        q = apply_rotary(q, rotary_cos, rotary_sin, base + q_offsets, rotary_interleaved)

    if k is not None and good and seqlen_new:  # append in place, valid sequences only
        rows = index([where(b, cs[b] + i) for b in good for i in range(seqlen_new)])
        chosen = torch.tensor(good, dtype=torch.long, device=device)
        new_k, new_v = k[chosen], v[chosen]
        if descales is not None:
            # Indexed through byte views: the same bytes, and index_put needs no float8 kernel.
            new_k = quantize_fp8(new_k, descales[0], chosen).view(torch.uint8)
            new_v = quantize_fp8(new_v, descales[1], chosen).view(torch.uint8)
        _bytes_if_fp8(k_cache)[rows] = new_k.reshape(-1, *k.shape[2:]).to(_bytes_if_fp8(k_cache).dtype)
        _bytes_if_fp8(v_cache)[rows] = new_v.reshape(-1, *v.shape[2:]).to(_bytes_if_fp8(v_cache).dtype)

    spans = [(0, 0) if problems[b] is not None else (0 if lp is None else lp[b], cs[b] + seqlen_new)
             for b in range(batch)]
    rows = index([where(b, pos) for b, (s, e) in enumerate(spans) for pos in range(s, e)])
    lengths = [e - s for s, e in spans]
    cu_seqlens_k = torch.tensor([0] + lengths, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
    cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=device) * seqlen_q
    keys, values_ = _bytes_if_fp8(k_cache)[rows], _bytes_if_fp8(v_cache)[rows]
    q_packed = q.reshape(batch * seqlen_q, nheads, head_dim)
    if descales is not None:
        owner = torch.repeat_interleave(torch.arange(batch, device=device), torch.tensor(lengths, device=device))
        keys = dequantize_fp8(keys.view(FP8_KV_DTYPE), descales[0], owner)
        values_ = dequantize_fp8(values_.view(FP8_KV_DTYPE), descales[1], owner)
        q_packed, varlen_attention = q_packed.float(), _reference_varlen
    with torch.no_grad():  # inference only: the cache has no gradient
        out, lse, _ = varlen_attention(
            q_packed, keys, values_, cu_seqlens_q,
            cu_seqlens_k, seqlen_q, max(lengths), 0.0, scale,
            False, (window_left, window_right), softcap, alibi_slopes, False, True, sm_margin=sm_margin,
        )
    out = out.to(q.dtype).reshape(batch, seqlen_q, nheads, head_dim)
    if return_softmax_lse:
        return out, lse.reshape(nheads, batch, seqlen_q).transpose(0, 1)
    return out
