"""Tensors -> the compiled modules' `fwd` / `bwd` calls, for both vendors.

Both vendor modules (cuda/_C, rocm/_C) export the same signatures over the one C ABI
(common/params.h; the argument list is common/binding_args.h), so the marshalling is
written once here. It runs on every call: plain attribute reads, no allocation.
"""
from __future__ import annotations

import collections

import torch

from ..validation import seq_first

DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}  # PortattnDtype in params.h

raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # ~10x cheaper than current_stream()


# The compiled `fwd`'s arguments, by name. The field order is PORTATTN_FWD_ARG_NAMES in
# common/binding_args.h (tests/test_abi.py parses the header and checks they are equal), so
# callers never depend on a position: `bwd` takes the same tuple after its own arguments, and
# callers read or replace fields by name.
FwdArgs = collections.namedtuple("FwdArgs", (
    "q", "k", "v", "out", "lse", "q_strides", "k_strides", "v_strides", "out_strides",
    "lse_batch_stride", "lse_head_stride", "dtype", "batch", "nheads", "nheads_k", "headdim",
    "seqlen_q", "seqlen_k", "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "softmax_scale", "softcap",
    "window_left", "window_right", "alibi_slopes", "alibi_batch_stride", "dropout_p", "philox_seed",
    "philox_offset", "stream", "total_q", "total_k", "philox_state", "sm_margin",
))
# Built positionally: keyword construction of the fields (34 then) cost 1.3 us of fwd_args' 2.7 us
# per call (CPU, bench/tools/host_overhead_cpu.py), and fwd_args runs twice per training step.
# FwdArgs._make checks the count; tests/test_abi.py checks every field against a by-name build.
_make_fwd_args = FwdArgs._make


def fwd_args(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
             softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p,
             rng_seed, rng_offset, rng_state=None, seqused_k=None, sm_margin=0) -> FwdArgs:
    """The `fwd` arguments (a FwdArgs, a tuple in PORTATTN_FWD_ARGS order). lse may be None (not wanted).
    rng_state: None, or a device int64 [seed, offset] the kernels read instead of
    rng_seed / rng_offset (dropout under CUDA-graph capture, portattn/rng.py).
    seqused_k: None, or the varlen call's int32 (batch,) keys used per sequence.
    sm_margin: SMs a persistent grid leaves free (PortattnFwdParams.sm_margin), an int >= 0."""
    if cu_seqlens_q is None:
        batch, seqlen_q, nheads, headdim = q.shape
        _, seqlen_k, nheads_k, _ = k.shape
        cu_q = cu_k = 0
        total_q, total_k = seqlen_q, seqlen_k  # rows per batch entry (params.h)
        lse_batch_stride, lse_head_stride = (0, 0) if lse is None else lse.stride()[:2]
    else:
        total_q, nheads, headdim = q.shape
        total_k, nheads_k, _ = k.shape
        batch = cu_seqlens_q.shape[0] - 1
        seqlen_q, seqlen_k = max_seqlen_q, max_seqlen_k
        cu_q, cu_k = cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr()
        lse_batch_stride, lse_head_stride = 0, (0 if lse is None else lse.stride(0))
    if alibi_slopes is None:
        alibi = alibi_batch_stride = 0
    else:
        alibi = alibi_slopes.data_ptr()
        alibi_batch_stride = alibi_slopes.stride(0) if alibi_slopes.dim() == 2 else 0
    # In FwdArgs field order (the names are the fields').
    return _make_fwd_args((
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), 0 if lse is None else lse.data_ptr(),
        q.stride(), k.stride(), v.stride(), out.stride(),
        lse_batch_stride, lse_head_stride, DTYPE_CODES[q.dtype],
        batch, nheads, nheads_k, headdim, seqlen_q, seqlen_k,
        cu_q, cu_k, 0 if seqused_k is None else seqused_k.data_ptr(), softmax_scale, softcap,
        window_left, window_right, alibi,
        alibi_batch_stride, dropout_p, rng_seed,
        rng_offset, raw_stream(q.device.index), total_q, total_k,
        0 if rng_state is None else rng_state.data_ptr(), sm_margin,
    ))


