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
from .sinks import add_sink, check_s_aux
from .validation import check_cu_seqlens, check_options, check_qkv, check_seqused_k, check_sm_margin, check_varlen


def _last_dim_contiguous(t: torch.Tensor, heads_first: bool = False) -> torch.Tensor:
    # Kernels read 16-byte vectors along the head dim; any other stride is fine.
    if t.stride(-1) == 1:
        return t
    # A heads-first view: the heads-first view of the copy the seq-first call makes.
    return t.transpose(1, 2).contiguous().transpose(1, 2) if heads_first else t.contiguous()


def _dense_call(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_attn_probs, out=None, s_aux=None, sm_margin=0, heads_first=False):
    """flash_attn_func's body. heads_first (the transformers integration): q, k, v are 4-D
    (batch, heads, seq, dim) views of the arguments flash_attn_func takes, validated and served as
    those, with no view made on the decode kernels' route (ops.run_forward); the result is the same."""
    batch, seqlen_q, seqlen_k, nheads, _, head_dim = check_qkv(q, k, v, False, heads_first)
    scale, window_left, window_right = check_options(
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, batch, nheads,
        head_dim, q.device,
    )
    if type(sm_margin) is not int or sm_margin < 0:
        sm_margin = check_sm_margin(sm_margin)
    if out is None and s_aux is None:
        out, lse = attention(
            _last_dim_contiguous(q, heads_first), _last_dim_contiguous(k, heads_first),
            _last_dim_contiguous(v, heads_first), alibi_slopes, None, None, seqlen_q, seqlen_k, scale, window_left,
            window_right, float(softcap), float(dropout_p), bool(deterministic), return_attn_probs, None, None, None,
            sm_margin, heads_first,
        )
        return (out, lse, None) if return_attn_probs else out
    if heads_first:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    s_aux = check_s_aux(s_aux, nheads, q.device)
    written, target = _out_target(out, q, k, v)
    result, lse = attention(
        _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v), alibi_slopes,
        None, None, seqlen_q, seqlen_k, scale, window_left, window_right, float(softcap),
        float(dropout_p), bool(deterministic), return_attn_probs, s_aux=s_aux, out=written,
        sm_margin=sm_margin,
    )
    result = _finish_out(result, target)
    return (result, lse, None) if return_attn_probs else result


def _varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                 softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                 return_attn_probs, seqused_k=None, out=None, s_aux=None, sm_margin=0):
    _, total_q, total_k, nheads, _, head_dim = check_qkv(q, k, v, varlen=True)
    batch, max_seqlen_q, max_seqlen_k = check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                     max_seqlen_k, total_q, total_k, q.device)
    scale, window_left, window_right = check_options(
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, batch, nheads,
        head_dim, q.device,
    )
    if type(sm_margin) is not int or sm_margin < 0:
        sm_margin = check_sm_margin(sm_margin)
    if seqused_k is None and out is None and s_aux is None:
        out, lse = attention(
            _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v), alibi_slopes,
            cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, window_left, window_right,
            float(softcap), float(dropout_p), bool(deterministic), return_attn_probs, sm_margin=sm_margin,
        )
        return (out, lse, None) if return_attn_probs else out
    seqused_k = check_seqused_k(seqused_k, batch, q.device)
    s_aux = check_s_aux(s_aux, nheads, q.device)
    written, target = _out_target(out, q, k, v)
    result, lse = attention(
        _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v), alibi_slopes,
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, window_left, window_right,
        float(softcap), float(dropout_p), bool(deterministic), return_attn_probs, seqused_k=seqused_k,
        s_aux=s_aux, out=written, sm_margin=sm_margin,
    )
    result = _finish_out(result, target)
    return (result, lse, None) if return_attn_probs else result


