"""Hugging Face transformers integration: `attn_implementation="portattn"`.

    import portattn.integrations.transformers as pt_hf
    pt_hf.register()                      # once per process
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="portattn")

`register(name)` adds two functions to transformers' registries under `name`:

- `attention_forward` to `AttentionInterface`: the model's attention layers call it with
  (batch, heads, seq, head_dim) tensors; it returns (batch, seq, heads, head_dim) and None
  (no attention weights), the contract of every transformers attention function.
- `padding_mask` to `AttentionMaskInterface`: what the model builds instead of a 4-D
  additive mask. Causality, sliding windows and softcap are arguments of the kernel call,
  so the only mask needed says which keys are real: None (all of them), key bounds (each
  sequence's live range in a cache, computed on the device), a written extent (the first
  n slots of a static cache, all real) or a 2-D (batch, kv_len) boolean of real tokens.

How a call is served (after the key bounds, the same cases, in the same order, as
transformers' own flash path, `modeling_flash_attention_utils._flash_attention_forward`):

0. key bounds (static caches always; decode steps of a left-padded batch): the keys are
   read in place by `flash_attn_with_kvcache` (the decode kernels), no host read, so a
   static-cache decode step compiles with fullgraph=True and replays as a CUDA graph;
1. a 2-D padding mask: the real tokens are packed into one `flash_attn_varlen_func` call
   and the output padded back with zeros (rows of padding tokens are 0, not garbage);
2. `cu_seq_lens_q/k` and `max_length_q/k` given (padding-free training collators): a
   varlen call on the flattened batch;
3. `position_ids` that restart inside a row (sequences packed end to end, no mask): one
   sequence per run of consecutive positions, a varlen call;
4. otherwise a dense `flash_attn_func` call.

A query shorter than its keys (decoding with a KV cache) is aligned to the last keys:
flash-attn's bottom-right causal convention, which portattn shares. `sliding_window=w`
becomes `window_size=(w - 1, w - 1)` (with causal the right side is 0 anyway): a query sees
itself and the w - 1 keys before it, exactly eager's `kv_idx > q_idx - w`. Encoder models
that want eager's bidirectional `|q - kv| <= w` pass w + 1, as ModernBERT does.

Dtypes: float32 queries are cast to float16/bfloat16 (one warning) when autocast is on or
the layer's own weights are in half precision, as transformers' flash path does (layer norms
kept in float32, e.g. by PEFT). A model that is float32 throughout stays float32: portattn
serves float32 with its reference backend on every device (exact, but on a GPU much slower
than the kernels, with portattn's one-time fallback warning): load the model in bfloat16
for speed.

Attention sinks (`s_aux`, gpt-oss) are passed on to every call (portattn/sinks.py).

Not supported (a clear error, never a silent wrong answer): paged caches (continuous
batching), 4-D masks built elsewhere. Under torch.compile with a
cache, the 2-D mask is taken as left padding (generate()'s layout; holes inside a row are
not read from it, since that would need a host read). `output_attentions=True`
warns once and returns None as the weights.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Optional

import torch

from ..api import _dense_call, _kvcache_call, flash_attn_func, flash_attn_varlen_func
from ..errors import error_buffer
from ._padding import (
    Packing,
    pack,
    packing_from_mask,
    packing_from_position_ids,
    unpack,
)

DEFAULT_NAME = "portattn"
# padding_mask's key-bounds form is an int32 (2, batch, 1, 1) tensor. 4-D because generate()
# builds a compileable cache's masks before the forward, which then passes 4-D masks through
# untouched (and would rebuild from a 2-D one); int32 because no mask transformers builds is
# (bool, int64 0/1, float), so the dtype tells them apart without reading values.
KEY_BOUNDS_DTYPE = torch.int32
# padding_mask's written-extent form: a (batch, n) uint8 view of one element (no mask is
# allocated), n the cache slots written so far, all of them real tokens. attention_forward
# cuts the keys to the first n and makes the dense call: an eager prefill chunk into a static
# cache then costs what a DynamicCache prefill costs (packing an all-True mask took two host
# reads per layer: 29.9 against SDPA's 25.7 ms for a batch-8 1k-token prefill on an H100).
EXTENT_DTYPE = torch.uint8
# Queries per call up to which padding_mask gives key bounds (the cache read in place by the
# decode kernels) rather than a mask to pack: decode steps and short speculative chunks.
BOUNDS_MAX_QUERIES = 16
_HALF = (torch.float16, torch.bfloat16)
_warned: set = set()


def register(name: str = DEFAULT_NAME) -> str:
    """Register portattn with transformers under `name`; returns the name.

    Afterwards `from_pretrained(..., attn_implementation=name)`, `from_config(...)` and
    `model.set_attn_implementation(name)` use portattn. Registering twice is harmless.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as error:
        raise ImportError(
            "portattn.integrations.transformers.register() needs transformers "
            f"(pip install transformers): {error}"
        ) from error
    _check_name(name)
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, padding_mask)
    return name


