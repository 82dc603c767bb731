"""Forward/backward execution: autograd for eager calls, custom ops for torch.compile.

Three ways into the same two functions, `run_forward` and `run_backward`:
- eager, no gradient needed: `run_forward` directly (no autograd node, no op dispatch);
- eager with gradients: `AttentionFunction.apply` (one autograd node);
- under torch.compile: `torch.ops.portattn.fwd` / `bwd`, custom ops with fake
  implementations and a registered autograd formula, so graphs don't break.
Eager calls never pay for the custom-op machinery (measured on the H100 host:
a Python custom op costs ~23 us per call, SDPA's whole call ~30 us).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from . import dispatch
from .decode import empty_seq_first, prefers_decode, run_decode
from .rng import NO_DROPOUT, PhiloxDraw, draw_from_state, draw_philox, rng_state_tensor
from .sinks import add_sink, sink_grad
from .validation import HOST_CHECKED_DEVICE_TYPE, check_cu_seqlens_values, check_seqused_k_values, seq_first

# By default no call reads a tensor's values on the host (a device sync, and a CUDA graph
# capture breaker): cu_seqlens are trusted, as in flash-attn, and the kernels keep their
# memory accesses inside the given tensors whatever the values. PORTATTN_DEBUG_CHECKS=1
# adds the host-side check, with a ValueError naming the argument. Read once (hot path).
# CPU tensors are always checked: there the read costs no device synchronisation.
_DEBUG_CHECKS = os.environ.get("PORTATTN_DEBUG_CHECKS", "0") == "1"


def _empty_lse(q: torch.Tensor, varlen: bool, heads_first: bool = False) -> torch.Tensor:
    shape = q.shape
    # (H, total_q) for varlen, as flash-attn's varlen API; else (B, H, Sq) (a heads-first q's own sizes).
    lse_shape = (shape[1], shape[0]) if varlen else tuple(shape) if heads_first else (shape[0], shape[2], shape[1])
    # float64 inputs (reference backend only) keep a float64 LSE, so gradients through
    # the public API are exact enough for torch.autograd.gradcheck.
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.empty(lse_shape, dtype=lse_dtype, device=q.device)


def _no_keys(k: torch.Tensor, varlen: bool) -> bool:
    return k.shape[0] == 0 if varlen else k.shape[1] == 0


def _check_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=None) -> None:
    check_cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, max_seqlen_q, q.shape[0])
    check_cu_seqlens_values("cu_seqlens_k", cu_seqlens_k, max_seqlen_k, k.shape[0])
    if seqused_k is not None:
        check_seqused_k_values(seqused_k, cu_seqlens_k)


def run_forward(
    q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    softmax_scale, window_left, window_right, softcap, dropout_p, need_lse=True,
    seqused_k=None, s_aux=None, out=None, sm_margin=0, heads_first=False,
):
    """Returns (out, lse, rng): rng is the dropout mask's key (rng.PhiloxDraw); lse is
    None when not `need_lse`. sm_margin: SMs the persistent grids leave free (validated).

    heads_first: q, k, v are 4-D (batch, heads, seq, dim) views (not varlen) of the tensors
    described; `out` is (batch, seq, heads, dim) all the same. The decode kernels take them as
    they are (decode.run_decode); every other route gets the (batch, seq, heads, dim) views.

    This is every call's hot path: each tensor attribute is read once, and an
    inference call that does not ask for the LSE does not allocate it (the
    kernels skip its store when given no pointer). `seqused_k` (varlen only), `s_aux`
    (sinks.py) and `out` (written in place; kernel-ready strides, api._out_target) are
    None on the common path.
    """
    if s_aux is not None:
        out, lse, rng = run_forward(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    softmax_scale, window_left, window_right, softcap, dropout_p, True,
                                    seqused_k, None, out, sm_margin, heads_first)
        add_sink(out, lse, s_aux, cu_seqlens_q is not None)
        return out, lse, rng
    varlen = cu_seqlens_q is not None
    if out is None:
        out = empty_seq_first(q) if heads_first else torch.empty_like(q)
    lse = _empty_lse(q, varlen, heads_first) if need_lse else None
    if out.numel() == 0:
        return out, lse, NO_DROPOUT
    if varlen and (_DEBUG_CHECKS or q.device.type == HOST_CHECKED_DEVICE_TYPE):  # free on the CPU: always there
        _check_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k)
    shape, k_shape = q.shape, k.shape
    if heads_first:
        shape, k_shape = seq_first(shape), seq_first(k_shape)
    if (k_shape[0] if varlen else k_shape[1]) == 0:
        # Nothing to attend to: the documented result for an empty row.
        out.zero_()
        if lse is not None:
            lse.fill_(float("-inf"))
        return out, lse, NO_DROPOUT
    nheads, head_dim, nheads_k = shape[-2], shape[-1], k_shape[-2]
    bits = dispatch.feature_bits(
        window_left, window_right, softcap, alibi_slopes is not None, dropout_p, nheads != nheads_k, varlen,
    )
    device = q.device
    if seqused_k is not None:
        # The decode kernels take packed keys' lengths from cu_seqlens_k only; the forward
        # kernels clamp each sequence's keys to seqused_k (common/seq_bounds.h).
        bits |= dispatch.SEQUSED_K_BIT
        backend = dispatch.DISPATCHER.backend_for(device, q.dtype, head_dim, bits)
        if heads_first:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        rng = draw_philox(device) if dropout_p > 0.0 else NO_DROPOUT
        backend.forward(
            q, k, v, out, lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale,
            window_left=window_left, window_right=window_right, softcap=softcap, alibi_slopes=alibi_slopes,
            dropout_p=dropout_p, rng_seed=rng.seed, rng_offset=rng.offset, rng_state=rng.state,
            seqused_k=seqused_k, sm_margin=sm_margin,
        )
        return out, lse, rng
    # No device-type test before the decode lookup: dispatch answers None for a device without
    # decode kernels (cached per key), and the test cost more than that lookup's share.
    if dropout_p == 0.0 and prefers_decode(max_seqlen_q if varlen else shape[1], nheads // nheads_k,
                                           max_seqlen_k if varlen else k_shape[1]):
        decoder = dispatch.DISPATCHER.decode_backend_for(device, q.dtype, head_dim, bits | dispatch.DECODE_BIT)
        if decoder is not None:
            run_decode(decoder, q, k, v, lse is not None, softmax_scale, window_left, window_right, softcap,
                       alibi_slopes, 0, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, None, 0,
                       None, None, None, out, lse, None, None, None, sm_margin, heads_first)
            return out, lse, NO_DROPOUT
    backend = dispatch.DISPATCHER.backend_for(device, q.dtype, head_dim, bits)
    if heads_first:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    rng = draw_philox(device) if dropout_p > 0.0 else NO_DROPOUT
    backend.forward(
        q, k, v, out, lse,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        softmax_scale=softmax_scale, window_left=window_left, window_right=window_right,
        softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
        rng_seed=rng.seed, rng_offset=rng.offset, rng_state=rng.state,  # None: Backend's default
        sm_margin=sm_margin,
    )
    return out, lse, rng


def run_backward(
    dout, q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    softmax_scale, window_left, window_right, softcap, dropout_p, rng, deterministic,
    grads=None, seqused_k=None, sm_margin=0,
):
    """Returns (dq, dk, dv): the given `grads` triple filled in, else new tensors. `rng`
    is the forward's dropout key (rng.PhiloxDraw).

    `grads` (flash_attn_interface's low-level backward) must have the shapes and dtype of
    q, k, v and satisfy the backend contract (last dim contiguous; the caller copes with
    other layouts)."""
    varlen = cu_seqlens_q is not None
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    if varlen and (_DEBUG_CHECKS or q.device.type == HOST_CHECKED_DEVICE_TYPE):
        _check_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k)
    if grads is None:
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    else:
        dq, dk, dv = grads
    if q.numel() == 0 or _no_keys(k, varlen):
        return dq.zero_(), dk.zero_(), dv.zero_()
    bits = dispatch.feature_bits(
        window_left, window_right, softcap, alibi_slopes is not None, dropout_p,
        q.shape[-2] != k.shape[-2], varlen, backward=True, deterministic=deterministic,
        seqused_k=seqused_k is not None,
    )
    backend = dispatch.DISPATCHER.backend_for(q.device, q.dtype, q.shape[-1], bits)
    extra = {} if seqused_k is None else {"seqused_k": seqused_k}
    backend.backward(
        dout, q, k, v, out, lse, dq, dk, dv,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        softmax_scale=softmax_scale, window_left=window_left, window_right=window_right,
        softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
        rng_seed=rng.seed, rng_offset=rng.offset, deterministic=deterministic,
        rng_state=rng.state,  # None: Backend's default
        sm_margin=sm_margin, **extra,
    )
    return dq, dk, dv


class AttentionFunction(torch.autograd.Function):
    """The eager autograd node (one per call).

    Its inputs are the tensors and one tuple of the scalar options (see `attention`):
    Function.apply's own Python and C++ work (wrapper unwrapping, input bookkeeping, the
    gradient tuple's checks) grows with the argument count, and 14 separate arguments cost
    ~1 us more per step than 7 (CPU, bench/tools/host_overhead_cpu.py). None of the scalars ever
    took a gradient, so autograd sees the same differentiable inputs.
    """

    @staticmethod
    def forward(ctx, q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, options):
        (max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap, dropout_p,
         _deterministic, sm_margin) = options
        out, lse, rng = run_forward(
            q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            softmax_scale, window_left, window_right, softcap, dropout_p, True, None, None, None, sm_margin,
        )
        ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, rng.state)
        ctx.options = options
        ctx.philox = (rng.seed, rng.offset)
        ctx.mark_non_differentiable(lse)
        # lse never receives a gradient: do not let autograd allocate a zero one per call.
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:  # out did not reach the loss
            return None, None, None, None, None, None, None
        q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, rng_state = ctx.saved_tensors
        (max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap, dropout_p,
         deterministic, sm_margin) = ctx.options
        seed, offset = ctx.philox
        dq, dk, dv = run_backward(
            dout, q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
            max_seqlen_k, softmax_scale, window_left, window_right, softcap, dropout_p,
            PhiloxDraw(seed, offset, rng_state), deterministic, None, None, sm_margin,
        )
        return dq, dk, dv, None, None, None, None


class ExtendedAttentionFunction(torch.autograd.Function):
    """AttentionFunction for calls with `seqused_k` or attention sinks (`s_aux`, sinks.py),
    kept apart so the common call's node carries no extra inputs."""

    @staticmethod
    def forward(ctx, q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k, s_aux, options):
        (max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap, dropout_p,
         _deterministic, sm_margin) = options
        out, lse, rng = run_forward(
            q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            softmax_scale, window_left, window_right, softcap, dropout_p, True, seqused_k, s_aux, None, sm_margin,
        )
        ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k, s_aux,
                              rng.state)
        ctx.options = options
        ctx.philox = (rng.seed, rng.offset)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:
            return (None,) * 9
        (q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k, s_aux,
         rng_state) = ctx.saved_tensors
        (max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap, dropout_p,
         deterministic, sm_margin) = ctx.options
        seed, offset = ctx.philox
        # out and lse include the sinks: the kernels' backward is then the sinks' (sinks.py).
        dq, dk, dv = run_backward(
            dout, q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
            max_seqlen_k, softmax_scale, window_left, window_right, softcap, dropout_p,
            PhiloxDraw(seed, offset, rng_state), deterministic, seqused_k=seqused_k, sm_margin=sm_margin,
        )
        ds_aux = None
        if s_aux is not None and ctx.needs_input_grad[7]:
            ds_aux = sink_grad(dout, out, lse, s_aux, cu_seqlens_q is not None)
        return dq, dk, dv, None, None, None, None, ds_aux, None