def _out_target(out, q, k=None, v=None):
    """`out=`: (tensor the kernels write, tensor to copy the result into afterwards).

    out must be shaped, typed and placed like q (the output's layout). Kernels write any
    layout whose last dim is contiguous and whose rows are 16-byte aligned; other strides
    get a temporary and one copy_. Inference only: an autograd graph cannot own a caller's
    buffer."""
    if out is None:
        return None, None
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must have q's shape, dtype and device ({tuple(q.shape)}, {q.dtype}, {q.device}), "
                         f"got {tuple(out.shape)}, {out.dtype}, {out.device}")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v)):
        raise ValueError("out= is for inference: it cannot be used when q, k or v requires grad "
                         "(call under torch.no_grad(), or drop out=)")
    if torch.compiler.is_compiling():
        # A traced graph's ops return new tensors; the copy into out is an op it can hold.
        return None, out
    strides = out.stride()
    if strides[-1] == 1 and out.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in strides[:-1]):
        return out, None
    return None, out


def _finish_out(result, target):
    if target is None:
        return result
    target.copy_(result)
    return target


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                    out=None, s_aux=None, sm_margin=0):
    # help(): the docstring is assembled below (_doc), from the argument texts all functions share.
    return _dense_call(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                       alibi_slopes, deterministic, return_attn_probs, out, s_aux, sm_margin)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, *, sm_margin=0):
    # help(): the docstring is assembled below (_doc), from the argument texts all functions share.
    _check_packed("qkv", qkv, rank=5, count=3)
    return _dense_call(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale,
                       causal, window_size, softcap, alibi_slopes, deterministic,
                       return_attn_probs, None, None, sm_margin)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, *, sm_margin=0):
    # help(): the docstring is assembled below (_doc), from the argument texts all functions share.
    _check_packed("kv", kv, rank=5, count=2)
    return _dense_call(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal,
                       window_size, softcap, alibi_slopes, deterministic, return_attn_probs, None, None,
                       sm_margin)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None, *, seqused_k=None, out=None,
                           s_aux=None, num_splits=0, q_descale=None, k_descale=None, v_descale=None,
                           sm_margin=0):
    # help(): the docstring is assembled below (_doc), from the argument texts all functions share.
    if max_seqlen_q is None or max_seqlen_k is None:
        raise ValueError("max_seqlen_q and max_seqlen_k are required (ints: the longest query / key sequence)")
    if type(sm_margin) is not int or sm_margin < 0:
        sm_margin = check_sm_margin(sm_margin)
    if q_descale is not None or getattr(q, "dtype", None) is _FP8:
        from .kvcache import fold_fp8_query

        batch = (check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, max_seqlen_q, q.shape[0], q.device)
                 if isinstance(q, torch.Tensor) else None)
        q, k_descale = fold_fp8_query(q, q_descale, k, k_descale, batch=batch)
        q_descale = None
    if block_table is not None and torch.compiler.is_compiling():
        from .ops import compiled_paged_varlen

        return compiled_paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                     softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
                                     block_table, seqused_k, out, s_aux, num_splits, q_descale, k_descale, v_descale,
                                     sm_margin)
    if (q_descale is not None or k_descale is not None or v_descale is not None
            or getattr(k, "dtype", None) is _FP8 or getattr(v, "dtype", None) is _FP8):
        return _fp8_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                           softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                           return_attn_probs, block_table, seqused_k, out, s_aux, num_splits,
                           q_descale, k_descale, v_descale, sm_margin)
    if block_table is not None:
        if cu_seqlens_k is None and seqused_k is None:
            raise ValueError("with block_table, give each sequence's key count as seqused_k or cu_seqlens_k")
        in_place = _paged_varlen_in_place(q, k, v, block_table, cu_seqlens_q, cu_seqlens_k,
                                          max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                                          causal, window_size, softcap, alibi_slopes, seqused_k, out,
                                          s_aux, num_splits, sm_margin=sm_margin)
        if in_place is not None:
            result, lse = in_place
            return (result, lse, None) if return_attn_probs else result
        # Inference only (the pages have no gradient): the output carries none either.
        with torch.no_grad():
            k, v, cu_seqlens_k = _gather_paged_varlen(k, v, block_table, cu_seqlens_k, max_seqlen_k, seqused_k)
            return _varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                deterministic, return_attn_probs, None, out, s_aux, sm_margin)
    if cu_seqlens_k is None:
        raise ValueError("cu_seqlens_k is required without block_table (where each sequence's keys start)")
    return _varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                        deterministic, return_attn_probs, seqused_k, out, s_aux, sm_margin)


