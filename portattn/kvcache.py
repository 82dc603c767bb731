"""KV-cache plumbing for flash_attn_with_kvcache and paged varlen calls.

No kernel reads a paged or left-padded cache directly yet (the support matrix
says paged_kv: no), so these functions turn such a call into a packed varlen
call: rotate, append in place, gather the live keys, attend. Gathering copies
the live part of the cache once per call; that is O(cached tokens), never
O(seqlen^2), and correct for every backend.
"""
from __future__ import annotations

import torch

from .validation import check_options


def _int32_vector(name, value, batch, device):
    if isinstance(value, int) and not isinstance(value, bool):
        return torch.full((batch,), value, dtype=torch.int32, device=device)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be an int or an int32 tensor of shape ({batch},), got {type(value).__name__}")
    if value.dtype != torch.int32 or tuple(value.shape) != (batch,):
        raise ValueError(f"{name} must be an int32 tensor of shape ({batch},), got {value.dtype} {tuple(value.shape)}")
    return value


def apply_rotary(x, cos, sin, positions, interleaved):
    """Rotate the first rotary_dim features of x (batch, seqlen, heads, dim) at positions (batch, seqlen)."""
    rotary_dim = cos.shape[-1] * 2
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


def gather_paged(k_cache, v_cache, block_table, cu_seqlens_k):
    """Paged (num_blocks, page, Hk, D) caches + per-sequence lengths -> packed (total_k, Hk, D)."""
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise ValueError(f"block_table must be int32 (batch, max_blocks), got {block_table.dtype} {tuple(block_table.shape)}")
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


def attend_to_cache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                    cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                    window_size, softcap, rotary_interleaved, alibi_slopes, return_softmax_lse,
                    varlen_attention):
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions, got shape {tuple(t.shape)}")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new keys and values to append)")
    batch, seqlen_q, nheads, head_dim = q.shape
    device = q.device
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    seqlen_new = 0 if k is None else k.shape[1]
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("cache_seqlens is required when appending k/v (where to write them)")
        cache_seqlens = capacity
    cache_seqlens = _int32_vector("cache_seqlens", cache_seqlens, batch, device)
    leftpad = None if cache_leftpad is None else _int32_vector("cache_leftpad", cache_leftpad, batch, device)
    check_options(0.0, softmax_scale, causal, window_size, softcap, alibi_slopes, batch, nheads, head_dim, device)
    if cache_batch_idx is not None and paged:
        raise ValueError("cache_batch_idx cannot be combined with block_table")
    batch_rows = torch.arange(batch, device=device) if cache_batch_idx is None else cache_batch_idx.long()

    start = torch.zeros_like(cache_seqlens) if leftpad is None else leftpad
    if int((cache_seqlens + seqlen_new).max()) > capacity:
        raise ValueError(f"cache_seqlens + seqlen_new exceeds the cache capacity ({capacity})")

    # Rotary positions count from the sequence's first live key (flash-attn semantics).
    base = (cache_seqlens - start).long().unsqueeze(1)
    if rotary_cos is not None:
        if k is not None:
            k = apply_rotary(k, rotary_cos, rotary_sin, base + torch.arange(seqlen_new, device=device), rotary_interleaved)
        q_offsets = torch.arange(seqlen_q, device=device) if (causal or window_size != (-1, -1)) else torch.zeros(seqlen_q, dtype=torch.long, device=device)
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
        cu_seqlens_k, seqlen_q, max(e - s for s, e in zip(starts, ends)), 0.0, softmax_scale,
        causal, tuple(window_size), softcap, alibi_slopes, False, True,
    )
    out = out.reshape(batch, seqlen_q, nheads, head_dim)
    if return_softmax_lse:
        return out, lse.reshape(nheads, batch, seqlen_q).transpose(0, 1)
    return out
