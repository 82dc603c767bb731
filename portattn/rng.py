"""Philox seed/offset for dropout, drawn from torch's own generators.

The kernels' mask is a pure function of (seed, offset) (backends/common/philox.h),
so `torch.manual_seed` makes portattn's dropout reproducible, and the backward
pass regenerates the forward's mask from the two integers saved with it.

On CUDA devices this follows torch's own Philox bookkeeping: the seed is the
generator's seed and each call reserves a fresh offset by advancing the
generator, so portattn's dropout does not repeat torch's random streams.

Under CUDA-graph capture a host integer would be frozen into the graph: every replay
would draw the same mask. There the pair is drawn on the device by torch's own RNG
(`torch.randint`, which graphs replay with a fresh offset each time) and the kernels
read it from device memory (params.h philox_state), so each replay gets a fresh mask,
reproducible from `torch.manual_seed`, and the backward reads the same pair.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

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


class PhiloxDraw(NamedTuple):
    """The dropout mask's key: two host integers, or (under CUDA-graph capture) a device
    int64 pair [seed, offset] that the kernels read instead."""

    seed: int = 0
    offset: int = 0
    state: Optional[torch.Tensor] = None


NO_DROPOUT = PhiloxDraw()


def draw_philox(device: torch.device) -> PhiloxDraw:
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return PhiloxDraw(state=torch.randint(0, 2**62, (2,), dtype=torch.int64, device=device))
    return PhiloxDraw(*draw_philox_seed_offset(device))


def rng_state_tensor(draw: PhiloxDraw) -> torch.Tensor:
    """The draw as flash-attn's `rng_state`: int64 (2,). Host integers stay on the host, so
    the backward reads them without a device sync; a pair drawn on the device stays there."""
    if draw.state is not None:
        return draw.state
    return torch.tensor([draw.seed, draw.offset], dtype=torch.int64)


def draw_from_state(rng_state: torch.Tensor) -> PhiloxDraw:
    if rng_state.device.type != "cpu":
        return PhiloxDraw(state=rng_state)
    seed, offset = rng_state.tolist()
    return PhiloxDraw(int(seed), int(offset))
