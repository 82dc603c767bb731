"""Out-of-range per-sequence metadata read on the device: contained, recorded, reported on request.

Decision (docs/decode.md): a sequence of a flash_attn_with_kvcache call (or a paged
varlen call) whose cache_seqlens, cache_leftpad, cache_batch_idx or block_table entries
point outside the cache is *contained*, not clamped into another sequence's rows: none of
its keys is read, its output rows are 0 and its LSE is -inf, and nothing is written outside
its own valid rows (the append writes a new row only where that row's own cache_seqlens,
cache_batch_idx and page are valid; the reference path then appends nothing at all)
(the documented result of a row that sees no key; zeros rather than NaN so that a batch
keeps finite values and the other sequences' results stay usable). The device cannot raise
without a host read (a sync per call, and a CUDA-graph capture breaker) and a device assert
would kill the context a server shares, so the kernels record the first offending batch
entry per argument in a small int32 buffer owned by portattn per device; `check_errors()`
reads it (one sync), clears it and raises a ValueError naming the argument and the entry.

Tensors on the CPU are checked on the host before anything is written (a ValueError at
once): there the check costs no device synchronisation.

Buffer layout (int32, ERROR_SLOTS entries): for argument a (ARGUMENTS[a]), entry 2a holds
the first offending batch entry + 1 (0: none) and entry 2a + 1 the value it held. The
kernels write it with one compare-and-swap per offending CTA (PortattnDecodeParams.errors).
"""
from __future__ import annotations

import threading

import torch

# The argument codes the kernels write (PORTATTN_ERR_* in backends/common/params.h).
ARGUMENTS = ("cache_seqlens", "cache_leftpad", "cache_batch_idx", "block_table")
ERROR_SLOTS = 2 * len(ARGUMENTS)
ACCEPTED = {
    "cache_seqlens": "[0, cache capacity - seqlen_new]",
    "cache_leftpad": "[0, cache_seqlens + seqlen_new]",
    "cache_batch_idx": "[0, k_cache.shape[0] - 1]",
    "block_table": "[0, num_pages - 1] for every page the sequence reads or writes",
}

_BUFFERS: dict = {}  # (device type, index) -> buffer
# The same buffers by torch.device (those naming their index): every decode call asks, and the
# (type, index) key cost ~2 us a call to build on the CI machine's CPU.
_BY_DEVICE: dict = {}
_LOCK = threading.Lock()


def error_buffer(device: torch.device) -> torch.Tensor:
    """The device's error buffer (allocated, zeroed, on the first call that needs it).

    Allocated outside any CUDA-graph capture in practice: the first decode call on a device
    (the warm-up every capture needs) creates it; later calls only look it up."""
    buffer = _BY_DEVICE.get(device)  # a decode call's path: one hash of the device object
    if buffer is not None:
        return buffer
    index = device.index
    resolved = index is not None or device.type != "cuda"  # a bare "cuda" means the current GPU
    key = (device.type, index if resolved else torch.cuda.current_device())
    buffer = _BUFFERS.get(key)
    if buffer is None:
        with _LOCK:
            buffer = _BUFFERS.get(key)
            if buffer is None:
                buffer = _BUFFERS[key] = torch.zeros(ERROR_SLOTS, dtype=torch.int32, device=device)
    if resolved:
        _BY_DEVICE[device] = buffer
    return buffer


def record(device: torch.device, argument: str, entry: int, value: int) -> None:
    """Record a host-detected offending entry (the reference backend on a GPU) without a
    host read of the buffer: the first recorded entry per argument is kept."""
    buffer = error_buffer(device)
    a = 2 * ARGUMENTS.index(argument)
    new = torch.tensor([entry + 1, max(min(value, 2**31 - 1), -(2**31))], dtype=torch.int32, device=device)
    slot = buffer[a:a + 2]
    slot.copy_(torch.where(slot[0] == 0, new, slot))


def describe(argument: str, entry: int, value) -> str:
    return (f"{argument}[{entry}] = {value} is out of range (accepted: {ACCEPTED[argument]}); "
            f"that sequence's output rows were set to 0 and nothing was written outside its own rows")


def check_errors(device=None) -> None:
    """Raise ValueError if a kernel contained an out-of-range cache_seqlens, cache_leftpad,
    cache_batch_idx or block_table entry since the last check (on `device`, or on every
    device portattn has used). One device synchronisation per device checked; the record
    is cleared. The message names the argument, the batch entry and its value (the first
    offending entry per argument)."""
    with _LOCK:
        items = list(_BUFFERS.items())
    if device is not None:
        device = torch.device(device)
        index = device.index if device.index is not None or device.type != "cuda" else torch.cuda.current_device()
        items = [(key, buf) for key, buf in items if key == (device.type, index)]
    problems = []
    for (dtype, index), buffer in items:
        values = buffer.tolist()
        if any(values):
            buffer.zero_()
        for a, argument in enumerate(ARGUMENTS):
            if values[2 * a]:
                where = f"{dtype}:{index}" if index is not None else dtype
                problems.append(f"{describe(argument, values[2 * a] - 1, values[2 * a + 1])} (on {where})")
    if problems:
        raise ValueError("portattn: " + "; ".join(problems))
