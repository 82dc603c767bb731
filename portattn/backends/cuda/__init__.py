"""CUDA backend: FlashAttention-2-class kernels for NVIDIA sm80+ (csrc/, built by build.py).

The compiled module `_C` takes raw pointers, strides and the stream
(backends/common/params.h); this class turns tensors into those. `forward`
is on the hot path of every small call, so it does no validation (done in
portattn/validation.py), builds no dicts and copies nothing: it reads
shapes, pointers and stride tuples and makes one pybind11 call.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...capability import smem_cap
from ...capability.callspec import CallSpec
from ..abi import load_extension
from ..compiled import CompiledBackend

# Not built (no nvcc at install time), or built for another Python: a reason, not an error.
_C, _IMPORT_ERROR = load_extension(__name__, "CUDA")

# PORTATTN_MAX_SMEM_KIB caps every launch of the module (Note [portattn smem budget] in
# csrc/smem_budget.h), set here, once, before any launch. An invalid value leaves the module
# uncapped: dispatch then refuses every call with the variable's error (dispatch.py).
if _C is not None:
    if hasattr(_C, "set_smem_cap"):
        _C.set_smem_cap(smem_cap.cap_bytes() or 0)
    elif smem_cap.cap_bytes() is not None:
        _C, _IMPORT_ERROR = None, (f"{smem_cap.ENV} is set but this build of the CUDA module cannot cap its "
                                   f"launches (it predates the variable): rebuild it")


class CudaBackend(CompiledBackend):
    name = "cuda"

    def __init__(self) -> None:
        super().__init__(_C, _IMPORT_ERROR)
        self._devices: Optional[list] = None

    def _device_info(self, call: CallSpec):
        """The DeviceInfo of the GPU the call's tensors are on (not the current device:
        a call on cuda:1 while cuda:0 is current is judged by cuda:1's arch and memory)."""
        if self._devices is None:
            from ...capability.probe import probe_devices

            self._devices = [d for d in probe_devices() if d.vendor == "nvidia"]
        if not self._devices or not torch.cuda.is_available():
            return None
        index = call.device_index if call.device_index is not None else torch.cuda.current_device()
        return self._devices[index] if 0 <= index < len(self._devices) else None

    def unsupported_reasons(self, call: CallSpec) -> list[str]:
        from ...capability.matrix import check_call

        if self.unavailable_reason:
            return [self.unavailable_reason]
        if torch.version.hip is not None:
            return ["this torch is a ROCm build (the CUDA backend needs CUDA)"]
        return check_call(self.name, self._device_info(call), call, self.build_config())


class CudaSm90Backend(CudaBackend):
    """The Hopper path (csrc/hopper_*: TMA + wgmma, sm_90a), forward and backward.

    What it serves is declared in capability/specs/cuda_sm90.py (dispatch tries it
    before the sm80+ path, capability/matrix.DISPATCH_PRIORITY); every call it does
    not declare runs on the sm80+ path above. Both paths write the same out/LSE and
    take the same backward workspace, so either forward pairs with either backward.
    """

    name = "cuda-sm90"

    def __init__(self) -> None:
        super().__init__()
        if not self.unavailable_reason and not hasattr(self.module, "hopper_fwd"):
            self.unavailable_reason = "this build has no sm_90a path (sm_90 was not among PORTATTN_CUDA_ARCHS, or PORTATTN_CUDA_HOPPER=0)"

    def build_config(self) -> Optional[dict]:
        return None if self._build_config is None else self._build_config.get("hopper")

    # Same arguments as the sm80+ entry points; the backward's workspace is the ordered-dQ layout.
    fwd_entry = "hopper_fwd"
    bwd_entry = "hopper_bwd"
    ordered_dq = True