# ---- torch.compile path ------------------------------------------------------------


@torch.library.custom_op("portattn::fwd", mutates_args=())
def _fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alibi_slopes: Optional[torch.Tensor],
    cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
    max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, window_left: int,
    window_right: int, softcap: float, dropout_p: float, deterministic: bool,
    seqused_k: Optional[torch.Tensor], s_aux: Optional[torch.Tensor], sm_margin: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out, lse, rng = run_forward(
        q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        softmax_scale, window_left, window_right, softcap, dropout_p, True, seqused_k, s_aux, None, sm_margin,
    )
    # The philox seed/offset travel as a tensor so the compiled graph can save them.
    return out, lse, rng_state_tensor(rng)


@_fwd_op.register_fake
def _fwd_fake(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              softmax_scale, window_left, window_right, softcap, dropout_p, deterministic, seqused_k, s_aux,
              sm_margin):
    return torch.empty_like(q), _empty_lse(q, cu_seqlens_q is not None), torch.empty(2, dtype=torch.int64)


@torch.library.custom_op("portattn::bwd", mutates_args=())
def _bwd_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, alibi_slopes: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int,
    softmax_scale: float, window_left: int, window_right: int, softcap: float, dropout_p: float,
    rng_state: torch.Tensor, deterministic: bool, seqused_k: Optional[torch.Tensor], sm_margin: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return run_backward(
        dout, q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, softmax_scale, window_left, window_right, softcap, dropout_p,
        draw_from_state(rng_state), deterministic, seqused_k=seqused_k, sm_margin=sm_margin,
    )


