"""Rotary position embedding with flash-attn's `flash_attn.layers.rotary.apply_rotary_emb`.

Token at position p, rotary frequency i, rotates the pair (a, b) of x by angle
theta = p * f_i given as cos/sin tables (seqlen_ro, rotary_dim / 2):

    a' = a cos - b sin,    b' = a sin + b cos

The pairs are (x[i], x[i + rotary_dim/2]) in the GPT-NeoX layout (interleaved=False)
and (x[2i], x[2i + 1]) in the GPT-J layout (interleaved=True); dims past rotary_dim pass
through. Position p of row s of sequence b is s + seqlen_offsets[b] (an int offsets every
sequence alike); with cu_seqlens, rows are packed and s counts from the sequence's start.
A position past the table (p >= seqlen_ro) is left unrotated, as flash-attn's kernel does.

Math runs in float32 and the result is cast back, like flash-attn's kernel. Everything
is torch ops on the tensors' device: no host read of seqlen_offsets or cu_seqlens, and
autograd gives the backward (the rotation by -theta).
"""
from __future__ import annotations

from typing import Optional, Union

import torch


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                     inplace: bool = False, seqlen_offsets: Union[int, torch.Tensor] = 0,
                     cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None) -> torch.Tensor:
    """x: (batch, seqlen, nheads, headdim), or (total, nheads, headdim) with cu_seqlens.
    cos, sin: (seqlen_ro, rotary_dim / 2). seqlen_offsets: int or (batch,) int tensor.
    max_seqlen is accepted for flash-attn compatibility (not needed). Returns x rotated
    (x itself, written in place, with inplace=True)."""
    half = _check(x, cos, sin, seqlen_offsets, cu_seqlens)
    positions = _positions(x, seqlen_offsets, cu_seqlens)  # (batch, seqlen) or (total,)
    valid = (positions >= 0) & (positions < cos.shape[0])
    index = torch.where(valid, positions, 0)
    # (..., 1, half): one angle per (token, frequency), broadcast over heads.
    c = torch.where(valid[..., None], cos.float()[index], 1.0).unsqueeze(-2)
    s = torch.where(valid[..., None], sin.float()[index], 0.0).unsqueeze(-2)
    rotary_dim = 2 * half
    part = x[..., :rotary_dim].float()
    if interleaved:
        a, b = part[..., 0::2], part[..., 1::2]
        rotated = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = part[..., :half], part[..., half:]
        rotated = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    rotated = rotated.to(x.dtype)
    if inplace:
        x[..., :rotary_dim].copy_(rotated)
        return x
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


# flash-attn's older name for the same function.
apply_rotary_emb_func = apply_rotary_emb


def _positions(x: torch.Tensor, seqlen_offsets, cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
    device = x.device
    if cu_seqlens is None:
        batch, seqlen = x.shape[:2]
        pos = torch.arange(seqlen, device=device).expand(batch, seqlen)
        if isinstance(seqlen_offsets, torch.Tensor):
            return pos + seqlen_offsets.to(device=device, dtype=torch.int64)[:, None]
        return pos + seqlen_offsets
    rows = torch.arange(x.shape[0], device=device)
    starts = cu_seqlens.to(device=device, dtype=torch.int64)
    # The sequence of each packed row: the last start <= row (device-side search).
    seq = torch.searchsorted(starts[1:], rows, right=True).clamp_(max=starts.numel() - 2)
    pos = rows - starts[seq]
    if isinstance(seqlen_offsets, torch.Tensor):
        return pos + seqlen_offsets.to(device=device, dtype=torch.int64)[seq]
    return pos + seqlen_offsets


def _check(x, cos, sin, seqlen_offsets, cu_seqlens) -> int:
    """Argument checks (metadata only); returns rotary_dim / 2."""
    for name, value in (("x", x), ("cos", cos), ("sin", sin)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    rank = 3 if cu_seqlens is not None else 4
    if x.dim() != rank:
        layout = "(total, nheads, headdim) with cu_seqlens" if rank == 3 else "(batch, seqlen, nheads, headdim)"
        raise ValueError(f"x must have shape {layout}, got {tuple(x.shape)}")
    if cos.dim() != 2 or cos.shape != sin.shape:
        raise ValueError(f"cos and sin must both have shape (seqlen_ro, rotary_dim / 2), got {tuple(cos.shape)} and {tuple(sin.shape)}")
    half = cos.shape[1]
    if not 1 <= 2 * half <= x.shape[-1]:
        raise ValueError(f"rotary_dim = 2 * cos.shape[1] = {2 * half} must be in [2, headdim = {x.shape[-1]}]")
    if cos.device != x.device or sin.device != x.device:
        raise ValueError(f"cos and sin must be on x's device {x.device}, got {cos.device} and {sin.device}")
    if isinstance(seqlen_offsets, torch.Tensor):
        batch = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else x.shape[0]
        if seqlen_offsets.shape != (batch,) or seqlen_offsets.dtype.is_floating_point:
            raise ValueError(f"seqlen_offsets must be an int or an integer tensor of shape ({batch},), "
                             f"got shape {tuple(seqlen_offsets.shape)} and dtype {seqlen_offsets.dtype}")
    elif isinstance(seqlen_offsets, bool) or not isinstance(seqlen_offsets, int):
        raise TypeError(f"seqlen_offsets must be an int or a (batch,) integer tensor, got {type(seqlen_offsets).__name__}")
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError("cu_seqlens must be a 1-D integer tensor with batch + 1 >= 2 entries")
    return half
