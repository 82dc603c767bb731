"""flash_attn_with_kvcache: validate, then attend in place (decode kernels) or by gathering.

On a compiled backend with decode kernels (dispatch.decode_backend_for), the new keys
and values are appended (and rotated) on the device, and the split-KV kernels read
the cache in place, contiguous or paged (Note [portattn decode]). Nothing on this path
reads a tensor's values on the host, so a decode step can be captured in a CUDA graph.

Elsewhere (the reference backend, CPU, float32, ROCm until its decode kernels are
verified) the same call is turned into a packed varlen call: rotate, append in place,
gather the live keys, attend. Gathering copies the live part of the cache once per
call and reads the lengths on the host.

Semantics (flash-attn 2): sequence b's live keys are cache rows [leftpad, cache_seqlens)
followed by the new ones; new key i is written at row cache_seqlens[b] + i and rotated
at that index (which counts the left padding); queries are rotated at cache_seqlens[b],
plus their own index when the attention is causal or local.
"""
from __future__ import annotations

import os

import torch

from . import dispatch
from .decode import run_decode
from .validation import check_options

# Opt-in host-side checks of the values the kernels otherwise clamp on the device.
_DEBUG_CHECKS = os.environ.get("PORTATTN_DEBUG_CHECKS", "0") == "1"


def _int32_vector(name, value, batch, device):
    if isinstance(value, int) and not isinstance(value, bool):
        return torch.full((batch,), value, dtype=torch.int32, device=device)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be an int or an int32 tensor of shape ({batch},), got {type(value).__name__}")
    if value.dtype != torch.int32 or tuple(value.shape) != (batch,):
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


def gather_paged(k_cache, v_cache, block_table, cu_seqlens_k):
    """Paged (num_blocks, page, Hk, D) caches + per-sequence lengths -> packed (total_k, Hk, D)."""
    check_block_table(block_table, cu_seqlens_k.shape[0] - 1, k_cache.device)
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"paged k_cache/v_cache must share shape (num_blocks, page_block_size, nheads_k, headdim), got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    lengths = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
    page = k_cache.shape[1]
    if max(lengths, default=0) > block_table.shape[1] * page:
        raise ValueError(f"a sequence of {max(lengths)} keys does not fit block_table's {block_table.shape[1]} blocks of {page}")
    rows = torch.cat([
        _cache_rows(block_table, torch.tensor([b], device=k_cache.device), page,
                    torch.arange(n, device=k_cache.device).unsqueeze(0)).flatten()
        for b, n in enumerate(lengths)
    ])
    flat_k = k_cache.reshape(-1, *k_cache.shape[2:])
    flat_v = v_cache.reshape(-1, *v_cache.shape[2:])
    return flat_k[rows], flat_v[rows], cu_seqlens_k


def _check_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, block_table, cache_batch_idx):
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions, got shape {tuple(t.shape)}")
    batch, _, nheads, head_dim = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    nheads_k = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache's head dim {k_cache.shape[3]} differs from q's {head_dim}")
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(f"nheads ({nheads}) must be a multiple of the cache's nheads_k ({nheads_k})")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must match q's dtype and device ({q.dtype}, {q.device}), got {t.dtype}, {t.device}")
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
    elif k_cache.shape[0] < 1:
        raise ValueError("k_cache must hold at least one sequence")


def attend_to_cache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                    cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                    window_size, softcap, rotary_interleaved, alibi_slopes, return_softmax_lse,
                    num_splits, varlen_attention):
    _check_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, block_table, cache_batch_idx)
    batch, seqlen_q, nheads, head_dim = q.shape
    device = q.device
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    seqlen_new = 0 if k is None else k.shape[1]
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
    if _DEBUG_CHECKS:
        _check_values(cache_seqlens, seqlen_new, leftpad, cache_batch_idx, block_table, capacity, k_cache.shape[0])
    q_per_token = window_left >= 0 or window_right >= 0

    bits = dispatch.feature_bits(window_left, window_right, softcap, alibi_slopes is not None, 0.0,
                                 nheads != k_cache.shape[2], False, paged_kv=paged, decode=True)
    backend = dispatch.DISPATCHER.decode_backend_for(device, q.dtype, head_dim, bits)
    if backend is None:
        return _gather_and_attend(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, leftpad,
            block_table, scale, window_left, window_right, softcap, rotary_interleaved, alibi_slopes,
            return_softmax_lse, q_per_token, varlen_attention)

    q_in = q if q.stride(-1) == 1 else q.contiguous()
    rotate_q = rotary_cos is not None
    if k is not None or rotate_q:
        q_rot = torch.empty_like(q_in) if rotate_q else None
        backend.kvcache_append(
            k_cache, v_cache, None if k is None else _last_contiguous(k), None if v is None else _last_contiguous(v),
            q_in, q_rot, cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
            block_table=block_table, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
            rotary_interleaved=rotary_interleaved, q_position_per_token=q_per_token)
        if rotate_q:
            q_in = q_rot
    out, lse = run_decode(
        backend, q_in, k_cache, v_cache, need_lse=return_softmax_lse, softmax_scale=scale,
        window_left=window_left, window_right=window_right, softcap=float(softcap),
        alibi_slopes=alibi_slopes, num_splits=num_splits, cache_seqlens=cache_seqlens,
        seqlen_new=seqlen_new, cache_leftpad=leftpad, cache_batch_idx=cache_batch_idx,
        block_table=block_table)
    return (out, lse) if return_softmax_lse else out