@_bwd_op.register_fake
def _bwd_fake(dout, q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
              max_seqlen_k, softmax_scale, window_left, window_right, softcap, dropout_p,
              rng_state, deterministic, seqused_k, sm_margin):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fwd_setup_context(ctx, inputs, output):
    (q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
     softmax_scale, window_left, window_right, softcap, dropout_p, deterministic, seqused_k, s_aux,
     sm_margin) = inputs
    out, lse, rng_state = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, rng_state, seqused_k,
                          s_aux)
    ctx.options = (max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right,
                   softcap, dropout_p, deterministic, sm_margin)
    ctx.mark_non_differentiable(lse, rng_state)


def _fwd_backward(ctx, dout, _dlse, _drng):
    q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, rng_state, seqused_k, s_aux = ctx.saved_tensors
    (max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right,
     softcap, dropout_p, deterministic, sm_margin) = ctx.options
    dq, dk, dv = torch.ops.portattn.bwd(
        dout, q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, softmax_scale, window_left, window_right, softcap, dropout_p, rng_state,
        deterministic, seqused_k, sm_margin,
    )
    ds_aux = None if s_aux is None else sink_grad(dout, out, lse, s_aux, cu_seqlens_q is not None)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None, None, ds_aux, None


torch.library.register_autograd("portattn::fwd", _fwd_backward, setup_context=_fwd_setup_context)


