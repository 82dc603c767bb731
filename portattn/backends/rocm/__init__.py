"""ROCm backend: MFMA tiled attention for AMD CDNA2/3/4 (gfx90a, gfx942, gfx950) and the WMMA
forward, backward and decode for RDNA3/4 (gfx1100, gfx1201); csrc/, built by build.py.

Never run on hardware by us (no AMD GPU is reachable): every ROCm entry of the
support matrix is "compiled", and selfcheck.py verifies it on first use. The
module `_C` has the CUDA module's `fwd` argument list (backends/common/params.h
as Python ints and stride tuples). ROCm's torch exposes HIP streams through the
torch.cuda namespace, hence `_cuda_getCurrentRawStream`.

Import never raises: a module that is not built, or whose HIP runtime
(libamdhip64) cannot be loaded, leaves `unavailable_reason` saying so, and
dispatch falls back.
"""
from __future__ import annotations

import torch

from ...capability.callspec import CallSpec
from ..abi import load_extension
from ..compiled import CompiledBackend

# Not built, built for another Python, or libamdhip64 missing: a reason, not an error.
_C, _IMPORT_ERROR = load_extension(__name__, "ROCm")


def _availability() -> str:
    """Why this process cannot use the ROCm kernels at all; "" = it can."""
    if _IMPORT_ERROR:
        return _IMPORT_ERROR
    if torch.version.hip is None:
        return "this torch is not a ROCm build (torch.version.hip is None); the ROCm backend needs PyTorch for ROCm"
    count, status = _C.device_count()
    if count == 0:
        return f"no AMD GPU visible to the HIP runtime ({status})"
    return ""


class RocmBackend(CompiledBackend):
    name = "rocm"

    def __init__(self) -> None:
        super().__init__(_C, _availability())

    def unsupported_reasons(self, call: CallSpec) -> list[str]:
        from ...capability.matrix import check_call
        from ...capability.probe import device_info

        if self.unavailable_reason:
            return [self.unavailable_reason]
        return check_call("rocm", device_info(call.device_index), call, self._build_config)
