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
