"""Every check of user input, in one place, before any backend sees a call.

Each failure raises TypeError (wrong kind of object or dtype) or ValueError
(wrong value or shape) whose message names the argument, what it got and
what is accepted. The constants a message quotes are the ones the check uses.

These checks run on every call, so they stay cheap: attribute reads and
integer comparisons only; no tensor value is read on the host (window_size given
as a tensor is the one exception, as in flash-attn). The check of cu_seqlens
*values* (`check_cu_seqlens_values`) is opt-in, PORTATTN_DEBUG_CHECKS=1, and runs
in the op body (ops.py) so that it also runs under torch.compile.
"""
from __future__ import annotations

import math
import numbers
import operator
from typing import Optional

import torch

try:
    import numpy as np
except ImportError:  # numpy is optional: without it no numpy scalar can arrive
    np = None

# flash-attn's limit; the compiled backends declare their own (<=) maximum in
# the support matrix and larger valid head dims would fall back, but above this
# no backend's memory plan is meaningful.
MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Tensors on this device type get their values (cu_seqlens, cache_seqlens, ...) checked on the
# host on every call: there a read costs no device synchronisation. bench/tools/host_decode.py
# clears it in its own process, to time the GPU path's Python on a CPU.
HOST_CHECKED_DEVICE_TYPE = "cpu"
_DTYPE_NAMES = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)