_FP8 = getattr(torch, "float8_e4m3fn", None)


def _fp8_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table,
                seqused_k, out, s_aux, num_splits, q_descale, k_descale, v_descale, sm_margin=0):
    """flash_attn_varlen_func on FP8 (e4m3) keys and values: a paged cache read in place by the
    decode kernels (dequantised in registers, as flash_attn_with_kvcache does), else the keys
    dequantised into q's dtype and attended as any varlen call. Inference only."""
    from .kvcache import _check_descales, dequantize_packed

    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if k.dtype is not v.dtype:
        raise TypeError(f"k and v must share one dtype, got k {k.dtype}, v {v.dtype}")
    batch = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, max_seqlen_q, q.shape[0], q.device)
    _check_descales(q, k, k_descale, v_descale, q_descale, batch=batch)
    if torch.is_grad_enabled() and q.requires_grad:
        raise ValueError("FP8 (float8_e4m3fn) k/v are inference only: call under torch.no_grad() "
                         "(or with a q that does not require grad)")
    if block_table is not None:
        if cu_seqlens_k is None and seqused_k is None:
            raise ValueError("with block_table, give each sequence's key count as seqused_k or cu_seqlens_k")
        in_place = _paged_varlen_in_place(q, k, v, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                          max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                                          alibi_slopes, seqused_k, out, s_aux, num_splits, k_descale, v_descale,
                                          sm_margin)
        if in_place is not None:
            result, lse = in_place
            return (result, lse, None) if return_attn_probs else result
        k, v, cu_seqlens_k = _gather_paged_varlen(k, v, block_table, cu_seqlens_k, max_seqlen_k, seqused_k)
        seqused_k = None
    elif cu_seqlens_k is None:
        raise ValueError("cu_seqlens_k is required without block_table (where each sequence's keys start)")
    elif not isinstance(cu_seqlens_k, torch.Tensor) or cu_seqlens_k.dim() != 1 or cu_seqlens_k.shape[0] != batch + 1:
        check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, max_seqlen_k, None, q.device)  # names the problem
        raise ValueError("cu_seqlens_q and cu_seqlens_k must describe the same batch")
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must share one shape (total_k, nheads_k, headdim), got {tuple(k.shape)} "
                         f"and {tuple(v.shape)}")
    k, v = dequantize_packed(k, v, cu_seqlens_k, k_descale, v_descale, q.dtype)
    return _varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                        softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                        return_attn_probs, seqused_k, out, s_aux, sm_margin)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, sm_margin=0):
    # help(): the docstring is assembled below (_doc), from the argument texts all functions share.
    _check_packed("qkv", qkv, rank=4, count=3)
    return _varlen_call(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen,
                        max_seqlen, dropout_p, softmax_scale, causal, window_size, softcap,
                        alibi_slopes, deterministic, return_attn_probs, None, None, None, sm_margin)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p=0.0, softmax_scale=None, causal=False,
                                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                    deterministic=False, return_attn_probs=False, *, sm_margin=0):
    # help(): the docstring is assembled below (_doc), from the argument texts all functions share.
    _check_packed("kv", kv, rank=4, count=2)
    return _varlen_call(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                        max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                        alibi_slopes, deterministic, return_attn_probs, None, None, None, sm_margin)


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
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                            k_descale=None, v_descale=None, q_descale=None, *, out=None, s_aux=None,
                            sm_margin=0):
    # help(): the docstring is assembled below (_doc), from the argument texts all functions share.
    return _kvcache_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                         cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved,
                         alibi_slopes, num_splits, return_softmax_lse, k_descale, v_descale, q_descale, out, s_aux,
                         sm_margin, False)


