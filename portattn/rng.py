"""Philox seed/offset for dropout, drawn from torch's own generators.

The kernels' mask is a pure function of (seed, offset) (backends/common/philox.h),
so `torch.manual_seed` makes portattn's dropout reproducible, and the backward
pass regenerates the forward's mask from the two integers saved with it.

On CUDA devices this follows torch's own Philox bookkeeping: the seed is the
generator's seed and each call reserves a fresh offset by advancing the
generator, so portattn's dropout does not repeat torch's random streams. (Not
capturable in a CUDA graph, like any host-side offset read; recorded in README.)
"""
from __future__ import annotations

import torch

# Offsets advance in multiples of 4, as torch's Philox users do; one unit is
# enough for us since the counter also encodes (b, h, i, j).
_OFFSET_STEP = 4


def draw_philox_seed_offset(device: torch.device) -> tuple[int, int]:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        generator = torch.cuda.default_generators[index]
        offset = generator.get_offset()
        generator.set_offset(offset + _OFFSET_STEP)
        return generator.initial_seed(), offset
    # CPU (and other) devices: the default CPU generator is Mersenne Twister with
    # no offset API, so draw both numbers from it.
    drawn = torch.randint(0, 2**62, (2,), dtype=torch.int64)
    return int(drawn[0]), int(drawn[1])


def rng_state_tensor(seed: int, offset: int) -> torch.Tensor:
    """(seed, offset) as flash-attn's `rng_state`: int64 (2,). It stays on the host, so the
    backward reads it without a device sync (flash-attn keeps it on the GPU)."""
    return torch.tensor([seed, offset], dtype=torch.int64)


def seed_offset_from_state(rng_state: torch.Tensor) -> tuple[int, int]:
    seed, offset = rng_state.tolist()
    return int(seed), int(offset)
