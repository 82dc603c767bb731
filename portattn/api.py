"""The public API: flash-attn's names, argument order, defaults, shapes and semantics.

Switching from flash-attn is an import change: `from portattn import flash_attn_func`.
Differences, all deliberate and documented in README:
- `return_attn_probs=True` returns (out, softmax_lse, None): no backend materialises
  the O(seqlen^2) probability matrix.
- `flash_attn_with_kvcache` reads the cache in place on the decode kernels (kvcache.py,
  decode.py); where no compiled backend has them, and for paged varlen calls that are
  not decode-shaped, the cache is gathered into a packed varlen call first.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import dispatch
from .ops import attention
from .validation import check_cu_seqlens, check_options, check_qkv, check_varlen


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    # Kernels read 16-byte vectors along the head dim; any other stride is fine.
    return t if t.stride(-1) == 1 else t.contiguous()


def _dense_call(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_attn_probs):
    batch, seqlen_q, seqlen_k, nheads, _, head_dim = check_qkv(q, k, v, varlen=False)
    scale, window_left, window_right = check_options(
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, batch, nheads,
        head_dim, q.device,
    )
    out, lse = attention(
        _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v), alibi_slopes,
        None, None, seqlen_q, seqlen_k, scale, window_left, window_right, float(softcap),
        float(dropout_p), bool(deterministic), return_attn_probs,
    )
    return (out, lse, None) if return_attn_probs else out


def _varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                 softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                 return_attn_probs):
    _, total_q, total_k, nheads, _, head_dim = check_qkv(q, k, v, varlen=True)
    batch, max_seqlen_q, max_seqlen_k = check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                     max_seqlen_k, total_q, total_k, q.device)
    scale, window_left, window_right = check_options(
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, batch, nheads,
        head_dim, q.device,
    )
    out, lse = attention(
        _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v), alibi_slopes,
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, window_left, window_right,
        float(softcap), float(dropout_p), bool(deterministic), return_attn_probs,
    )
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """Exact attention. q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim).

    causal is aligned to the bottom-right of the score matrix; window_size=(left, right)
    limits each query to keys in [i + sk - sq - left, i + sk - sq + right] (-1 = unbounded).
    Returns out (batch, seqlen_q, nheads, headdim), or (out, softmax_lse, None) with
    return_attn_probs=True (softmax_lse: float32 (batch, nheads, seqlen_q)).
    """
    return _dense_call(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                       alibi_slopes, deterministic, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """qkv: (batch, seqlen, 3, nheads, headdim). Gradients flow back into qkv."""
    _check_packed("qkv", qkv, rank=5, count=3)
    return _dense_call(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale,
                       causal, window_size, softcap, alibi_slopes, deterministic,
                       return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """q: (batch, seqlen_q, nheads, headdim); kv: (batch, seqlen_k, 2, nheads_k, headdim)."""
    _check_packed("kv", kv, rank=5, count=2)
    return _dense_call(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal,
                       window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None):
    """Packed variable-length sequences. q: (total_q, nheads, headdim); k, v: (total_k, nheads_k,
    headdim); cu_seqlens_*: int32 (batch + 1,) prefix sums. softmax_lse is (nheads, total_q).

    With block_table (int32 (batch, max_blocks)), k and v are paged caches
    (num_blocks, page_block_size, nheads_k, headdim) and cu_seqlens_k gives each
    sequence's key count.
    """
    if block_table is not None:
        in_place = _paged_varlen_in_place(q, k, v, block_table, cu_seqlens_q, cu_seqlens_k,
                                          max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                                          causal, window_size, softcap, alibi_slopes)
        if in_place is not None:
            out, lse = in_place
            return (out, lse, None) if return_attn_probs else out
        k, v, cu_seqlens_k = _gather_paged_varlen(k, v, block_table, cu_seqlens_k)
    return _varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                        deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """qkv: (total, 3, nheads, headdim)."""
    _check_packed("qkv", qkv, rank=4, count=3)
    return _varlen_call(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen,
                        max_seqlen, dropout_p, softmax_scale, causal, window_size, softcap,
                        alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p=0.0, softmax_scale=None, causal=False,
                                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                    deterministic=False, return_attn_probs=False):
    """q: (total_q, nheads, headdim); kv: (total_k, 2, nheads_k, headdim)."""
    _check_packed("kv", kv, rank=4, count=2)
    return _varlen_call(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                        max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                        alibi_slopes, deterministic, return_attn_probs)


def _check_packed(name, t, rank, count):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank or t.shape[-3] != count:
        layout = "(batch, seqlen, " if rank == 5 else "(total, "
        raise ValueError(f"{name} must have shape {layout}{count}, nheads, headdim), got {tuple(t.shape)}")


# ---- KV cache (inference) ----------------------------------------------------------


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                            block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """Attention over a KV cache, appending new keys/values in place first (flash-attn semantics).

    q: (batch, seqlen_q, nheads, headdim). k_cache, v_cache: (batch_cache, seqlen_cache,
    nheads_k, headdim), or with block_table (int32 (batch, max_blocks)) paged
    (num_blocks, page_block_size, nheads_k, headdim). k, v (optional): (batch, seqlen_new,
    nheads_k, headdim), written at positions cache_seqlens[b] onwards. rotary_cos/sin
    ((seqlen_ro, rotary_dim / 2)) rotate q and the new k first; cache_leftpad marks where
    each sequence starts in the cache. num_splits: how many CTAs share one sequence's keys
    (0 = chosen from the shapes and the GPU; an explicit count is honoured up to 128).
    No gradients (inference API).

    On a GPU with decode kernels the cache is read in place and nothing is read on the
    host, so the call can be captured in a CUDA graph (Note [portattn decode]); values of
    cache_seqlens, cache_leftpad, cache_batch_idx and block_table outside the cache are
    clamped on the device (PORTATTN_DEBUG_CHECKS=1 raises a ValueError instead).
    """
    from .kvcache import attend_to_cache

    return attend_to_cache(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
        cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
        rotary_interleaved, alibi_slopes, return_softmax_lse, num_splits, flash_attn_varlen_func,
    )


def _paged_varlen_in_place(q, k_cache, v_cache, block_table, cu_seqlens_q, cu_seqlens_k,
                           max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                           window_size, softcap, alibi_slopes):
    """(out, lse) of a decode-shaped paged varlen inference call, read in place by the
    decode kernels; None when the call is not one (it is then gathered first)."""
    from .decode import prefers_decode, run_decode
    from .kvcache import check_block_table

    if not isinstance(q, torch.Tensor) or q.dim() != 3 or not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4:
        return None  # the gather path reports the shape error
    if dropout_p != 0.0 or q.device.type != "cuda" or (torch.is_grad_enabled() and q.requires_grad):
        return None
    nheads, head_dim = q.shape[1], q.shape[2]
    nheads_k = k_cache.shape[2]
    if k_cache.shape != v_cache.shape or nheads_k == 0 or nheads % nheads_k or k_cache.shape[3] != head_dim:
        return None
    if not prefers_decode(max_seqlen_q, nheads // nheads_k, max_seqlen_k):
        return None
    batch = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, max_seqlen_q, q.shape[0], q.device)
    check_block_table(block_table, batch, q.device)
    scale, window_left, window_right = check_options(
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, batch, nheads,
        head_dim, q.device,
    )
    bits = dispatch.feature_bits(window_left, window_right, softcap, alibi_slopes is not None, 0.0,
                                 nheads != nheads_k, True, paged_kv=True, decode=True)
    decoder = dispatch.DISPATCHER.decode_backend_for(q.device, q.dtype, head_dim, bits)
    if decoder is None:
        return None
    return run_decode(decoder, _last_dim_contiguous(q), k_cache, v_cache, need_lse=True,
                      softmax_scale=scale, window_left=window_left, window_right=window_right,
                      softcap=float(softcap), alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q,
                      cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                      max_seqlen_k=max_seqlen_k, block_table=block_table)


def _gather_paged_varlen(k_cache, v_cache, block_table, cu_seqlens_k):
    from .kvcache import gather_paged

    return gather_paged(k_cache, v_cache, block_table, cu_seqlens_k)


# ---- explain ------------------------------------------------------------------------


class Explanation:
    """Which backend runs a call and, for every backend, why it would or would not."""

    def __init__(self, chosen: Optional[str], verdicts: list, call):
        self.chosen = chosen
        self.reasons = {name: reasons for name, reasons in verdicts}
        self.call = call

    def __repr__(self) -> str:
        lines = [f"portattn would run this call ({self.call.dtype}, head_dim={self.call.head_dim}, "
                 f"features: {', '.join(sorted(self.call.features))}) on: {self.chosen}"]
        for name, reasons in self.reasons.items():
            verdict = "supported" if not reasons else "; ".join(reasons)
            lines.append(f"  {name}: {verdict}")
        return "\n".join(lines)

    __str__ = __repr__


def explain(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
            dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
            alibi_slopes=None, deterministic=False, backward=None):
    """For each backend, whether it would run this call and, if not, every reason why.

    Takes flash_attn_func's arguments (plus the varlen ones). `backward` defaults to
    whether q, k or v requires grad.
    """
    varlen = cu_seqlens_q is not None
    batch, _, _, nheads, nheads_k, head_dim = check_qkv(q, k, v, varlen=varlen)
    if varlen:
        batch = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, max_seqlen_q, q.shape[0], q.device)
    _, window_left, window_right = check_options(
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, batch, nheads,
        head_dim, q.device,
    )
    if backward is None:
        backward = q.requires_grad or k.requires_grad or v.requires_grad
    bits = dispatch.feature_bits(window_left, window_right, softcap, alibi_slopes is not None,
                                 dropout_p, nheads != nheads_k, varlen, backward, deterministic)
    call = dispatch.call_spec(q.device, q.dtype, head_dim, bits)
    verdicts = [(slot.name, reasons) for slot, reasons in dispatch.DISPATCHER.evaluate(call, q.device)]
    forced = dispatch.DISPATCHER.forced
    if forced:
        chosen = forced if not dict(verdicts)[forced] else None
    else:
        chosen = next((name for name, reasons in verdicts if not reasons), None)
    return Explanation(chosen, verdicts, call)