def _last_contiguous(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_values(cache_seqlens, seqlen_new, leftpad, cache_batch_idx, block_table, capacity, first_extent):
    """PORTATTN_DEBUG_CHECKS=1: the host-side checks (a device sync) the kernels otherwise replace by clamping."""
    ends = cache_seqlens.long() + seqlen_new
    if bool((cache_seqlens < 0).any()) or bool((ends > capacity).any()):
        raise ValueError(f"cache_seqlens must be in [0, {capacity - seqlen_new}] (cache capacity {capacity} minus {seqlen_new} new tokens)")
    if leftpad is not None and bool(((leftpad < 0) | (leftpad.long() > ends)).any()):
        raise ValueError("cache_leftpad must be in [0, cache_seqlens + seqlen_new] for every sequence")
    if cache_batch_idx is not None and bool(((cache_batch_idx < 0) | (cache_batch_idx >= first_extent)).any()):
        raise ValueError(f"cache_batch_idx must be in [0, {first_extent - 1}] (k_cache's batch extent)")
    if block_table is not None and bool(((block_table < 0) | (block_table >= first_extent)).any()):
        raise ValueError(f"block_table entries must be in [0, {first_extent - 1}] (k_cache's number of pages)")


def _gather_and_attend(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                       leftpad, block_table, scale, window_left, window_right, softcap,
                       rotary_interleaved, alibi_slopes, return_softmax_lse, q_per_token,
                       varlen_attention):
    batch, seqlen_q, nheads, head_dim = q.shape
    device = q.device
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    seqlen_new = 0 if k is None else k.shape[1]
    batch_rows = torch.arange(batch, device=device) if cache_batch_idx is None else cache_batch_idx.long()
    start = torch.zeros_like(cache_seqlens) if leftpad is None else leftpad
    if int((cache_seqlens + seqlen_new).max()) > capacity:
        raise ValueError(f"cache_seqlens + seqlen_new exceeds the cache capacity ({capacity})")

    base = cache_seqlens.long().unsqueeze(1)  # flash-attn 2: absolute cache index
    if rotary_cos is not None:
        if k is not None:
            k = apply_rotary(k, rotary_cos, rotary_sin, base + torch.arange(seqlen_new, device=device), rotary_interleaved)
        q_offsets = torch.arange(seqlen_q, device=device) if q_per_token else torch.zeros(seqlen_q, dtype=torch.long, device=device)
        q = apply_rotary(q, rotary_cos, rotary_sin, base + q_offsets, rotary_interleaved)

    flat_k = k_cache.reshape(-1, *k_cache.shape[2:])
    flat_v = v_cache.reshape(-1, *v_cache.shape[2:])
    row_len = k_cache.shape[1]

    def rows_for(positions):  # positions: (B, n) long
        if paged:
            return _cache_rows(block_table, torch.arange(batch, device=device), row_len, positions)
        return batch_rows.unsqueeze(1) * row_len + positions

    if k is not None:  # append in place
        positions = cache_seqlens.long().unsqueeze(1) + torch.arange(seqlen_new, device=device)
        rows = rows_for(positions).flatten()
        flat_k[rows] = k.reshape(-1, *k.shape[2:]).to(k_cache.dtype)
        flat_v[rows] = v.reshape(-1, *v.shape[2:]).to(v_cache.dtype)

    ends = (cache_seqlens + seqlen_new).tolist()
    starts = start.tolist()
    gathered = [rows_for(torch.arange(s, e, device=device).unsqueeze(0).expand(batch, -1))[b]
                for b, (s, e) in enumerate(zip(starts, ends))]
    rows = torch.cat(gathered)
    lengths = torch.tensor([e - s for s, e in zip(starts, ends)], dtype=torch.int32, device=device)
    cu_seqlens_k = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    cu_seqlens_k[1:] = torch.cumsum(lengths, 0)
    cu_seqlens_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=device)
    out, lse, _ = varlen_attention(
        q.reshape(batch * seqlen_q, nheads, head_dim), flat_k[rows], flat_v[rows], cu_seqlens_q,
        cu_seqlens_k, seqlen_q, max(e - s for s, e in zip(starts, ends)), 0.0, scale,
        False, (window_left, window_right), softcap, alibi_slopes, False, True,
    )
    out = out.reshape(batch, seqlen_q, nheads, head_dim)
    if return_softmax_lse:
        return out, lse.reshape(nheads, batch, seqlen_q).transpose(0, 1)
    return out
