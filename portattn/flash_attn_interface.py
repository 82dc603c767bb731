"""flash-attn's `flash_attn.flash_attn_interface` module, served by portattn.

The public functions are api.py's, the same objects (their docstrings, shown by help(), are
assembled there). The four private ones below are flash-attn 2.8's
low-level interface, which libraries built on flash-attn call directly (ring attention
merges the partial results of several calls by their LSE, then runs each backward with
the *global* out and softmax_lse). Their signatures, keyword names, defaults and return
tuples are flash-attn's, because callers pass everything by keyword
(ring-flash-attn builds its keyword dict from `inspect.getfullargspec` of these
functions, so they must stay plain Python functions).

Deliberate differences, as in README:
- `S_dmask` is always an empty tensor: no backend materialises the attention matrix.
- `rng_state` is an int64 (seed, offset) pair on the host, so the backward reads it
  without a device sync; it selects the same philox mask on every backend.
- The backward returns `softmax_d` = rowsum(dout * out) as (batch, nheads, seqlen_q)
  / (nheads, total_q) float32, without flash-attn's padding to 128 rows.
- `zero_tensors` and `num_splits` are accepted and ignored (every element is written;
  splits are a tuning hint).
- `sm_margin` (FlashAttention-3's, not in flash-attn 2; last parameter, default 0): SMs the
  kernels leave free for other kernels, e.g. ring attention's communication
  (compat.install_ring_sm_margin passes it for ring-flash-attn). The backward functions take
  it too, for FlashAttention-3's signatures: no backward grid is sized by the SM count. `seqused_k` is honoured in the forward (sequence b uses its first
  seqused_k[b] keys); `leftpad_k` is refused with a ValueError.

Nothing here records autograd history (flash-attn's low-level ops have no autograd
formula either): callers write their own autograd.Function around them.
"""
from __future__ import annotations

from typing import Optional

import torch

from .api import (  # noqa: F401  (re-exported: flash-attn's public names in this module)
    _gather_paged_varlen,
    _last_dim_contiguous,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from .ops import run_backward, run_forward
from .rng import NO_DROPOUT, draw_from_state, rng_state_tensor
from .validation import (
    check_options,
    check_qkv,
    check_rng_state,
    check_same_layout,
    check_seqused_k,
    check_sm_margin,
    check_softmax_lse,
    check_varlen,
)


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                        window_size_right, softcap, alibi_slopes, return_softmax, sm_margin=0):
    """Dense forward. Returns (out, softmax_lse, S_dmask, rng_state); softmax_lse is
    float32 (batch, nheads, seqlen_q)."""
    return _forward(q, k, v, None, None, None, None, dropout_p, softmax_scale, causal,
                    window_size_left, window_size_right, softcap, alibi_slopes, None, sm_margin)


def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p, softmax_scale, causal, window_size_left=-1,
                               window_size_right=-1, softcap=0.0, alibi_slopes=None,
                               return_softmax=False, block_table=None, leftpad_k=None,
                               seqused_k=None, zero_tensors=False, num_splits=0, sm_margin=0):
    """Varlen forward. Returns (out, softmax_lse, S_dmask, rng_state); softmax_lse is
    float32 (nheads, total_q). With block_table, k and v are paged caches."""
    if leftpad_k is not None:
        raise ValueError("leftpad_k is not supported by portattn's low-level varlen forward; pass None "
                         "(flash_attn_with_kvcache's cache_leftpad serves left-padded caches)")
    if block_table is not None:
        k, v, cu_seqlens_k = _gather_paged_varlen(k, v, block_table, cu_seqlens_k, None, seqused_k)
        seqused_k = None
    return _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                    softmax_scale, causal, window_size_left, window_size_right, softcap,
                    alibi_slopes, seqused_k, sm_margin)


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                         causal, window_size_left, window_size_right, softcap, alibi_slopes,
                         deterministic, rng_state=None, sm_margin=0):
    """Dense backward from the given out and softmax_lse, written into dq, dk, dv (any
    layout; None allocates). Returns softmax_d."""
    return _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, None, None, None, None,
                     dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                     softcap, alibi_slopes, deterministic, rng_state, sm_margin)


def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                                cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                softmax_scale, causal, window_size_left, window_size_right,
                                softcap, alibi_slopes, deterministic, rng_state=None,
                                zero_tensors=False, sm_margin=0):
    """Varlen backward (softmax_lse: (nheads, total_q)). Returns softmax_d."""
    return _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                     max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                     window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                     rng_state, sm_margin)