# The `bwd_workspace_bytes` shape arguments are six consecutive FwdArgs fields: one slice
# of the tuple instead of six attribute reads (checked here, at import, by name).
_WORKSPACE_FIELDS = ("batch", "nheads", "nheads_k", "headdim", "seqlen_q", "seqlen_k")
_WORKSPACE_SLICE = slice(FwdArgs._fields.index("batch"), FwdArgs._fields.index("batch") + len(_WORKSPACE_FIELDS))
assert FwdArgs._fields[_WORKSPACE_SLICE] == _WORKSPACE_FIELDS


def workspace_shape(args: FwdArgs) -> tuple:
    """The shape arguments of the modules' `bwd_workspace_bytes`, from a call's FwdArgs."""
    return args[_WORKSPACE_SLICE]


def _aligned(pointer: int, strides: tuple) -> bool:
    # The kernels read 16-byte chunks: pointer and every non-unit stride must allow it.
    # (A loop, not all(<generator>): this runs on every backward, and the generator cost 0.3 us.)
    if pointer % 16:
        return False
    for stride in strides[:-1]:
        if stride % 8:
            return False
    return True


def run_bwd(module, dout, q, k, v, out, lse, dq, dk, dv, *, cu_seqlens_q, cu_seqlens_k,
            max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap,
            alibi_slopes, dropout_p, rng_seed, rng_offset, deterministic, entry=None,
            ordered_dq=False, rng_state=None, launch=None, seqused_k=None, sm_margin=0) -> None:
    """One backward call of a compiled module (CUDA or ROCm: same `bwd` signature).

    `entry` is another of the module's functions with `bwd`'s arguments (the CUDA
    module's `hopper_bwd`); None means `module.bwd`. `ordered_dq`: the entry's
    workspace is the Hopper backward's layout (`bwd_workspace_bytes(..., ordered_dq=True)`).
    `launch(device_index, entry, args)` makes the call (compiled.launch: with the tensors'
    GPU current); None calls `entry(*args)` directly.

    The scratch the kernels need (fp32 dQ accumulator, rowsum(dO * O), for GQA fp32
    dK/dV accumulators) is one uint8 tensor from torch's caching allocator, sized by
    the module's own `bwd_workspace_bytes`, so the size cannot drift from what the
    launch carves (Note [portattn cuda backward] in cuda/csrc/bwd_entry.cu).
    """
    args = fwd_args(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p,
                    rng_seed, rng_offset, rng_state, seqused_k, sm_margin)
    if seqused_k is not None:
        # Key rows past seqused_k[b] take no part in the call and no kernel stores their
        # gradient: they are 0.
        dk.zero_()
        dv.zero_()
    dout_pointer, dout_strides = dout.data_ptr(), dout.stride()
    # dout comes from autograd (the user did not choose its layout): copy rather than fail.
    if not _aligned(dout_pointer, dout_strides):
        dout = dout.contiguous()
        dout_pointer, dout_strides = dout.data_ptr(), dout.stride()
    deterministic = bool(deterministic)
    shape = args[_WORKSPACE_SLICE]
    # ordered_dq goes by position: pybind11's keyword path cost 0.45 us more per call (the CUDA
    # module's bwd_workspace_bytes, measured on the CPU: 0.16 us positional, 0.60 us by keyword).
    # The ROCm module has no ordered layout (and no eighth argument).
    workspace_bytes = (module.bwd_workspace_bytes(*shape, deterministic, True) if ordered_dq
                       else module.bwd_workspace_bytes(*shape, deterministic))
    workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=q.device)
    call_args = (dout_pointer, dout_strides, dq.data_ptr(), dq.stride(), dk.data_ptr(), dk.stride(),
                 dv.data_ptr(), dv.stride(), workspace.data_ptr(), workspace_bytes, deterministic, *args)
    if launch is None:
        (entry or module.bwd)(*call_args)
    else:
        launch(q.device.index, entry or module.bwd, call_args)


def load_extension(package: str, what: str):
    """(module, "") or (None, why): the compiled `_C` of a backend package.

    Tells "not built" (no `_C` file in this install) apart from "built but does not
    load" (wrong Python, missing runtime library), since the fixes differ.
    """
    import importlib
    import importlib.util

    name = f"{package}._C"
    try:
        if importlib.util.find_spec(name) is None:
            return None, f"the {what} module is not built in this install (no {name})"
        return importlib.import_module(name), ""
    except ImportError as error:
        return None, f"the {what} module is built but does not load ({error})"