def attention(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              softmax_scale, window_left, window_right, softcap, dropout_p, deterministic,
              need_lse=True, seqused_k=None, s_aux=None, out=None, sm_margin=0, heads_first=False):
    """Route one validated call to the cheapest correct path. Returns (out, lse).

    lse may be None for an eager call without gradients when `need_lse` is False. `out`
    (inference only, checked by the caller) receives the result in place. sm_margin
    (validated) reaches the forward and the backward launches. heads_first: q, k, v are
    (batch, heads, seq, dim) views (run_forward); the custom ops and the autograd node get the
    (batch, seq, heads, dim) views."""
    if torch.compiler.is_compiling():
        if heads_first:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        result, lse, _ = torch.ops.portattn.fwd(
            q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
            window_left, window_right, softcap, dropout_p, deterministic, seqused_k, s_aux, sm_margin)
        if out is not None:
            out.copy_(result)
            return out, lse
        return result, lse
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or
                                    (s_aux is not None and s_aux.requires_grad)):
        if heads_first:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        options = (max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap, dropout_p,
                   deterministic, sm_margin)
        if seqused_k is None and s_aux is None:
            return AttentionFunction.apply(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, options)
        return ExtendedAttentionFunction.apply(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k,
                                               s_aux, options)
    result, lse, _ = run_forward(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 softmax_scale, window_left, window_right, softcap, dropout_p, need_lse,
                                 seqused_k, s_aux, out, sm_margin, heads_first)
    return result, lse


# ---- flash_attn_with_kvcache under torch.compile -------------------------------------------


def _attend(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved,
            alibi_slopes, num_splits, k_descale, v_descale, sm_margin):
    """The eager body of both kvcache ops (two ops only because their schemas differ: one
    mutates the caches)."""
    from .api import flash_attn_varlen_func
    from .kvcache import attend_to_cache

    return attend_to_cache(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
        cache_leftpad, block_table, softmax_scale, causal, (window_left, window_right), softcap,
        rotary_interleaved, alibi_slopes, True, num_splits, flash_attn_varlen_func, k_descale, v_descale,
        None, sm_margin)


def _fake_outputs(q):
    batch, seqlen_q, nheads, _ = q.shape
    return torch.empty_like(q), q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)


@torch.library.custom_op("portattn::kvcache", mutates_args=())
def _kvcache_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rotary_cos: Optional[torch.Tensor],
    rotary_sin: Optional[torch.Tensor], cache_seqlens: Optional[torch.Tensor],
    cache_batch_idx: Optional[torch.Tensor], cache_leftpad: Optional[torch.Tensor],
    block_table: Optional[torch.Tensor], softmax_scale: Optional[float], causal: bool, window_left: int,
    window_right: int, softcap: float, rotary_interleaved: bool, alibi_slopes: Optional[torch.Tensor],
    num_splits: int, k_descale: Optional[torch.Tensor], v_descale: Optional[torch.Tensor], sm_margin: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _attend(q, k_cache, v_cache, None, None, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                   cache_leftpad, block_table, softmax_scale, causal, window_left, window_right, softcap,
                   rotary_interleaved, alibi_slopes, num_splits, k_descale, v_descale, sm_margin)


@_kvcache_op.register_fake
def _kvcache_fake(q, k_cache, v_cache, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                  block_table, softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved,
                  alibi_slopes, num_splits, k_descale, v_descale, sm_margin):
    return _fake_outputs(q)