def _check_name(name: str) -> None:
    # transformers decides by substring and shape of the name: one containing "flash" is
    # taken for a flash-attn package it then tries to import, "org/repo" for a hub
    # kernel to download, and the built-in names would replace transformers' own.
    reserved = ("flash", "sdpa", "flex", "eager", "paged")
    if not isinstance(name, str) or not name or "/" in name or ":" in name or any(r in name for r in reserved):
        raise ValueError(
            f"name must be a plain identifier without '/', ':' or any of {reserved} "
            f"(transformers gives those a meaning of its own), got {name!r}"
        )


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract, computed by portattn.

    query: (batch, heads, seq_q, head_dim); key, value: (batch, kv_heads, seq_k, head_dim),
    kv_heads dividing heads (passed on un-expanded: GQA is native). Returns
    ((batch, seq_q, heads, head_dim_v), None).
    """
    _refuse_unsupported(attention_mask, kwargs)
    compiling = torch.compiler.is_compiling()
    if query.is_cuda and not compiling and query.get_device() not in _ERROR_BUFFERS_MADE:
        # The device's error buffer (portattn/errors.py) is created on first use; created here,
        # in the eager prefill, it lives outside the memory pool of the CUDA graphs that a
        # compiled (reduce-overhead) decode step records, where cudagraph trees refuse a new
        # long-lived tensor ("tensor(s) in the cudagraph pool not tracked as outputs"). Once per
        # device: the lookup by torch.device cost ~3 us a call.
        error_buffer(query.device)
        _ERROR_BUFFERS_MADE.add(query.get_device())
    # This wrapper runs once per layer and decode step, so: plain calls, no generators, no option
    # dict, and the dtype and head-dim fix-ups only when they apply (on the CI machine's CPU, with
    # the attention call itself stubbed out, the wrapper took 56 us per call with them
    # unconditional and 20 us without). The common call (4-D, half precision, one head dim) goes
    # on heads-first: api.py, ops.py, kvcache.py, decode.py and abi.py read the (batch, heads,
    # seq, dim) tensors as their (batch, seq, heads, dim) transposes (`heads_first`), so the decode
    # kernels get the same arguments with no view made (three transposes, ~6 us a call); every
    # route that needs portattn's layout makes the views itself. Traced calls take the views (they
    # cost nothing in a graph, and validation.seq_first is an itemgetter dynamo cannot trace).
    query_shape = query.shape
    if (len(query_shape) == 4 and len(key.shape) == 4 and len(value.shape) == 4 and query.dtype != torch.float32
            and value.shape[3] == query_shape[3] and not compiling):
        q, k, v, heads_first = query, key, value, True
        head_dim, seqlen_k = query_shape[3], key.shape[2]
    else:
        q, k, v, heads_first = _seq_first_views(query, key, value)  # (batch, seq, heads, dim)
        if q.dtype == torch.float32:
            q, k, v = _compute_dtype(module, q, k, v)
        head_dim, seqlen_k = q.shape[-1], k.shape[1]
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    if scaling is None:  # portattn's default would use the padded head dim below
        scaling = head_dim ** -0.5
    value_dim = v.shape[-1]
    if value_dim != head_dim:
        q, k, v, value_dim = _equal_head_dims(q, k, v)
    window = (-1, -1) if sliding_window is None else _window(sliding_window, seqlen_k)
    out = _attend(q, k, v, attention_mask, kwargs, float(dropout or 0.0), float(scaling), causal, window,
                  float(softcap or 0.0), _deterministic(kwargs), kwargs.get("s_aux"), heads_first)
    return (out if value_dim == head_dim else out[..., :value_dim]), None


def _attend(q, k, v, attention_mask, kwargs, dropout_p, scale, causal, window, softcap, deterministic,
            s_aux, heads_first=False) -> torch.Tensor:
    """The cases of the module docstring, in that order. The options go on by position.
    heads_first: q, k, v are (batch, heads, seq, dim) (transformers' layout, see attention_forward);
    the key-bounds and dense calls take them so, the packing cases make (batch, seq, heads, dim) views."""
    shape = q.shape
    batch, seqlen_q = shape[0], shape[2 if heads_first else 1]
    if attention_mask is not None and attention_mask.dtype == KEY_BOUNDS_DTYPE:
        # Key bounds (padding_mask's decode form): the keys are read in place, the live ones of
        # sequence b being [bounds[0, b], bounds[1, b]); nothing is read on the host.
        if dropout_p > 0.0:
            raise ValueError("attn_implementation='portattn': dropout with a KV cache is not supported")
        start, end = _key_bounds(attention_mask, batch)
        return _kvcache_call(q, k, v, None, None, None, None, end, None, start, None, scale, causal, window, softcap,
                             True, None, 0, False, None, None, None, None, s_aux, 0, heads_first)
    if heads_first and attention_mask is not None:
        # The mask cases cut and pack the keys by position, in portattn's layout.
        q, k, v, heads_first = _seq_first_views(q, k, v)
    if attention_mask is not None and attention_mask.dtype == EXTENT_DTYPE:
        written = attention_mask.shape[1]
        k, v, attention_mask = k[:, :written], v[:, :written], None
    if attention_mask is not None:
        mask = attention_mask.bool()
        if k.shape[1] > mask.shape[1]:
            # A static cache hands over all its slots; those past the mask were never written.
            k, v = k[:, : mask.shape[1]], v[:, : mask.shape[1]]
        elif k.shape[1] < mask.shape[1]:
            # A mask not cut to a sliding-window cache by padding_mask (built elsewhere):
            # such a cache holds the last keys, so they own the mask's last columns.
            mask = mask[:, -k.shape[1]:]
        keys = packing_from_mask(mask)
        # The queries are the last seqlen_q tokens the mask describes (prefill: all of them).
        queries = keys if seqlen_q == k.shape[1] else packing_from_mask(mask[:, -seqlen_q:])
        out = _varlen(q, k, v, queries, keys, dropout_p, scale, causal, window, softcap, deterministic, s_aux)
        return unpack(out, queries, batch, seqlen_q)

    if kwargs.get("cu_seq_lens_q") is not None:
        given = _given_varlen(kwargs, q.device)
        if given is not None:
            queries, keys = given
            if heads_first:
                q, k, v, heads_first = _seq_first_views(q, k, v)
            out = _varlen(q, k, v, queries, keys, dropout_p, scale, causal, window, softcap, deterministic, s_aux)
            return out.reshape(batch, seqlen_q, *out.shape[1:])

    if seqlen_q > 1:
        position_ids = kwargs.get("position_ids")
        if position_ids is not None and seqlen_q == k.shape[2 if heads_first else 1]:
            # Without a mask, eager builds a block-diagonal mask for such inputs
            # (masking_utils' packed-sequence detection); varlen computes the same.
            packing = _packing_of_positions(position_ids, batch)
            if packing is not None:
                if heads_first:
                    q, k, v, heads_first = _seq_first_views(q, k, v)
                out = _varlen(q, k, v, packing, packing, dropout_p, scale, causal, window, softcap,
                              deterministic, s_aux)
                return out.reshape(batch, seqlen_q, *out.shape[1:])

    if heads_first:
        return _dense_call(q, k, v, dropout_p, scale, causal, window, softcap, None, deterministic, False, None, s_aux,
                           0, True)
    if s_aux is None:
        return flash_attn_func(q, k, v, dropout_p, scale, causal, window, softcap, None, deterministic)
    return flash_attn_func(q, k, v, dropout_p, scale, causal, window, softcap, None, deterministic, s_aux=s_aux)


def _seq_first_views(q, k, v) -> tuple:
    """(batch, seq, heads, dim) views of heads-first q, k, v, and heads_first=False."""
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), False


# Devices (q.get_device()) whose error buffer attention_forward has made.
_ERROR_BUFFERS_MADE: set = set()
# The last key-bounds mask seen and its two rows: every layer of a decode step passes the same
# tensor, and its rows are three view ops (~2 us each on the CI machine's CPU), so a step pays
# them once, not once per layer. (weakref to the mask, its in-place version counter, the batch,
# (start, end)).
_bounds_seen: list = [None, -1, 0, None]


def _key_bounds(mask: torch.Tensor, batch: int) -> tuple:
    """(first live key, one past the last) of each sequence: int32 (batch,) rows of the mask."""
    if torch.compiler.is_compiling():
        bounds = mask.view(2, batch)
        return bounds[0], bounds[1]
    seen, version, seen_batch, rows = _bounds_seen
    if seen is not None and seen() is mask and mask._version == version and seen_batch == batch:
        return rows
    bounds = mask.view(2, batch)
    rows = (bounds[0], bounds[1])
    _bounds_seen[:] = [weakref.ref(mask), mask._version, batch, rows]
    return rows


# The last position_ids seen and their packing: every layer of one forward passes the same
# tensor, and deciding whether it packs sequences takes a host read, so a forward pays it once
# (as transformers' mask builder does), not once per layer. (weakref to the tensor, its
# in-place version counter, the batch, the packing or None.)
_positions_seen: list = [None, -1, 0, None]


def _packing_of_positions(position_ids: torch.Tensor, batch: int) -> Optional[Packing]:
    if torch.compiler.is_compiling():
        return packing_from_position_ids(position_ids.expand(batch, -1))
    seen, version, seen_batch, packing = _positions_seen
    if seen is not None and seen() is position_ids and position_ids._version == version and seen_batch == batch:
        return packing
    packing = packing_from_position_ids(position_ids.expand(batch, -1))
    _positions_seen[:] = [weakref.ref(position_ids), position_ids._version, batch, packing]
    return packing


def _varlen(q, k, v, queries: Packing, keys: Packing, dropout_p, scale, causal, window, softcap, deterministic,
            s_aux) -> torch.Tensor:
    return flash_attn_varlen_func(
        pack(q, queries), pack(k, keys), pack(v, keys), queries.cu_seqlens, keys.cu_seqlens,
        queries.max_seqlen, keys.max_seqlen, dropout_p, scale, causal, window, softcap, None, deterministic,
        s_aux=s_aux,
    )


def _given_varlen(kwargs, device) -> Optional[tuple[Packing, Packing]]:
    """Packings from the cu_seq_lens_q/k, max_length_q/k that padding-free collators pass."""
    if kwargs.get("cu_seq_lens_q") is None:
        return None
    names = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    values = [kwargs.get(n) for n in names]
    if any(x is None for x in values):
        return None
    cu_q, cu_k, max_q, max_k = values
    cu_q, cu_k = cu_q.to(device=device, dtype=torch.int32), cu_k.to(device=device, dtype=torch.int32)
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    return (Packing(torch.arange(total_q, device=device), cu_q, int(max_q)),
            Packing(torch.arange(total_k, device=device), cu_k, int(max_k)))


def padding_mask(
    batch_size: int,
    q_length: Optional[int] = None,
    kv_length: int = 0,
    q_offset=0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: Optional[torch.Tensor] = None,
    use_vmap: bool = False,
    device=None,
    cache_position: Optional[torch.Tensor] = None,
    **kwargs,
) -> Optional[torch.Tensor]:
    """What `attention_forward` gets as its mask: None, key bounds, a written extent or a 2-D bool mask.

    transformers' mask builders (`masking_utils.create_causal_mask` and friends) call this
    with the 2-D user mask over the tokens seen so far (absolute positions 0 ..), the queries'
    positions [q_offset, q_offset + q_length) (transformers 4.x: `cache_position`) and the
    layer's keys: key j holds position kv_offset + j, for j < kv_length.

    - None: every key is a real token.
    - key bounds, an int32 (2, batch, 1, 1) tensor: sequence b's live keys are
      [bounds[0, b], bounds[1, b]), its left padding and the written part of the cache. Static caches
      (`q_offset` is a device tensor) get this form under torch.compile and for short eager
      query chunks, computed on the device: no host read, static shapes, so a decode step
      compiles with fullgraph=True and replays as a CUDA graph. It assumes left padding (a
      mask whose real tokens of a row are contiguous up to the last one), which is what
      generate() builds. Eager decode steps of a dynamic cache get it too when the mask is
      left padding.
    - a written extent, a (batch, n) EXTENT_DTYPE view: the first n keys are real, the rest
      are unwritten cache slots (an eager prefill into a static cache without padding; one
      host read of q_offset per forward).
    - a 2-D bool (batch, keys) mask of real tokens otherwise (right padding, holes, long
      eager queries): the tokens are packed into a varlen call.
    """
    if cache_position is not None:
        q_length, q_offset = cache_position.shape[0], cache_position[0]
    if use_vmap:
        # use_vmap marks extra mask overlays (e.g. bidirectional image-token blocks);
        # a varlen call cannot express them, and neither can transformers' flash path.
        _warn_once("portattn: this model adds a custom mask overlay (or_mask/and_mask function) that "
                   "attn_implementation='portattn' cannot express; it is ignored, as with flash attention. "
                   "Use attn_implementation='eager' or 'sdpa' where that overlay matters.")
    static = isinstance(q_offset, torch.Tensor)
    compiling = torch.compiler.is_compiling()
    if static and (compiling or q_length <= BOUNDS_MAX_QUERIES):
        return key_bounds(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask, device)
    if attention_mask is None:
        if static:
            # An eager prefill chunk into a static cache: one host read per forward gives the
            # written extent, so the chunk runs on the forward kernels (SDPA's mask reads too).
            return _static_cache_extent(batch_size, q_length, kv_length, int(q_offset), kv_offset, device)
        if q_offset + q_length - kv_offset >= kv_length:
            return None
        # A cache buffer longer than what is written (a sliding static layer not yet full).
        if compiling or q_length <= BOUNDS_MAX_QUERIES:
            return key_bounds(batch_size, q_length, kv_length, q_offset, kv_offset, None, device)
        return _static_cache_extent(batch_size, q_length, kv_length, q_offset, kv_offset, device)
    if compiling:
        if kv_length > q_length:  # any cache: bounds, traced without reads
            return key_bounds(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask, device)
        return attention_mask[:, -kv_length:].bool()
    # Sliding-window caches keep only the last keys: the mask's last columns are theirs.
    mask = attention_mask[:, -kv_length:]
    columns = mask.shape[1]
    # One host read per mask, as SDPA's mask builder: all real tokens (an unpadded batch, the
    # common case) is settled by one reduction, like its `all()`. The counts below take six
    # more ops and a second read, paid only by padded batches.
    if bool(mask.all()):
        # Keys past the mask's columns are a static cache's unwritten slots.
        return None if columns == kv_length else _written_extent(batch_size, columns, mask.device)
    mask = mask.bool()
    # Each row's real-token and leading-padding counts, read together.
    values = torch.cat((mask.sum(-1, dtype=torch.int32), _leading_zeros(mask))).tolist()
    rows = len(values) // 2
    left_only = all(n + lead == columns for n, lead in zip(values[:rows], values[rows:]))
    if left_only and q_length <= BOUNDS_MAX_QUERIES and kv_length > q_length:  # a cache's decode step
        return key_bounds(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask, device)
    # A mask shorter than kv_length (a static cache's unwritten slots) must be kept so
    # attention_forward can cut the keys to it.
    return mask


def _leading_zeros(mask: torch.Tensor) -> torch.Tensor:
    """Per row of a (batch, n) bool mask, the count of False before its first True (n if none)."""
    return (mask.cumsum(-1, dtype=torch.int32) == 0).sum(-1, dtype=torch.int32)


def key_bounds(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask, device) -> torch.Tensor:
    """The int32 (2, batch, 1, 1) live-key range of each sequence, in the layer's key indices.

    Row 0: the first real key (the left padding, from the 2-D mask over absolute positions,
    minus kv_offset, clamped to the keys). Row 1: one past the last written key,
    q_offset + q_length - kv_offset, clamped to kv_length. All device arithmetic: q_offset
    may be a device tensor (a static cache's), and no value is read on the host.
    """
    if attention_mask is not None:
        device = attention_mask.device
        start = (_leading_zeros(attention_mask.bool()) - kv_offset).clamp_(0, kv_length)
    else:
        start = torch.zeros(batch_size, dtype=torch.int32, device=device)
    if isinstance(q_offset, torch.Tensor):
        end = (q_offset.to(device=start.device, dtype=torch.int32) + (q_length - kv_offset)).clamp(0, kv_length)
        end = end.expand(batch_size)
    else:
        end = torch.full((batch_size,), min(max(q_offset + q_length - kv_offset, 0), kv_length),
                         dtype=torch.int32, device=start.device)
    return torch.stack((start.to(torch.int32), end)).view(2, batch_size, 1, 1)


def _static_cache_extent(batch_size, q_length, kv_length, q_offset, kv_offset, device):
    """None, or the written-extent form (EXTENT_DTYPE) when a static cache has unwritten slots.

    generate() drops an all-ones mask for implementations whose name lacks "flash", but a
    static cache passes every slot of its buffer to attention; eager hides the unwritten ones
    by causality. Unwritten slots hold no token for any model, causal or not.
    """
    written = q_offset + q_length - kv_offset
    if kv_length <= written:
        return None
    return _written_extent(batch_size, written, device)


def _written_extent(batch_size: int, written: int, device) -> torch.Tensor:
    return torch.ones((), dtype=EXTENT_DTYPE, device=device).expand(batch_size, written)


def _window(sliding_window: Optional[int], seqlen_k: int) -> tuple[int, int]:
    # transformers' convention: a window of w means the query and w - 1 keys before it
    # (eager: kv_idx > q_idx - w), so flash-attn's inclusive bounds are (w - 1, w - 1);
    # under causal the right bound is 0 whatever it says. Applied, as in transformers'
    # flash path, only when the keys are longer than the window (otherwise it cuts nothing).
    if sliding_window is None or sliding_window <= 0 or seqlen_k <= sliding_window:
        return (-1, -1)
    return (int(sliding_window) - 1, int(sliding_window) - 1)


def _compute_dtype(module, q, k, v):
    """Cast float32 q, k, v to the half dtype the layer computes in, if it computes in one."""
    if q.dtype != torch.float32:
        return q, k, v
    device_type = q.device.type
    if torch.is_autocast_enabled(device_type):
        target = torch.get_autocast_dtype(device_type)
    else:
        # q is float32 while the layer's projections are half: a float32 layer norm
        # upstream (PEFT does that), not a float32 model.
        weight = next((m.weight for m in module.modules() if isinstance(m, torch.nn.Linear)), None)
        target = weight.dtype if weight is not None else q.dtype
    if target not in _HALF:
        return q, k, v  # a float32 model: portattn's reference backend serves float32 exactly
    _warn_once(f"portattn: casting float32 attention inputs to {target} (the layer's compute dtype)")
    return q.to(target), k.to(target), v.to(target)


def _equal_head_dims(q, k, v):
    """portattn needs one head dim for q, k and v; zero-pad the smaller side and crop later.

    Zero columns change neither q.k (padding q and k together) nor the output's first
    columns (padding v). Returns q, k, v and the head dim of the real output.
    """
    qk_dim, v_dim = q.shape[-1], v.shape[-1]
    if v_dim < qk_dim:
        v = torch.nn.functional.pad(v, (0, qk_dim - v_dim))
    elif v_dim > qk_dim:
        q, k = (torch.nn.functional.pad(x, (0, v_dim - qk_dim)) for x in (q, k))
    return q, k, v, v_dim


def _deterministic(kwargs) -> bool:
    given = kwargs.get("deterministic")
    if given is not None:
        return bool(given)
    # torch.use_deterministic_algorithms(True) asks every op for a reproducible backward.
    return torch.are_deterministic_algorithms_enabled()


def _refuse_unsupported(attention_mask, kwargs) -> None:
    if attention_mask is not None and attention_mask.dim() != 2 and attention_mask.dtype != KEY_BOUNDS_DTYPE:
        raise ValueError(
            f"attn_implementation='portattn' takes a 2-D (batch, keys) padding mask or None, got a "
            f"{attention_mask.dim()}-D mask of shape {tuple(attention_mask.shape)}: a mask built outside "
            "portattn's mask function (a custom 4-D mask, continuous batching). Use 'eager' or 'sdpa' for it."
        )
    if kwargs.get("block_table") is not None or type(kwargs.get("cache")).__name__ == "PagedAttentionCache":
        raise NotImplementedError("attn_implementation='portattn' does not support paged KV caches "
                                  "(continuous batching); use generate() with a DynamicCache")
    if kwargs.get("output_attentions"):
        _warn_once("portattn: output_attentions=True is not supported; attention weights are returned as None")


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