# ---- decode (Note [portattn decode] in common/params.h) ------------------------------------


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


def decode_args(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, cache_seqlens,
                seqlen_new, cache_leftpad, cache_batch_idx, block_table, softmax_scale, window_left,
                window_right, softcap, alibi_slopes, num_splits, o_partial=0, lse_partial=0, errors=None,
                k_descale=None, v_descale=None, heads_first=False) -> tuple:
    """The `decode` argument tuple (PORTATTN_DECODE_ARGS order in common/binding_args.h).

    q is (batch, seqlen_q, nheads, headdim) or, with cu_seqlens_q, (total_q, nheads, headdim).
    k and v are a contiguous cache (batch_cache, capacity, nheads_k, headdim), a paged one
    (num_pages, page_size, nheads_k, headdim) with block_table, or packed keys (total_k,
    nheads_k, headdim) with cu_seqlens_k. o_partial / lse_partial: addresses of the fp32 split
    workspace (portattn/decode.py allocates both in one tensor), 0 with one split. errors: the
    device's int32 error buffer (portattn/errors.py), or None (out-of-range metadata is then
    still contained, but not recorded). k and v may be float8_e4m3fn caches, with k_descale /
    v_descale None or fp32 (batch, nheads_k) (Note [portattn fp8 kv cache] in common/params.h).
    heads_first: q, k, v are 4-D (batch, heads, seq, dim) views (k, v a contiguous cache's, no
    cu_seqlens) of the tensors above: the same tuple, from the same pointers, with their sizes
    and strides read in (batch, seq, heads, dim) order (validation.seq_first)."""
    # Positional throughout and each tensor attribute read once: decode.run_decode calls this
    # once per attention layer of every generated token.
    q_strides, k_strides, v_strides, k_shape = q.stride(), k.stride(), v.stride(), k.shape
    if heads_first:
        q_strides, k_strides, v_strides, k_shape = (
            seq_first(q_strides), seq_first(k_strides), seq_first(v_strides), seq_first(k_shape))
    if cu_seqlens_q is None:
        if heads_first:
            batch, nheads, seqlen_q, headdim = q.shape
        else:
            batch, seqlen_q, nheads, headdim = q.shape
        lse_strides = (0, 0) if lse is None else lse.stride()[:2]
        total_q = 0
    else:
        total_q, nheads, headdim = q.shape
        batch = cu_seqlens_q.shape[0] - 1
        seqlen_q = max_seqlen_q
        lse_strides = (0, 0) if lse is None else (0, lse.stride(0))
    nheads_k = k_shape[-2]
    if block_table is not None:
        num_pages, page_size = k_shape[0], k_shape[1]
        kv_capacity = block_table.shape[1] * page_size
        block_table_stride = block_table.stride(0)
        seqlen_k = max_seqlen_k if cu_seqlens_k is not None else kv_capacity
        cache_batches = total_k = 0
        block_table = block_table.data_ptr()
    elif cu_seqlens_k is not None:
        total_k = k_shape[0]
        kv_capacity = seqlen_k = max_seqlen_k
        num_pages = page_size = cache_batches = block_table_stride = block_table = 0
    else:
        cache_batches = k_shape[0]
        kv_capacity = seqlen_k = k_shape[1]
        num_pages = page_size = block_table_stride = block_table = total_k = 0
    if alibi_slopes is None:
        alibi = alibi_batch_stride = 0
    else:
        alibi = alibi_slopes.data_ptr()
        alibi_batch_stride = alibi_slopes.stride(0) if alibi_slopes.dim() == 2 else 0
    dtype = k.dtype
    if dtype is torch.float8_e4m3fn:
        kv = kv_args(k, k_descale, v_descale)
    else:
        kv = _NO_KV_ARGS if k_descale is None and v_descale is None else kv_args(k, k_descale, v_descale)
    return (
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), 0 if lse is None else lse.data_ptr(),
        q_strides, k_strides, v_strides, out.stride(), lse_strides[0], lse_strides[1],
        DTYPE_CODES[q.dtype], batch, nheads, nheads_k, headdim, seqlen_q, seqlen_k,
        0 if cu_seqlens_q is None else cu_seqlens_q.data_ptr(),
        0 if cu_seqlens_k is None else cu_seqlens_k.data_ptr(),
        0 if cache_seqlens is None else cache_seqlens.data_ptr(), seqlen_new,
        0 if cache_leftpad is None else cache_leftpad.data_ptr(),
        0 if cache_batch_idx is None else cache_batch_idx.data_ptr(), block_table, block_table_stride,
        page_size, num_pages, cache_batches, kv_capacity, total_q, total_k,
        softmax_scale, softcap, window_left, window_right, alibi, alibi_batch_stride,
        num_splits, o_partial, lse_partial, raw_stream(q.get_device()), 0 if errors is None else errors.data_ptr(),
        *kv,
    )


