"""PORTATTN_MAX_SMEM_KIB: choose and launch kernels as on a GPU with less shared memory (torch-free).

With PORTATTN_MAX_SMEM_KIB=N every NVIDIA GPU is treated as one whose opt-in shared memory
per block is min(N KiB, its own): the probe reports that budget (`DeviceInfo.
smem_per_block_optin`, the device's own in `smem_per_block_optin_uncapped`), so the support
matrix, dispatch, explain() and the report judge calls by it, and the CUDA module caps
every launch at it (Note [portattn smem budget] in backends/cuda/csrc/smem_budget.h). An
H100 run with N=99 executes the tile configurations of an RTX 4090, L4 or A10 (99 KiB), and
with N=163 those of an A100. What it does not change: the SM count, the shared memory per SM
(the decode planner's occupancy estimate) and the machine code (sm_90 SASS on an H100).
AMD GPUs are not capped: the ROCm kernels read no budget.

The variable is read once per process. A value that is not an integer in
[MIN_KIB, MAX_KIB] is a configuration error: `import portattn` still works (and the report
shows the error), but every call raises a ValueError naming the variable and the range.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

ENV = "PORTATTN_MAX_SMEM_KIB"
# 48 KiB is what every CUDA GPU gives a block without opting in; above the largest opt-in
# limit of any part (227 KiB) a cap changes nothing, and 1024 still catches a value given
# in bytes by mistake.
MIN_KIB = 48
MAX_KIB = 1024


def parse(text: Optional[str]) -> Optional[int]:
    """The cap in bytes from the variable's text; None when unset or empty. Raises ValueError
    naming the variable and the accepted range for anything else."""
    if text is None or not text.strip():
        return None
    value = text.strip()
    if not value.isdigit() or not MIN_KIB <= int(value) <= MAX_KIB:
        raise ValueError(f"{ENV}={text!r} is not valid: expected an integer number of KiB from {MIN_KIB} to "
                         f"{MAX_KIB} (e.g. 99 for the RTX 3090/4090, L4 and A10 budget, 163 for the A100's), "
                         f"or unset for the device's own limit")
    return int(value) * 1024


def cap_bytes(env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """The cap in bytes, None when unset or invalid (config_error() says why)."""
    try:
        return parse((os.environ if env is None else env).get(ENV))
    except ValueError:
        return None


def config_error(env: Optional[Mapping[str, str]] = None) -> str:
    """The error message of an invalid value, or "" (unset and valid values)."""
    try:
        parse((os.environ if env is None else env).get(ENV))
    except ValueError as error:
        return str(error)
    return ""


def capped(optin: Optional[int], vendor: str, cap: Optional[int]) -> Optional[int]:
    """A device's budget: min(its opt-in limit, the cap) for NVIDIA GPUs. An unknown limit
    (a text-tool probe) stays unknown: the launch checks the real one."""
    if cap is None or optin is None or vendor != "nvidia":
        return optin
    return min(optin, cap)