def _kvcache_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                  block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
                  num_splits, return_softmax_lse, k_descale, v_descale, q_descale, out, s_aux, sm_margin,
                  heads_first):
    """flash_attn_with_kvcache's body, its arguments by position. heads_first (the transformers
    integration): q, k_cache and v_cache are 4-D (batch, heads, seq, dim) views of the arguments
    flash_attn_with_kvcache takes; kvcache.attend_to_cache serves them as those, with no view
    made on the decode kernels' route, and the other routes here get the seq-first views."""
    if type(sm_margin) is not int or sm_margin < 0:
        sm_margin = check_sm_margin(sm_margin)
    if q_descale is not None or getattr(q, "dtype", None) is _FP8:
        from .kvcache import fold_fp8_query

        if heads_first:
            q, k_cache, v_cache, heads_first = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2), False
        q, k_descale = fold_fp8_query(q, q_descale, k_cache, k_descale, new_keys=k)
        q_descale = None
    if out is not None or s_aux is not None:
        if heads_first:
            q, k_cache, v_cache = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)
        return _kvcache_with_extras(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                    cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                                    window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
                                    return_softmax_lse, out, s_aux, k_descale, v_descale, q_descale, sm_margin)
    if torch.compiler.is_compiling():
        from .kvcache import _check_descales
        from .ops import compiled_kvcache

        if heads_first:
            q, k_cache, v_cache = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)
        if k_descale is not None or v_descale is not None or q_descale is not None:
            _check_descales(q, k_cache, k_descale, v_descale, q_descale)  # shapes and dtypes: traceable
        return compiled_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                                rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse, k_descale,
                                v_descale, sm_margin)
    return _attend_to_cache()(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
        cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
        rotary_interleaved, alibi_slopes, return_softmax_lse, num_splits, flash_attn_varlen_func,
        k_descale, v_descale, q_descale, sm_margin, heads_first,
    )


def _kvcache_with_extras(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                         cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                         rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse, out, s_aux,
                         k_descale=None, v_descale=None, q_descale=None, sm_margin=0):
    """flash_attn_with_kvcache with `out=` or sinks: the call as usual, then the sinks folded in
    (sinks.py) and the result copied into out (a decode step's output is a few rows)."""
    if isinstance(q, torch.Tensor) and q.dim() == 4:
        s_aux = check_s_aux(s_aux, q.shape[2], q.device)
        _out_target(out, q)
    result, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
        block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
        True, k_descale, v_descale, q_descale, sm_margin=sm_margin)
    if s_aux is not None:
        add_sink(result, lse, s_aux, False)
    if out is not None:
        out.copy_(result)
        result = out
    return (result, lse) if return_softmax_lse else result


_KVCACHE = []


def _attend_to_cache():
    # kvcache.py imports on first use (it is not needed to import portattn); an import
    # statement inside the call costs ~0.5 us per call in importlib's parent lookups.
    if not _KVCACHE:
        from .kvcache import attend_to_cache

        _KVCACHE.append(attend_to_cache)
    return _KVCACHE[0]


# ---- docstrings -------------------------------------------------------------------------
# The arguments the attention functions share are described once here and spliced into each
# function's docstring, so help() shows every function complete and the texts cannot drift.

_SHARED_ARGS = """\
    dropout_p: float. Probability of dropping an attention weight (0.0 outside training). The
        mask is a counter-based Philox stream seeded from torch's generator, the same on every
        backend (`torch.manual_seed` reproduces it).
    softmax_scale: float. Multiplies Q K^T before the softmax. Default 1 / sqrt(headdim).
    causal: bool. Causal mask, aligned to the bottom-right corner of the score matrix (see
        below), as in flash-attn >= 2.1.
    window_size: (left, right). Sliding-window (local) attention: query i sees key j only when
        i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right; -1 leaves that
        side unbounded. (-1, -1) is full attention; causal=True is window_size=(-1, 0), and
        both together intersect.
    softcap: float. When > 0, scores become softcap * tanh(scores / softcap) before the softmax
        (Gemma-2 style); 0.0 turns it off.
    alibi_slopes: float32 tensor (nheads,) or (batch, nheads), or None. Adds
        -slope * |i + seqlen_k - seqlen_q - j| to the score of query i and key j.
    deterministic: bool. Backward only: when True, dQ is accumulated in a fixed order, so two
        runs give bitwise equal gradients (it costs time and fp32 dQ copies; README).
    return_attn_probs: bool. When True, return (out, softmax_lse, None). The probability matrix
        itself is never materialised (flash-attn returns it there, for testing only).
    sm_margin: int >= 0, keyword only (FlashAttention-3's). SMs the kernels leave free for other
        kernels running at the same time, e.g. communication in context parallelism: grids
        sized by the SM count (the Hopper forward's persistent one, the decode split count)
        plan for max(1, SMs - sm_margin). Results do not depend on it. Default 0.
"""

