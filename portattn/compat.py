"""`import flash_attn` served by portattn, for libraries written against flash-attn.

    import portattn.compat
    portattn.compat.provide_flash_attn()      # before the library imports flash_attn
    import ring_flash_attn                   # now runs on portattn: NVIDIA, AMD or CPU

`provide_flash_attn` puts module aliases in `sys.modules`:

    flash_attn                        the public functions (portattn.api)
    flash_attn.flash_attn_interface   portattn.flash_attn_interface (+ the low-level _flash_attn_*)
    flash_attn.bert_padding           portattn.bert_padding (unpad_input, pad_input, index_first_axis)
    flash_attn.layers.rotary          portattn.rotary (apply_rotary_emb)

It never shadows a real flash-attn (installed or already imported) unless asked to with
force=True, and returns (and logs) one line saying what it did. Code that already holds
the real flash-attn's functions keeps them: call it before importing such code.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import sys
import types

_LOG = logging.getLogger("portattn")

# The flash-attn release whose API these modules follow (exposed as flash_attn.__version__,
# which some libraries compare against).
FLASH_ATTN_API_VERSION = "2.8.3"
_MARK = "__portattn_alias__"


def _package(name: str, doc: str) -> types.ModuleType:
    """An empty package module that can hold aliased submodules."""
    module = types.ModuleType(name, doc)
    module.__path__ = []  # a package: `import flash_attn.x` then looks x up in sys.modules
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    setattr(module, _MARK, True)
    return module


def _aliases() -> dict:
    from . import bert_padding, flash_attn_interface, rotary

    root = _package("flash_attn", "flash-attn's API, served by portattn (portattn.compat.provide_flash_attn).")
    root.__version__ = FLASH_ATTN_API_VERSION
    for name in ("flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
                 "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func",
                 "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"):
        setattr(root, name, getattr(flash_attn_interface, name))
    layers = _package("flash_attn.layers", "flash-attn's layers, served by portattn (rotary only).")
    root.flash_attn_interface = flash_attn_interface
    root.bert_padding = bert_padding
    root.layers = layers
    layers.rotary = rotary
    return {
        "flash_attn": root,
        "flash_attn.flash_attn_interface": flash_attn_interface,
        "flash_attn.bert_padding": bert_padding,
        "flash_attn.layers": layers,
        "flash_attn.layers.rotary": rotary,
    }


def is_provided() -> bool:
    """True when `flash_attn` in this process is portattn's alias."""
    return getattr(sys.modules.get("flash_attn"), _MARK, False)


def _real_flash_attn() -> str:
    """Where a real flash-attn is, imported or installed; "" when there is none."""
    loaded = sys.modules.get("flash_attn")
    if loaded is not None:
        return "" if getattr(loaded, _MARK, False) else f"already imported from {getattr(loaded, '__file__', '?')}"
    try:
        spec = importlib.util.find_spec("flash_attn")
    except (ImportError, ValueError):
        spec = None
    return f"installed at {spec.origin}" if spec is not None else ""


def provide_flash_attn(force: bool = False) -> str:
    """Make `import flash_attn` (and the submodules above) resolve to portattn.

    Returns what it did, in one line (also logged at INFO on the "portattn" logger). A
    real flash-attn is left in place unless `force`; with force, every `flash_attn.*`
    module is dropped from sys.modules first."""
    if is_provided():
        message = "portattn: flash_attn already resolves to portattn; nothing to do"
    else:
        real = _real_flash_attn()
        if real and not force:
            message = (f"portattn: a real flash_attn is {real}; left it in place "
                       "(provide_flash_attn(force=True) shadows it with portattn)")
            _LOG.info(message)
            return message
        for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
            del sys.modules[name]
        aliases = _aliases()
        sys.modules.update(aliases)
        shadowed = f" (shadowing the real flash_attn {real})" if real else ""
        message = f"portattn: {', '.join(aliases)} now resolve to portattn{shadowed}"
    _LOG.info(message)
    return message