# ---- shared bodies ------------------------------------------------------------------


def _shape_and_options(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       dropout_p, softmax_scale, causal, window_left, window_right, softcap,
                       alibi_slopes):
    """The public API's checks; returns (max_seqlen_q, max_seqlen_k, scale, left, right)."""
    varlen = cu_seqlens_q is not None
    batch, seqlen_q, seqlen_k, nheads, _, head_dim = check_qkv(q, k, v, varlen=varlen)
    if varlen:
        batch, seqlen_q, seqlen_k = check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                 max_seqlen_k, seqlen_q, seqlen_k, q.device)
    scale, left, right = check_options(dropout_p, softmax_scale, causal, (window_left, window_right),
                                       softcap, alibi_slopes, batch, nheads, head_dim, q.device)
    return seqlen_q, seqlen_k, scale, left, right


def _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
             softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, seqused_k=None,
             sm_margin=0):
    max_q, max_k, scale, left, right = _shape_and_options(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
        causal, window_left, window_right, softcap, alibi_slopes)
    if type(sm_margin) is not int or sm_margin < 0:
        sm_margin = check_sm_margin(sm_margin)
    if seqused_k is not None:
        check_seqused_k(seqused_k, cu_seqlens_q.shape[0] - 1, q.device)
    with torch.no_grad():
        out, lse, rng = run_forward(
            _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v), alibi_slopes,
            cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale, left, right, float(softcap),
            float(dropout_p), True, seqused_k, None, None, sm_margin)
    no_probabilities = torch.empty(0, dtype=q.dtype, device=q.device)
    return out, lse, no_probabilities, rng_state_tensor(rng)


def _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
              max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_left,
              window_right, softcap, alibi_slopes, deterministic, rng_state, sm_margin):
    varlen = cu_seqlens_q is not None
    max_q, max_k, scale, left, right = _shape_and_options(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
        causal, window_left, window_right, softcap, alibi_slopes)
    if type(sm_margin) is not int or sm_margin < 0:
        sm_margin = check_sm_margin(sm_margin)
    check_same_layout("dout", dout, "q", q)
    check_same_layout("out", out, "q", q)
    check_softmax_lse(softmax_lse, q, varlen)
    rng_state = check_rng_state(rng_state, float(dropout_p))
    rng = draw_from_state(rng_state) if rng_state is not None else NO_DROPOUT
    targets = [_grad_target(name, given, like_name, like)
               for name, given, like_name, like in (("dq", dq, "q", q), ("dk", dk, "k", k), ("dv", dv, "v", v))]
    with torch.no_grad():
        run_backward(
            _last_dim_contiguous(dout), _last_dim_contiguous(q), _last_dim_contiguous(k),
            _last_dim_contiguous(v), _last_dim_contiguous(out), _lse_for_backends(softmax_lse, q),
            alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale, left, right,
            float(softcap), float(dropout_p), rng, bool(deterministic),
            grads=tuple(written for written, _ in targets), sm_margin=sm_margin)
        for written, given in targets:
            if given is not None:
                given.copy_(written)
        return _softmax_d(dout, out, varlen)


def _grad_target(name: str, given: Optional[torch.Tensor], like_name: str, like: torch.Tensor):
    """(tensor the backend writes, tensor to copy it into afterwards, or None).

    Backends write any layout whose last dim is contiguous and whose rows are 16-byte
    aligned (the compiled kernels store 16-byte vectors). Anything else, say a strided
    slice of a caller's accumulation buffer, gets a temporary and one copy_."""
    if given is None:
        return torch.empty_like(like), None
    check_same_layout(name, given, like_name, like)
    strides = given.stride()
    if strides[-1] == 1 and given.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in strides[:-1]):
        return given, None
    return torch.empty_like(like), given


def _lse_for_backends(softmax_lse: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    # The backend contract: contiguous, float32 (float64 with float64 inputs). Ring
    # attention passes a transposed view of its merged LSE.
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return softmax_lse.to(dtype).contiguous()


def _softmax_d(dout: torch.Tensor, out: torch.Tensor, varlen: bool) -> torch.Tensor:
    """rowsum(dout * out) in float32, flash-attn's `softmax_d`, laid out like the LSE.
    One fused read of dout and out; the backends compute the same sum internally but do
    not return it."""
    d = torch.einsum("...hd,...hd->...h", dout.float(), out.float())
    return d.transpose(0, 1).contiguous() if varlen else d.transpose(1, 2).contiguous()