_SEMANTICS = """\
Causal alignment (bottom-right). With seqlen_q=2 and seqlen_k=5, the causal mask is
(1 = visible, 0 = masked):
        1 1 1 1 0
        1 1 1 1 1
and with seqlen_q=5 and seqlen_k=2:
        0 0
        0 0
        0 0
        1 0
        1 1
A row that sees no key (the first three above) outputs 0 and gets softmax_lse = -inf.

Grouped-query / multi-query attention: nheads must be a multiple of nheads_k; query head h
attends to key/value head h // (nheads // nheads_k). With 6 query heads and 2 key/value heads,
query heads 0, 1, 2 use key/value head 0 and 3, 4, 5 use head 1.

Gradients flow to q, k, v (and through views, to a packed qkv / kv) with autograd;
torch.compile traces the call as one custom op.
"""

_DENSE_RETURNS = """\
Returns:
    out: (batch, seqlen_q, nheads, headdim), the dtype of q.
    With return_attn_probs=True: (out, softmax_lse, None); softmax_lse: float32
        (batch, nheads, seqlen_q), the natural-log sum of exp(scores) per query row.
"""

_VARLEN_RETURNS = """\
Returns:
    out: (total_q, nheads, headdim), the dtype of q.
    With return_attn_probs=True: (out, softmax_lse, None); softmax_lse: float32
        (nheads, total_q), the natural-log sum of exp(scores) per query row.
"""

_VARLEN_ARGS = """\
    cu_seqlens_q: int32 tensor (batch + 1,): prefix sums of the query lengths, starting at 0;
        sequence b's queries are rows cu_seqlens_q[b] to cu_seqlens_q[b + 1] - 1.
    cu_seqlens_k: int32 tensor (batch + 1,): the same for the keys and values.
    max_seqlen_q, max_seqlen_k: int. The longest query / key sequence. Never read from the
        tensors on the host (no device sync): wrong values give wrong results, as in
        flash-attn; PORTATTN_DEBUG_CHECKS=1 checks them and raises a ValueError.
"""


def _doc(summary, args, returns, semantics=_SEMANTICS):
    return f"{summary}\n\nArguments:\n{args}{_SHARED_ARGS}\n{returns}\n{semantics}"


flash_attn_func.__doc__ = _doc(
    "Exact attention (flash-attn's flash_attn_func): softmax(Q K^T * softmax_scale) V.",
    """\
    q: (batch, seqlen_q, nheads, headdim), float16 or bfloat16 (float32 runs on the reference
        backend).
    k: (batch, seqlen_k, nheads_k, headdim).
    v: (batch, seqlen_k, nheads_k, headdim).
""", _DENSE_RETURNS)

flash_attn_qkvpacked_func.__doc__ = _doc(
    "Exact self-attention on one packed qkv tensor (flash-attn's flash_attn_qkvpacked_func).\n\n"
    "Same as flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], ...); the gradient\n"
    "is written back into the one qkv tensor.",
    """\
    qkv: (batch, seqlen, 3, nheads, headdim), float16 or bfloat16.
""", _DENSE_RETURNS)

flash_attn_kvpacked_func.__doc__ = _doc(
    "Exact attention with packed keys and values (flash-attn's flash_attn_kvpacked_func).\n\n"
    "Same as flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], ...).",
    """\
    q: (batch, seqlen_q, nheads, headdim), float16 or bfloat16.
    kv: (batch, seqlen_k, 2, nheads_k, headdim).
""", _DENSE_RETURNS)