@torch.library.custom_op("portattn::kvcache_append", mutates_args=("k_cache", "v_cache"))
def _kvcache_append_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    rotary_cos: Optional[torch.Tensor], rotary_sin: Optional[torch.Tensor], cache_seqlens: torch.Tensor,
    cache_batch_idx: Optional[torch.Tensor], cache_leftpad: Optional[torch.Tensor],
    block_table: Optional[torch.Tensor], softmax_scale: Optional[float], causal: bool, window_left: int,
    window_right: int, softcap: float, rotary_interleaved: bool, alibi_slopes: Optional[torch.Tensor],
    num_splits: int, k_descale: Optional[torch.Tensor], v_descale: Optional[torch.Tensor], sm_margin: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _attend(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                   cache_leftpad, block_table, softmax_scale, causal, window_left, window_right, softcap,
                   rotary_interleaved, alibi_slopes, num_splits, k_descale, v_descale, sm_margin)


@_kvcache_append_op.register_fake
def _kvcache_append_fake(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                         cache_leftpad, block_table, softmax_scale, causal, window_left, window_right, softcap,
                         rotary_interleaved, alibi_slopes, num_splits, k_descale, v_descale, sm_margin):
    return _fake_outputs(q)


def compiled_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                     cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                     rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse, k_descale=None,
                     v_descale=None, sm_margin=0):
    """flash_attn_with_kvcache traced by torch.compile: one custom op, so the graph holds it
    whole (the CPU gather path reads lengths on the host, which dynamo could not trace).
    An append mutates the caches: a second op declares that, so the common read-only call
    (transformers' caches are written before attention) does not make the compiler copy them."""
    if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = torch.full((q.shape[0],), int(cache_seqlens), dtype=torch.int32, device=q.device)
    left, right = window_size
    if causal:
        right = 0
    if k is None and v is None:
        out, lse = torch.ops.portattn.kvcache(
            q, k_cache, v_cache, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, softmax_scale, causal, int(left), int(right), float(softcap), bool(rotary_interleaved),
            alibi_slopes, int(num_splits), k_descale, v_descale, sm_margin)
    else:
        if cache_seqlens is None:
            raise ValueError("cache_seqlens is required when appending k/v (where to write them)")
        out, lse = torch.ops.portattn.kvcache_append(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, softmax_scale, causal, int(left), int(right), float(softcap), bool(rotary_interleaved),
            alibi_slopes, int(num_splits), k_descale, v_descale, sm_margin)
    return (out, lse) if return_softmax_lse else out


@torch.library.custom_op("portattn::paged_varlen", mutates_args=())
def _paged_varlen_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor],
    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: Optional[float], causal: bool,
    window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
    s_aux: Optional[torch.Tensor], num_splits: int, q_descale: Optional[torch.Tensor],
    k_descale: Optional[torch.Tensor], v_descale: Optional[torch.Tensor], sm_margin: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    from .api import flash_attn_varlen_func

    out, lse, _ = flash_attn_varlen_func(
        q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=dropout_p,
        softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right), softcap=softcap,
        alibi_slopes=alibi_slopes, return_attn_probs=True, block_table=block_table, seqused_k=seqused_k,
        s_aux=s_aux, num_splits=num_splits, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
        sm_margin=sm_margin)
    return out, lse


@_paged_varlen_op.register_fake
def _paged_varlen_fake(q, k_cache, v_cache, block_table, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                       max_seqlen_k, dropout_p, softmax_scale, causal, window_left, window_right, softcap,
                       alibi_slopes, s_aux, num_splits, q_descale, k_descale, v_descale, sm_margin):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def compiled_paged_varlen(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                          softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
                          block_table, seqused_k, out, s_aux, num_splits, q_descale, k_descale, v_descale,
                          sm_margin=0):
    """flash_attn_varlen_func with block_table traced by torch.compile: one custom op whose body is
    the eager call (on a GPU the decode kernels read the pages in place; elsewhere the pages are
    gathered after the CPU's value checks, which dynamo could not trace). Inference only, as
    eagerly: the output carries no gradient. `out=` is filled by a copy after the op."""
    left, right = window_size
    with torch.no_grad():
        result, lse = torch.ops.portattn.paged_varlen(
            q, k_cache, v_cache, block_table, cu_seqlens_q, cu_seqlens_k, seqused_k, int(max_seqlen_q),
            int(max_seqlen_k), float(dropout_p), softmax_scale, bool(causal), int(left), int(right), float(softcap),
            alibi_slopes, s_aux, int(num_splits), q_descale, k_descale, v_descale, sm_margin)
        if out is not None:
            result = out.copy_(result)
    return (result, lse, None) if return_attn_probs else result