def withdraw_flash_attn() -> str:
    """Undo provide_flash_attn: remove portattn's flash_attn aliases from sys.modules."""
    if not is_provided():
        return "portattn: flash_attn is not portattn's alias; nothing removed"
    removed = [n for n in sys.modules if (n == "flash_attn" or n.startswith("flash_attn."))]
    for name in removed:
        del sys.modules[name]
    message = f"portattn: removed {', '.join(sorted(removed))}"
    _LOG.info(message)
    return message


# ring-flash-attn's attention modules (its __init__ re-exports these, then imports its HF
# adapter, which needs transformers 4.x: `import ring_flash_attn` fails without it).
_RING_MODULES = ("llama3_flash_attn_varlen", "ring_flash_attn", "ring_flash_attn_varlen",
                 "zigzag_ring_flash_attn", "zigzag_ring_flash_attn_varlen", "stripe_flash_attn")


def import_ring_flash_attn(merge: str = "auto", backward: str = "portattn", sm_margin: int = 0):
    """`import ring_flash_attn`, on portattn, with or without transformers 4.x.

    Calls provide_flash_attn() first. When the package imports normally (transformers
    < 5 installed, or a ring-flash-attn without the adapter problem), returns it. When
    only its HuggingFace adapter fails to import (ring-flash-attn 0.1.8 with transformers
    5, or none), returns the package with its attention functions loaded from their own
    modules, unchanged, and without the adapter (`substitute_hf_flash_attn`,
    `update_ring_flash_attn_params` are then missing).

    `merge` picks the per-step merge of partial outputs its forwards call
    (install_ring_merge): "auto" (default) portattn's fused kernel on GPUs where it is
    built, ring-flash-attn's own elsewhere; "portattn" always portattn's merge; "ring"
    ring-flash-attn's own.

    `backward` picks the zigzag backward (install_ring_backward): "portattn" (default) sends
    each rank's bf16 partial dK/dV to the block's owner, "ring" ring-flash-attn's own fp32 ring
    of accumulators.

    `sm_margin` (int >= 0): SMs every attention call of its forwards and backwards leaves
    free for the ring's send/recv kernels (install_ring_sm_margin). 0 (default) calls
    portattn's functions unchanged."""
    package = _import_ring_package()
    install_ring_merge(merge)
    install_ring_backward(backward)
    install_ring_sm_margin(sm_margin)
    return package


def _import_ring_package():
    import importlib

    provide_flash_attn()
    try:
        return importlib.import_module("ring_flash_attn")
    except ImportError as error:
        if "transformers" not in str(error) and "is_flash_attn" not in str(error):
            raise
        adapter_error = error
    spec = importlib.util.find_spec("ring_flash_attn")
    package = types.ModuleType("ring_flash_attn", "ring-flash-attn's attention functions (HF adapter not loaded)")
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    package.__file__ = spec.origin
    sys.modules["ring_flash_attn"] = package
    for name in _RING_MODULES:
        module = importlib.import_module(f"ring_flash_attn.{name}")
        setattr(package, name, module)
        for public in dir(module):
            if public.endswith("_func") or public.endswith("_prepare_cu_seqlens"):
                setattr(package, public, getattr(module, public))
    _LOG.info("portattn: imported ring_flash_attn without its HF adapter (%s)", adapter_error)
    return package


# Note [ring merge]
# ring-flash-attn's forwards merge every step's partial output into an fp32 accumulator
# with utils.update_out_and_lse: a TorchScript function of separate elementwise kernels
# (block_out to fp32, out - block_out, sigmoid(...) * that, out - that, plus the LSE's),
# each a pass over the whole fp32 output, and its sliced form writes the merged half back
# with one more copy. portattn.merge_attention_states does the same arithmetic in one
# in-place pass (Note [portattn merge attention states] in backends/common/merge.h). Each
# attention module binds update_out_and_lse at import (`from .utils import ...`), so the
# replacement goes into those modules' globals; ring_flash_attn.utils keeps the original.
_MERGE_MODES = ("auto", "portattn", "ring")