flash_attn_varlen_func.__doc__ = _doc(
    "Exact attention over packed variable-length sequences (flash-attn's flash_attn_varlen_func).\n\n"
    "The batch's sequences are concatenated along the first dimension; a sequence only sees\n"
    "its own keys. Masks and ALiBi are aligned per sequence (seqlen_q and seqlen_k below are\n"
    "that sequence's lengths).",
    """\
    q: (total_q, nheads, headdim), float16 or bfloat16; total_q = sum of the query lengths.
    k: (total_k, nheads_k, headdim); or, with block_table, a paged cache
        (num_blocks, page_block_size, nheads_k, headdim).
    v: shaped as k.
""" + _VARLEN_ARGS + """\
    block_table: int32 tensor (batch, max_blocks_per_sequence), or None. With it, k and v are
        paged caches: key j of sequence b lives in page block_table[b, j // page_block_size],
        row j % page_block_size, and cu_seqlens_k gives each sequence's key count. Inference
        only (no gradients).
    k_descale, v_descale: float32 tensors (batch, nheads_k), or None (1.0), with k and v of
        torch.float8_e4m3fn (FlashAttention-3's FP8 keys and values): key j of sequence b is
        k[j] * k_descale[b, hk], the value likewise. Inference only. A paged cache is read in
        place by the decode kernels (head dims that are multiples of 16) up to 2048 query rows
        per sequence; other calls dequantise the keys into q's dtype first.
    q_descale: float32 tensor (batch, nheads_k), or None (1.0), with q of torch.float8_e4m3fn
        (and FP8 k and v): query row i of sequence b, head h is q[i, h] * q_descale[b, h //
        (nheads / nheads_k)]. The output is bfloat16.
""", _VARLEN_RETURNS)

flash_attn_varlen_qkvpacked_func.__doc__ = _doc(
    "Exact self-attention over packed variable-length sequences in one qkv tensor\n"
    "(flash-attn's flash_attn_varlen_qkvpacked_func).",
    """\
    qkv: (total, 3, nheads, headdim), float16 or bfloat16.
    cu_seqlens: int32 tensor (batch + 1,): prefix sums of the sequence lengths, starting at 0.
    max_seqlen: int. The longest sequence (never read from cu_seqlens on the host).
""", _VARLEN_RETURNS)

flash_attn_varlen_kvpacked_func.__doc__ = _doc(
    "Exact attention over packed variable-length sequences with packed keys and values\n"
    "(flash-attn's flash_attn_varlen_kvpacked_func).",
    """\
    q: (total_q, nheads, headdim), float16 or bfloat16.
    kv: (total_k, 2, nheads_k, headdim).
""" + _VARLEN_ARGS, _VARLEN_RETURNS)

