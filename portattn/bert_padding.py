"""Padding helpers with flash-attn's `flash_attn.bert_padding` names and return tuples.

A padded batch (batch, seqlen, ...) with an attention mask becomes the packed rows a
varlen call takes, and back:

    rows, indices, cu_seqlens, max_seqlen, seqused = unpad_input(hidden, mask)
    out = flash_attn_varlen_func(q_rows, k_rows, v_rows, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    hidden = pad_input(out, indices, batch, seqlen)

`unpad_input` returns five values, as flash-attn does since 2.7 (the fifth, `seqused`,
counts the tokens of `attention_mask` alone when `unused_mask` adds allocated-but-unused
ones). Its `max_seqlen` is a host int, so it reads one value back (a device sync); call
it once per batch, outside anything you capture in a CUDA graph.
"""
from __future__ import annotations

import torch


def _require_tensor(name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """x[indices] along the first axis (differentiable; the gradient scatters back)."""
    _require_tensor("x", x)
    _require_tensor("indices", indices)
    return torch.index_select(x, 0, indices)


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """A zero tensor of first_axis_dim rows with `values` written at `indices` (differentiable)."""
    _require_tensor("values", values)
    _require_tensor("indices", indices)
    out = values.new_zeros((first_axis_dim, *values.shape[1:]))
    return out.index_copy(0, indices, values)


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask=None):
    """hidden_states (batch, seqlen, ...), attention_mask (batch, seqlen) bool/int, 1 = token.

    Returns (rows (total, ...), indices (total,) into the flattened batch, cu_seqlens
    int32 (batch + 1,), max_seqlen int, seqused int32 (batch,)). With unused_mask, rows
    marked there are kept too (counted in cu_seqlens, not in seqused)."""
    _require_tensor("hidden_states", hidden_states)
    _require_tensor("attention_mask", attention_mask)
    if attention_mask.shape != hidden_states.shape[:2]:
        raise ValueError(f"attention_mask must have shape (batch, seqlen) = {tuple(hidden_states.shape[:2])}, "
                         f"got {tuple(attention_mask.shape)}")
    kept = attention_mask.bool() if unused_mask is None else attention_mask.bool() | unused_mask.bool()
    seqlens = kept.sum(dim=-1, dtype=torch.int32)
    seqused = attention_mask.bool().sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    rows = index_first_axis(hidden_states.reshape(-1, *hidden_states.shape[2:]), indices)
    return rows, indices, cu_seqlens, max_seqlen, seqused


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Inverse of unpad_input: rows (total, ...) -> (batch, seqlen, ...), zeros at padding."""
    flat = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return flat.reshape(batch, seqlen, *hidden_states.shape[1:])