def _ring_utils():
    import importlib

    return importlib.import_module("ring_flash_attn.utils")


def _fused_update_out_and_lse(mode: str, original):
    import torch

    from .merge import _compiled, merge_attention_states

    def update_out_and_lse(out, lse, block_out, block_lse, slice_=None):
        # The first step creates the accumulator (a copy of block_out in fp32 and a view of
        # block_lse), and an fp32 accumulator is what the rest of ring-flash-attn expects.
        if out is None or out.dtype != torch.float32 or lse is None:
            return original(out, lse, block_out, block_lse, slice_)
        if mode == "auto" and not (out.is_cuda and _compiled() is not None):
            return original(out, lse, block_out, block_lse, slice_)
        if slice_ is not None:
            # In place through the views: no write-back copy of the merged half.
            merge_attention_states(out[slice_], lse[slice_], block_out, block_lse)
        else:
            merge_attention_states(out, lse, block_out, block_lse)
        return out, lse

    update_out_and_lse.__portattn_merge__ = mode
    return update_out_and_lse


def install_ring_merge(mode: str = "auto") -> str:
    """Choose the update_out_and_lse that ring-flash-attn's attention modules call (Note [ring
    merge]): "auto" portattn's fused kernel where the tensors are on a GPU with it built and
    ring-flash-attn's own otherwise; "portattn" portattn's merge everywhere (its torch
    reference off the GPU); "ring" ring-flash-attn's own. Call after import_ring_flash_attn
    (which calls this with its `merge`); returns a line saying what it did."""
    import importlib

    if mode not in _MERGE_MODES:
        raise ValueError(f"merge must be one of {', '.join(_MERGE_MODES)}, got {mode!r}")
    original = _ring_utils().update_out_and_lse
    function = original if mode == "ring" else _fused_update_out_and_lse(mode, original)
    patched = []
    for name in _RING_MODULES:
        module = importlib.import_module(f"ring_flash_attn.{name}")
        if hasattr(module, "update_out_and_lse"):
            module.update_out_and_lse = function
            patched.append(name)
    message = f"portattn: ring-flash-attn's update_out_and_lse is {mode!r} in {', '.join(patched)}"
    _LOG.info(message)
    return message


def ring_merge_mode() -> str:
    """The merge ring-flash-attn's attention modules call now: "auto", "portattn" or "ring"."""
    import importlib

    module = importlib.import_module("ring_flash_attn.zigzag_ring_flash_attn")
    return getattr(module.update_out_and_lse, "__portattn_merge__", "ring")


_BACKWARD_MODES = ("portattn", "ring")
_RING_ORIGINAL_BACKWARD = {}


def install_ring_backward(mode: str = "portattn") -> str:
    """Choose the zigzag backward ring-flash-attn's ZigZagRingFlashAttnFunc calls: "portattn"
    (portattn.ring_backward, Note [zigzag backward partials]: half the dK/dV bytes a step) or
    "ring" (ring-flash-attn's own). Call after import_ring_flash_attn (which calls this with
    its `backward`); returns a line saying what it did."""
    import importlib

    if mode not in _BACKWARD_MODES:
        raise ValueError(f"backward must be one of {', '.join(_BACKWARD_MODES)}, got {mode!r}")
    module = importlib.import_module("ring_flash_attn.zigzag_ring_flash_attn")
    original = _RING_ORIGINAL_BACKWARD.setdefault("zigzag", module.zigzag_ring_flash_attn_backward)
    if mode == "portattn":
        from .ring_backward import zigzag_ring_flash_attn_backward as function
    else:
        function = original
    # ZigZagRingFlashAttnFunc.backward looks the name up in its module's globals at each call.
    module.zigzag_ring_flash_attn_backward = function
    message = f"portattn: ring-flash-attn's zigzag backward is {mode!r}"
    _LOG.info(message)
    return message