CACHE_FP8_E4M3 = 1  # PortattnCacheDtype in common/params.h (0: the query's dtype)


_NO_KV_ARGS = (0, 0, 0, 0, 0, 0, 0)  # kv_args of a cache in the query's dtype without descales


def kv_args(cache, k_descale, v_descale) -> tuple:
    """The PORTATTN_KV_ARGS (common/binding_args.h) of a cache and its descales."""
    fp8 = cache.dtype == torch.float8_e4m3fn
    k_strides = (0, 0) if k_descale is None else k_descale.stride()
    v_strides = (0, 0) if v_descale is None else v_descale.stride()
    return (CACHE_FP8_E4M3 if fp8 else 0, _ptr(k_descale), _ptr(v_descale), *k_strides, *v_strides)


ROTARY_FP32 = 2  # PortattnAppendParams.rotary_dtype for float32 tables


def append_args(k_cache, v_cache, k_new, v_new, q, q_out, *, cache_seqlens, cache_batch_idx=None,
                block_table=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=True,
                q_position_per_token=False, errors=None, k_descale=None, v_descale=None) -> tuple:
    """The `kvcache_append` argument tuple (PORTATTN_APPEND_ARGS order in common/binding_args.h).
    An FP8 cache takes new rows of q's dtype, quantised with k_descale / v_descale."""
    batch, seqlen_q, nheads, headdim = q.shape
    nheads_k = k_cache.shape[-2]
    seqlen_new = 0 if k_new is None else k_new.shape[1]
    no_strides = (0, 0, 0, 0)
    if block_table is not None:
        num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
        kv_capacity = block_table.shape[1] * page_size
        block_table_stride, cache_batches = block_table.stride(0), 0
    else:
        num_pages = page_size = block_table_stride = 0
        cache_batches, kv_capacity = k_cache.shape[0], k_cache.shape[1]
    if rotary_cos is None:
        rotary_dim = seqlen_ro = rotary_row_stride = rotary_dtype = 0
    else:
        seqlen_ro, rotary_dim = rotary_cos.shape[0], rotary_cos.shape[1] * 2
        rotary_row_stride = rotary_cos.stride(0)
        rotary_dtype = ROTARY_FP32 if rotary_cos.dtype == torch.float32 else DTYPE_CODES[rotary_cos.dtype]
    return (
        _ptr(k_new), _ptr(v_new), no_strides if k_new is None else k_new.stride(),
        no_strides if v_new is None else v_new.stride(), k_cache.data_ptr(), v_cache.data_ptr(),
        k_cache.stride(), v_cache.stride(), _ptr(q) if q_out is not None else 0,
        _ptr(q_out), q.stride(), no_strides if q_out is None else q_out.stride(),
        DTYPE_CODES[q.dtype], batch, seqlen_new, seqlen_q, nheads, nheads_k, headdim,
        cache_seqlens.data_ptr(), _ptr(cache_batch_idx), _ptr(block_table), block_table_stride,
        page_size, num_pages, cache_batches, kv_capacity, _ptr(rotary_cos), _ptr(rotary_sin),
        rotary_row_stride, rotary_dtype, rotary_dim, seqlen_ro, bool(rotary_interleaved),
        bool(q_position_per_token), raw_stream(k_cache.device.index), _ptr(errors),
        *kv_args(k_cache, k_descale, v_descale),
    )