flash_attn_with_kvcache.__doc__ = f"""\
Attention of new queries over a KV cache, appending the new keys and values to the cache in
place first (flash-attn 2's flash_attn_with_kvcache; inference, no gradients).

Arguments:
    q: (batch, seqlen_q, nheads, headdim), float16 or bfloat16. Usually seqlen_q = 1 (one
        decode step) or a few tokens (speculative decoding, a chunk of the prompt).
    k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim); or, with block_table,
        paged caches (num_blocks, page_block_size, nheads_k, headdim). Updated in place when k
        and v are given. q's dtype, or both torch.float8_e4m3fn (see k_descale).
    k, v: (batch, seqlen_new, nheads_k, headdim), or None. New keys and values: new key i of
        sequence b is written (after rotation, if any) at absolute cache row
        cache_seqlens[b] + i, and attended to together with the cached ones.
    rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2), or None. Rotary embedding of the first
        rotary_dim features of q and of the new k (the cache holds rotated keys already). New key
        i is rotated at position cache_seqlens[b] + i (the absolute cache row, left padding
        included); the queries at cache_seqlens[b], plus their own index i when causal=True or a
        window is set (each query is then a token of its own), as in flash-attn 2.
    cache_seqlens: int, or int32 tensor (batch,). How many rows of each sequence's cache are
        filled before this call (the new keys go right after them).
    cache_batch_idx: int32 tensor (batch,), or None. Sequence b reads and writes cache entry
        cache_batch_idx[b] (default: entry b). Not with block_table.
    cache_leftpad: int32 tensor (batch,), or None. Sequence b's keys start at cache row
        cache_leftpad[b]: the live keys are rows [cache_leftpad[b], cache_seqlens[b]) followed by
        the new ones.
    block_table: int32 tensor (batch, max_blocks_per_sequence), or None. Paged cache: cache row
        j of sequence b lives in page block_table[b, j // page_block_size], row
        j % page_block_size.
    softmax_scale, causal, window_size, softcap, alibi_slopes: as in flash_attn_func, with
        seqlen_k = the sequence's live keys (from cache_leftpad to cache_seqlens + seqlen_new),
        so causal aligns the new queries with the newest keys (bottom-right).
    rotary_interleaved: bool. True: rotate feature pairs (0, 1), (2, 3), ... (GPT-J); False:
        pairs (i, i + rotary_dim / 2) (GPT-NeoX).
    num_splits: int. How many thread blocks share one sequence's keys (split-KV). 0 (default)
        chooses from the shapes and the GPU; an explicit count is honoured up to 128.
    return_softmax_lse: bool. Also return softmax_lse.
    sm_margin: int >= 0, keyword only: SMs left free for other kernels, as in flash_attn_func.
    k_descale, v_descale: float32 tensors (batch, nheads_k), or None (1.0), with k_cache and
        v_cache of torch.float8_e4m3fn (FlashAttention-3's FP8 cache): the key attended to is
        k_cache[...] * k_descale[b, hk], the value likewise; new k and v (of q's dtype) are
        stored as e4m3(x / descale), rounded to nearest even and saturated to +-448. Index b
        is the query's batch entry (also with cache_batch_idx). One scale for every head or
        sequence: scale.expand(batch, nheads_k) (no copy).
    q_descale: float32 tensor (batch, nheads_k), or None (1.0), with q of torch.float8_e4m3fn
        (FlashAttention-3's FP8 query; the caches must be FP8 too): the query attended is
        q[b, :, h] * q_descale[b, h // (nheads / nheads_k)], the output bfloat16, and new k and
        v, if any, bfloat16.

Returns:
    out: (batch, seqlen_q, nheads, headdim); with return_softmax_lse=True, (out, softmax_lse),
        softmax_lse float32 (batch, nheads, seqlen_q).

On a GPU backend with decode kernels, the cache is read in place, new keys are appended and
rotated on the device, and no tensor value is read on the host: a decode step can be captured
in a CUDA graph and replayed with changing cache_seqlens. A sequence whose cache_seqlens,
cache_leftpad, cache_batch_idx or block_table values point outside the cache is contained on
the device: nothing appended, no key read, output rows 0 and LSE -inf; portattn.check_errors()
then raises a ValueError naming the argument and the batch entry (docs/decode.md;
PORTATTN_DEBUG_CHECKS=1 raises at the call instead). Elsewhere (CPU, float32, the reference
backend) the live cache is gathered into a varlen call, which reads the lengths on the host;
CPU tensors with out-of-range values raise a ValueError before anything is written.

{_SEMANTICS}"""


# Paged varlen on an H100 (bf16, 32 query / 8 KV heads, hd 128, 16-token pages), in place on the
# decode kernels against gathering the pages into the forward kernels: one 2048-token prefill
# 0.68 against 1.21 ms (1.78x); 8 x 4k-key sequences, one 512-token chunk and 7 decode rows, 0.81
# against 11.3 ms; 64 decode rows over 8k keys, 0.91 against 179 ms (the gather reads every length
# on the host); one 4096-token prefill over 8k keys, 6.38 against 3.88 ms (0.61x): 16-row tiles
# re-read each key block once per tile where the forward kernels' 128-row tiles share it.
PAGED_IN_PLACE_MAX_QUERIES = 2048


