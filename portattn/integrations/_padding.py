"""Padded batches <-> packed varlen tensors, for the framework integrations.

A padded batch is (batch, seqlen, ...) with a boolean (batch, seqlen) mask of the
real tokens; the packed form is (total, ...) with int32 `cu_seqlens` prefix sums,
the layout of `portattn.flash_attn_varlen_func`. Every step is differentiable in
the tensor being moved (index_select / index_copy), so training works through it.

These helpers overlap with the flash-attn-compatible `portattn/bert_padding.py`
planned elsewhere; once that lands, the two can be merged.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class Packing(NamedTuple):
    """Where the real tokens of a padded batch go in the packed layout."""

    indices: torch.Tensor      # (total,) int64 positions in the flattened (batch * seqlen) axis
    cu_seqlens: torch.Tensor   # (batch + 1,) int32 prefix sums of the per-row token counts
    max_seqlen: int            # longest row, a host int (the varlen API takes it as such)


def packing_from_mask(mask: torch.Tensor) -> Packing:
    """Packing of the True entries of a (batch, seqlen) mask, row by row, in order.

    Rows may be all False (a sequence of length 0). Reads the lengths on the host once
    (max_seqlen must be an int), the same synchronisation transformers' flash path has.
    """
    mask = mask.bool()
    lengths = mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    return Packing(indices, _prefix_sums(lengths), int(lengths.max().item()) if lengths.numel() else 0)


def packing_from_position_ids(position_ids: torch.Tensor) -> Packing | None:
    """Packing of sequences laid end to end in each row, or None when no row has a boundary.

    A new sequence starts at column 0 and wherever the position id does not grow by
    exactly one (the rule transformers' masks use for packed inputs:
    `masking_utils.find_packed_sequence_indices`). One host read decides whether there
    is anything to unpack at all.
    """
    batch, seqlen = position_ids.shape
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    if not bool(starts[:, 1:].any()):
        return None
    start_index = torch.nonzero(starts.flatten(), as_tuple=False).flatten()
    bounds = torch.cat([start_index, start_index.new_tensor([batch * seqlen])])
    lengths = bounds.diff()
    indices = torch.arange(batch * seqlen, device=position_ids.device)
    return Packing(indices, bounds.to(torch.int32), int(lengths.max().item()))


def packing_of_rows(batch: int, length: int, device) -> Packing:
    """Every row full: `batch` sequences of `length` tokens (e.g. one decode query each)."""
    cu_seqlens = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=device)
    return Packing(torch.arange(batch * length, device=device), cu_seqlens, length)


def pack(x: torch.Tensor, packing: Packing) -> torch.Tensor:
    """(batch, seqlen, ...) -> (total, ...): the tokens `packing` selects."""
    return x.reshape(-1, *x.shape[2:]).index_select(0, packing.indices)


def unpack(packed: torch.Tensor, packing: Packing, batch: int, seqlen: int) -> torch.Tensor:
    """(total, ...) -> (batch, seqlen, ...), zeros where nothing was packed from."""
    full = packed.new_zeros(batch * seqlen, *packed.shape[1:])
    return full.index_copy(0, packing.indices, packed).reshape(batch, seqlen, *packed.shape[1:])


def _prefix_sums(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
