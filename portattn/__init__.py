"""portattn: hardware-portable exact attention (FlashAttention-class kernels) for PyTorch.

The API follows flash-attn's names and semantics, so switching is an import change:

    from portattn import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True)

`portattn.explain(q, k, v, ...)` says which backend runs a call and why;
`python -m portattn` (or `portattn-report`) describes this machine's support;
`portattn.check_errors()` raises if a GPU kernel contained out-of-range KV-cache metadata
(cache_seqlens, cache_leftpad, cache_batch_idx, block_table) since the last check.
"""
__version__ = "0.2.0"

try:
    import torch as _torch  # noqa: F401
except ImportError as _error:  # the report CLI and capability/ still work without torch
    _TORCH_MISSING = _error
else:
    _TORCH_MISSING = None
    from .api import (
        explain,
        flash_attn_func,
        flash_attn_kvpacked_func,
        flash_attn_qkvpacked_func,
        flash_attn_varlen_func,
        flash_attn_varlen_kvpacked_func,
        flash_attn_varlen_qkvpacked_func,
        flash_attn_with_kvcache,
    )
    from .dispatch import UnsupportedCallError, force_backend, selected_backends
    from .errors import check_errors
    from .merge import merge_attention_states

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
    "explain",
    "merge_attention_states",
    "force_backend",
    "selected_backends",
    "UnsupportedCallError",
    "check_errors",
]


def __getattr__(name):
    if _TORCH_MISSING is not None and name in __all__:
        raise ImportError(f"portattn.{name} needs PyTorch (pip install torch): {_TORCH_MISSING}")
    raise AttributeError(f"module 'portattn' has no attribute {name!r}")