# Note [ring sm_margin]
# Each step of a ring forward or backward runs its attention kernel while NCCL's send/recv
# kernel for the next step holds some SMs; a persistent attention grid deals its tiles out
# at launch, so the CTAs that wait for those SMs run their whole share late
# (docs/context-parallel.md). sm_margin makes those grids leave SMs free. ring-flash-attn
# calls the low-level functions with the keyword arguments it knows (built from their
# signatures by its utils.get_default_args), never with sm_margin, so the functions its
# attention modules imported are replaced there by wrappers that pass it, and whose
# signature shows it as sm_margin's default (get_default_args then passes it as well).
_RING_LOW_LEVEL = ("_flash_attn_forward", "_flash_attn_backward", "_flash_attn_varlen_forward",
                   "_flash_attn_varlen_backward")


def _with_sm_margin(function, sm_margin: int):
    import functools
    import inspect

    signature = inspect.signature(function)
    position = list(signature.parameters).index("sm_margin")

    @functools.wraps(function)
    def call(*args, **kwargs):
        if len(args) <= position:  # (given by position, the caller's value stands)
            kwargs.setdefault("sm_margin", sm_margin)
        return function(*args, **kwargs)

    # inspect.getfullargspec (get_default_args) reads __signature__, not __wrapped__.
    call.__signature__ = signature.replace(parameters=[
        p.replace(default=sm_margin) if p.name == "sm_margin" else p for p in signature.parameters.values()])
    call.__portattn_sm_margin__ = sm_margin
    return call


def install_ring_sm_margin(sm_margin: int = 0) -> str:
    """Make ring-flash-attn's attention modules call the low-level functions they imported with
    `sm_margin` (Note [ring sm_margin]): wrappers that pass it where it is > 0, the functions
    themselves where it is 0. Call after import_ring_flash_attn (which calls this with its
    `sm_margin`); returns a line saying what it did. A margin > 0 needs portattn's functions
    there: a real flash-attn 2 left in place (provide_flash_attn without force) takes none."""
    import importlib
    import inspect

    from .validation import check_sm_margin

    sm_margin = check_sm_margin(sm_margin)
    targets = []  # (module, function name, the function it imported)
    for name in _RING_MODULES:
        module = importlib.import_module(f"ring_flash_attn.{name}")
        for function_name in _RING_LOW_LEVEL:
            function = getattr(module, function_name, None)
            if function is None:
                continue
            if hasattr(function, "__portattn_sm_margin__"):
                function = function.__wrapped__
            if sm_margin and "sm_margin" not in inspect.signature(function).parameters:
                raise ValueError(f"ring_flash_attn.{name}.{function_name} takes no sm_margin: it is "
                                 f"{function.__module__}'s, not portattn's (provide_flash_attn(force=True) "
                                 f"before importing ring_flash_attn makes it portattn's)")
            targets.append((module, function_name, function))
    for module, function_name, function in targets:
        setattr(module, function_name, _with_sm_margin(function, sm_margin) if sm_margin else function)
    patched = ", ".join(f"{module.__name__.rpartition('.')[2]}.{function_name}" for module, function_name, _ in targets)
    message = f"portattn: ring-flash-attn's attention modules call with sm_margin={sm_margin} ({patched})"
    _LOG.info(message)
    return message


def ring_backward_mode() -> str:
    """The zigzag backward ring-flash-attn calls now: "portattn" or "ring"."""
    import importlib

    from .ring_backward import zigzag_ring_flash_attn_backward

    module = importlib.import_module("ring_flash_attn.zigzag_ring_flash_attn")
    return "portattn" if module.zigzag_ring_flash_attn_backward is zigzag_ring_flash_attn_backward else "ring"


def ring_sm_margin() -> int:
    """The sm_margin ring-flash-attn's attention modules pass now (0: none)."""
    import importlib

    module = importlib.import_module("ring_flash_attn.zigzag_ring_flash_attn")
    return getattr(module._flash_attn_forward, "__portattn_sm_margin__", 0)