def _paged_varlen_in_place(q, k_cache, v_cache, block_table, cu_seqlens_q, cu_seqlens_k,
                           max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                           window_size, softcap, alibi_slopes, seqused_k=None, out=None, s_aux=None,
                           num_splits=0, k_descale=None, v_descale=None, sm_margin=0):
    """(out, lse) of a paged varlen inference call on a GPU, read in place by the decode
    kernels; None when this path cannot serve it (it is then gathered first).

    Mixed prefill and decode rows (a serving engine's chunked prefill) go here: the decode
    kernels give each 16 packed query rows their own CTA and read only the keys those rows
    see, so no host read, no gather of the pages, and a CUDA graph can capture the call. With
    seqused_k the key counts come from it (cu_seqlens_k is then not read). Only a call whose
    longest query sequence exceeds PAGED_IN_PLACE_MAX_QUERIES is gathered into the forward
    kernels instead, unless a CUDA graph is being captured."""
    from .decode import run_decode
    from .kvcache import check_block_table

    if not isinstance(q, torch.Tensor) or q.dim() != 3 or not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4:
        return None  # the gather path reports the shape error
    if dropout_p != 0.0 or q.device.type != "cuda" or (torch.is_grad_enabled() and q.requires_grad):
        return None
    if (isinstance(max_seqlen_q, int) and max_seqlen_q > PAGED_IN_PLACE_MAX_QUERIES
            and not torch.cuda.is_current_stream_capturing()):
        return None
    nheads, head_dim = q.shape[1], q.shape[2]
    nheads_k = k_cache.shape[2]
    fp8 = k_cache.dtype is _FP8
    if fp8:
        from .kvcache import FP8_KERNEL_HEAD_DIM_MULTIPLE

        if v_cache.dtype is not _FP8 or head_dim % FP8_KERNEL_HEAD_DIM_MULTIPLE:
            return None
    elif k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        return None
    if k_cache.shape != v_cache.shape or nheads_k == 0 or nheads % nheads_k or k_cache.shape[3] != head_dim:
        return None
    batch = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, max_seqlen_q, q.shape[0], q.device)
    check_block_table(block_table, batch, q.device)
    seqused_k = check_seqused_k(seqused_k, batch, q.device)
    if seqused_k is None and check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, max_seqlen_k, None, q.device) != batch:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must describe the same batch")
    scale, window_left, window_right = check_options(
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, batch, nheads,
        head_dim, q.device,
    )
    s_aux = check_s_aux(s_aux, nheads, q.device)
    bits = dispatch.feature_bits(window_left, window_right, softcap, alibi_slopes is not None, 0.0,
                                 nheads != nheads_k, True, paged_kv=True, decode=True, fp8_kv=fp8)
    decoder = dispatch.DISPATCHER.decode_backend_for(q.device, q.dtype, head_dim, bits)
    if decoder is None:
        return None
    written, target = _out_target(out, q)
    if seqused_k is not None:
        # Lengths as a cache layout's filled rows: every sequence starts at row 0 of its pages.
        lengths = {"cache_seqlens": seqused_k}
    else:
        lengths = {"cu_seqlens_k": cu_seqlens_k}
    result, lse = run_decode(decoder, _last_dim_contiguous(q), k_cache, v_cache, need_lse=True,
                             softmax_scale=scale, window_left=window_left, window_right=window_right,
                             softcap=float(softcap), alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q,
                             max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, block_table=block_table,
                             num_splits=num_splits, out=written, errors=_error_buffer(q.device),
                             k_descale=k_descale, v_descale=v_descale, sm_margin=sm_margin, **lengths)
    if s_aux is not None:
        add_sink(result, lse, s_aux, True)
    return _finish_out(result, target), lse


def _error_buffer(device):
    from .errors import error_buffer

    return error_buffer(device)


def _gather_paged_varlen(k_cache, v_cache, block_table, cu_seqlens_k, max_seqlen_k, seqused_k=None):
    from .kvcache import gather_paged

    if seqused_k is not None:
        # The gather reads the lengths on the host anyway: seqused_k becomes cu_seqlens_k.
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
            raise ValueError("block_table must be an int32 tensor (batch, max_blocks_per_sequence)")
        check_seqused_k(seqused_k, block_table.shape[0], k_cache.device)
        if k_cache.device.type == "cpu":
            from .validation import check_seqused_k_values

            check_seqused_k_values(seqused_k, None, block_table.shape[1] * k_cache.shape[1])
        used = seqused_k.to(torch.int64).clamp(min=0)
        cu_seqlens_k = torch.nn.functional.pad(used.cumsum(0), (1, 0)).to(torch.int32)
    return gather_paged(k_cache, v_cache, block_table, cu_seqlens_k, max_seqlen_k)


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