def _require_tensor(name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


# seq_first(t.shape) / seq_first(t.stride()) of a 4-D (batch, heads, seq, dim) view t: the sizes and
# strides `t.transpose(1, 2)` would have, as a tuple, without making that view (a torch op, ~2 us on
# the CI machine's CPU; the itemgetter ~0.2 us). What a heads-first call (`heads_first=True`: the
# transformers integration's eager decode step) reads instead of transposing q, k and v. Eager only:
# dynamo cannot trace an itemgetter call on a shape, so traced calls take the transposed views.
seq_first = operator.itemgetter(0, 2, 1, 3)


def check_qkv(q, k, v, varlen: bool, heads_first: bool = False):
    """Shapes, dtypes and devices of q, k, v.

    Returns (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim); for varlen
    calls batch is None and the seqlens are the packed totals. Written to read
    each tensor attribute once: this runs on every call.

    heads_first: q, k, v are 4-D (batch, heads, seq, dim) views (transformers' layout) of the
    (batch, seq, heads, dim) tensors the call describes; checked, and named in messages, as
    those tensors (`seq_first`), with no view made. Not with varlen.
    """
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        for name, value in (("q", q), ("k", k), ("v", v)):
            _require_tensor(name, value)
    q_shape, k_shape, v_shape = q.shape, k.shape, v.shape
    if heads_first:
        q_shape, k_shape, v_shape = seq_first(q_shape), seq_first(k_shape), seq_first(v_shape)
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
    # The rank is known here: index rather than star-unpack (which builds a list per tensor).
    nheads, head_dim = q_shape[-2], q_shape[-1]
    nheads_k, head_dim_k = k_shape[-2], k_shape[-1]
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
        return None, q_shape[0], k_shape[0], nheads, nheads_k, head_dim
    batch, seqlen_q = q_shape[0], q_shape[1]
    batch_k, seqlen_k = k_shape[0], k_shape[1]
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
    elif type(softmax_scale) is not float:
        softmax_scale = _as_float("softmax_scale", softmax_scale, "a float or None")
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    if causal is not True and causal is not False:
        causal = _as_bool("causal", causal)
    if type(softcap) is not float:
        softcap = _as_float("softcap", softcap, "a float")
    if not (math.isfinite(softcap) and softcap >= 0.0):
        raise ValueError(f"softcap must be a finite value >= 0 (0 disables it), got {softcap}")
    window_left, window_right = _check_window(window_size)
    if causal:
        window_right = 0
    if alibi_slopes is not None:
        _check_alibi(alibi_slopes, batch, nheads, device)
    return float(softmax_scale), window_left, window_right


def _as_float(name: str, value, accepted: str) -> float:
    """A real number that is not a bool: Python and numpy floats and ints (np.float32 is not a
    subclass of float), as flash-attn's C++ binding accepts them."""
    if isinstance(value, (bool, np.bool_) if np is not None else bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {accepted}, got {type(value).__name__} {value!r}")
    return float(value)


def _as_bool(name: str, value) -> bool:
    """True/False, or a numpy bool (np.bool_ is not a subclass of bool)."""
    if np is not None and isinstance(value, np.bool_):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def _check_window(window_size):
    # The common call passes a tuple of Python ints: keep that path to two isinstance checks.
    if type(window_size) is tuple and len(window_size) == 2 and type(window_size[0]) is int and type(window_size[1]) is int:
        left, right = window_size
    else:
        left, right = _window_pair(window_size)
    for side, value in (("left", left), ("right", right)):
        if value < -1:
            raise ValueError(f"window_size {side} must be >= -1 (-1 = unbounded), got {value}")
    return left, right


def _window_pair(window_size) -> tuple[int, int]:
    """(left, right) from any pair flash-attn accepts: a tuple/list of integer-likes, or a
    2-element integer tensor / numpy array (flash-attn's own tests pass `torch.randint(...)`).

    A CUDA tensor here costs one device-to-host copy (a sync), as it does in flash-attn,
    which also turns the window into host ints: the kernels take it as a launch parameter.
    That is the only argument for which portattn reads a device tensor on the host.
    """
    if isinstance(window_size, torch.Tensor) or type(window_size).__module__ == "numpy":
        shape = tuple(window_size.shape)
        if shape != (2,) or not _is_integer_dtype(window_size.dtype):
            raise TypeError(f"window_size must be a (left, right) pair of ints; got a {type(window_size).__name__} "
                            f"of shape {shape} and dtype {window_size.dtype}")
        left, right = window_size.tolist()  # one host read for both values
        return int(left), int(right)
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a (left, right) pair of ints, got {window_size!r}")
    return (as_int("window_size left", window_size[0], "(-1 = unbounded)", allow_device=True),
            as_int("window_size right", window_size[1], "(-1 = unbounded)", allow_device=True))


def _is_integer_dtype(dtype) -> bool:
    if isinstance(dtype, torch.dtype):
        return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
    return getattr(dtype, "kind", "") in ("i", "u")  # numpy


def as_int(name: str, value, accepted: str = "", allow_device: bool = False) -> int:
    """`value` as a Python int, for an argument flash-attn takes as an int.

    Accepted, as in flash-attn (whose C++ binding converts through __index__): a Python
    int, a numpy integer, or an integer tensor with one element. bools, floats and
    anything else raise TypeError naming the argument. A one-element tensor that is not
    on the CPU is read back only with `allow_device` (a device sync: window_size alone
    allows it, see `_window_pair`); otherwise the message asks for a host int.
    """
    if type(value) is int:
        return value
    hint = f" {accepted}" if accepted else ""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int{hint}, got bool {value!r}")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not _is_integer_dtype(value.dtype):
            raise TypeError(f"{name} must be an int{hint}; got a tensor of shape {tuple(value.shape)} and dtype {value.dtype}")
        if value.device.type not in ("cpu", "meta") and not allow_device:
            raise TypeError(f"{name} must be a host int{hint}; got a tensor on {value.device}, whose value "
                            f"portattn does not read back (a device sync per call): pass int({name}) once instead")
        return int(value.item())
    try:
        return operator.index(value)  # numpy integers and other __index__ types; not floats
    except TypeError:
        raise TypeError(f"{name} must be an int{hint}, got {type(value).__name__} {value!r}") from None


def check_sm_margin(sm_margin) -> int:
    """sm_margin (FlashAttention-3's: SMs the persistent kernels leave free for other kernels,
    e.g. communication) as a host int >= 0; integer-likes accepted, see `as_int`. Callers skip
    the call when `type(sm_margin) is int and sm_margin >= 0`, the common case."""
    value = as_int("sm_margin", sm_margin, ">= 0 (SMs left free for other kernels)")
    if value < 0:
        raise ValueError(f"sm_margin must be an int >= 0 (SMs left free for other kernels), got {value}")
    return value


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
    """Type, dtype, shape and device of one cu_seqlens tensor, and its max_seqlen; returns the batch size."""
    batch = _cu_seqlens_batch(name, cu_seqlens, device)
    check_max_seqlen(name.replace("cu_seqlens", "max_seqlen"), max_seqlen)
    return batch


def _cu_seqlens_batch(name: str, cu_seqlens, device: torch.device) -> int:
    """check_cu_seqlens without the max_seqlen."""
    if not isinstance(cu_seqlens, torch.Tensor):
        _require_tensor(name, cu_seqlens)
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu_seqlens.dtype}")
    shape = cu_seqlens.shape
    if len(shape) != 1 or shape[0] < 2:
        raise ValueError(f"{name} must be 1-D with batch + 1 >= 2 entries, got shape {tuple(shape)}")
    if cu_seqlens.device != device:
        raise ValueError(f"{name} must be on {device} like q, got {cu_seqlens.device}")
    return shape[0] - 1


def check_max_seqlen(name: str, max_seqlen) -> int:
    """max_seqlen_q / max_seqlen_k as a host int >= 0 (integer-likes accepted, see `as_int`)."""
    max_seqlen = as_int(name, max_seqlen, ">= 0")
    if max_seqlen < 0:
        raise ValueError(f"{name} must be >= 0, got {max_seqlen}")
    return max_seqlen


def check_cu_seqlens_values(name: str, cu_seqlens: torch.Tensor, max_seqlen: int, total: int) -> None:
    """Values of cu_seqlens: 0 first, non-decreasing, last <= total rows, lengths <= max_seqlen.

    Reading the values costs a device-to-host copy and a sync, so it runs only with
    PORTATTN_DEBUG_CHECKS=1 (ops.py reads it once). Without it, wrong values give wrong
    results but no access outside the given tensors (the kernels clamp on the device).
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


def check_seqused_k(seqused_k, batch: int, device: torch.device):
    """seqused_k's metadata (no values read): an int32 (batch,) tensor on the call's device."""
    if seqused_k is None:
        return None
    _require_tensor("seqused_k", seqused_k)
    if seqused_k.dtype != torch.int32 or seqused_k.shape != (batch,) or seqused_k.device != device:
        raise ValueError(f"seqused_k must be an int32 tensor of shape (batch,) = ({batch},) on {device}, got "
                         f"{seqused_k.dtype} of shape {tuple(seqused_k.shape)} on {seqused_k.device}")
    return seqused_k


def check_seqused_k_values(seqused_k: torch.Tensor, cu_seqlens_k: Optional[torch.Tensor], capacity: int = 0) -> None:
    """Values of seqused_k: sequence b uses between 0 and its own key rows (cu_seqlens_k's
    length, or `capacity` for a paged cache). A host read: CPU tensors and
    PORTATTN_DEBUG_CHECKS=1 only; on a GPU the kernels clamp (common/seq_bounds.h)."""
    used = seqused_k.tolist()
    if cu_seqlens_k is not None:
        cu = cu_seqlens_k.tolist()
        limits = [b - a for a, b in zip(cu, cu[1:])]
        what = "cu_seqlens_k[b + 1] - cu_seqlens_k[b]"
    else:
        limits = [capacity] * len(used)
        what = "the block table's capacity"
    for b, (n, limit) in enumerate(zip(used, limits)):
        if not 0 <= n <= limit:
            raise ValueError(f"seqused_k[{b}] = {n} is out of range: it must be in [0, {limit}] ({what})")


def check_same_layout(name: str, value, like_name: str, like: torch.Tensor) -> None:
    """`value` must be a tensor with the shape, dtype and device of `like` (dout/out vs q,
    dq/dk/dv vs q/k/v in the low-level backward)."""
    _require_tensor(name, value)
    if value.shape != like.shape:
        raise ValueError(f"{name} must have the shape of {like_name} {tuple(like.shape)}, got {tuple(value.shape)}")
    if value.dtype != like.dtype:
        raise TypeError(f"{name} must have the dtype of {like_name} ({like.dtype}), got {value.dtype}")
    if value.device != like.device:
        raise ValueError(f"{name} must be on {like_name}'s device {like.device}, got {value.device}")


def check_softmax_lse(softmax_lse, q: torch.Tensor, varlen: bool) -> None:
    """The LSE a low-level backward is given: float32 (batch, nheads, seqlen_q), or
    (nheads, total_q) for varlen; any strides (it is made contiguous if needed)."""
    _require_tensor("softmax_lse", softmax_lse)
    expect = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
    if tuple(softmax_lse.shape) != expect:
        layout = "(nheads, total_q)" if varlen else "(batch, nheads, seqlen_q)"
        raise ValueError(f"softmax_lse must have shape {layout} = {expect}, got {tuple(softmax_lse.shape)}")
    if softmax_lse.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"softmax_lse must be float32 (as the forward returns it), got {softmax_lse.dtype}")
    if softmax_lse.device != q.device:
        raise ValueError(f"softmax_lse must be on {q.device} like q, got {softmax_lse.device}")


def check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q: int, total_k: int,
                 device: torch.device) -> tuple[int, int, int]:
    """Metadata of a varlen call's cu_seqlens and max_seqlen (no values read).
    Returns (batch, max_seqlen_q, max_seqlen_k) with the maxima as host ints."""
    # Every varlen call (and a decode step through varlen) runs this: host ints pass with one test.
    if type(max_seqlen_q) is not int or max_seqlen_q < 0:
        max_seqlen_q = check_max_seqlen("max_seqlen_q", max_seqlen_q)
    if type(max_seqlen_k) is not int or max_seqlen_k < 0:
        max_seqlen_k = check_max_seqlen("max_seqlen_k", max_seqlen_k)
    batch = _cu_seqlens_batch("cu_seqlens_q", cu_seqlens_q, device)
    batch_k = _cu_seqlens_batch("cu_seqlens_k", cu_seqlens_k, device)
    if batch_k != batch:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same batch, got {batch} and {batch_k} sequences")
    return batch, max_seqlen_q, max_seqlen_k


def check_rng_state(rng_state, dropout_p: float):
    """The low-level backward's rng_state: what the forward returned, needed with dropout."""
    if dropout_p == 0.0:
        return None
    if rng_state is None:
        raise ValueError("rng_state is required when dropout_p > 0: pass the rng_state the forward returned "
                         "(it selects the dropout mask to regenerate)")
    _require_tensor("rng_state", rng_state)
    if rng_state.dtype != torch.int64 or rng_state.numel() != 2:
        raise ValueError(f"rng_state must be the int64 (seed, offset) pair the forward returned, got dtype "
                         f"{rng_state.dtype} and shape {tuple(rng_state.shape)}")
    return rng_state
