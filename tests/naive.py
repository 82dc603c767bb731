"""The naive attention oracle shared by every test file: full score matrix, float64.

It follows the semantics of portattn/backends/common/params.h literally, with no
chunking or online softmax, so it is easy to check by eye; only for small tests.
Differentiable (torch autograd) so gradients can be compared too.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch


def visible_keys(seqlen_q: int, seqlen_k: int, window: Sequence[int], device=None) -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool: key j visible to query i under params.h's window rule."""
    i = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    j = torch.arange(seqlen_k, device=device)[None, :]
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    left, right = window
    if left >= 0:
        visible &= j >= i - left
    if right >= 0:
        visible &= j <= i + right
    return visible


def _attention_batched(q, k, v, window, softcap, alibi_slopes, dropout_mask, dropout_p, scale, sinks=None):
    """q: (B, Sq, H, D), k/v: (B, Sk, Hk, D), all in the compute dtype. sinks: (H,) logits
    that join every row's softmax denominator (a key with no value)."""
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    group = nheads // nheads_k
    if seqlen_k == 0:  # nothing to attend to (and amax below needs a non-empty row)
        lse = torch.full((batch, nheads, seqlen_q), float("-inf"), dtype=q.dtype, device=q.device)
        if sinks is not None:
            lse = sinks.to(q.dtype)[None, :, None].expand(batch, nheads, seqlen_q).clone()
        return q.new_zeros(batch, seqlen_q, nheads, v.shape[-1]), lse
    qh = q.transpose(1, 2)  # (B, H, Sq, D)
    kh = k.transpose(1, 2).repeat_interleave(group, dim=1)  # (B, H, Sk, D)
    vh = v.transpose(1, 2).repeat_interleave(group, dim=1)
    s = scale * torch.matmul(qh, kh.transpose(-1, -2))  # (B, H, Sq, Sk)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        i = torch.arange(seqlen_q, device=q.device)[:, None] + (seqlen_k - seqlen_q)
        j = torch.arange(seqlen_k, device=q.device)[None, :]
        slopes = alibi_slopes.to(s.dtype).reshape(-1, nheads, 1, 1)  # (H,) or (B, H)
        s = s - slopes * (i - j).abs().to(s.dtype)
    visible = visible_keys(seqlen_q, seqlen_k, window, q.device)
    s = s.masked_fill(~visible, float("-inf"))
    # The row max only stabilises exp(); detached, it does not change any gradient.
    m = s.amax(dim=-1, keepdim=True).detach()
    if sinks is not None:
        sink = sinks.to(s.dtype)[None, :, None, None]
        m = torch.maximum(m, sink.detach())
    m = torch.where(m == float("-inf"), 0.0, m)
    e = torch.exp(s - m)  # 0 at masked entries
    rowsum = e.sum(dim=-1, keepdim=True)
    if sinks is not None:
        rowsum = rowsum + torch.exp(sink - m)
    seen = rowsum > 0
    p = e / torch.where(seen, rowsum, 1.0)  # rows without a visible key stay all 0
    lse = torch.where(seen, m + torch.log(torch.where(seen, rowsum, 1.0)), float("-inf"))
    if dropout_mask is not None:
        p = p * dropout_mask.to(p.dtype) / (1.0 - dropout_p)
    out = torch.matmul(p, vh).transpose(1, 2)  # (B, Sq, H, D)
    return out, lse.squeeze(-1)


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    dropout_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    scale: Optional[float] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    compute_dtype: torch.dtype = torch.float64,
    sinks: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention with every portattn feature; returns (out, lse) in `compute_dtype`.

    Layouts: q (B, Sq, H, D), k/v (B, Sk, Hk, D), Hk dividing H (GQA); or, when
    cu_seqlens_q/k (int, nseq + 1 entries) are given, packed q (total_q, H, D) and k/v
    (total_k, Hk, D). Returns out shaped like q (head dim of v) and lse (B, H, Sq) or (H, total_q);
    packed rows outside every sequence get out 0 and lse -inf.

    causal: window_right = 0 (bottom-right aligned). window = (left, right), -1 unbounded.
    softcap: 0 = off. alibi_slopes: (H,) or (B, H) (varlen: B = nseq).
    dropout_mask: bool keep-mask (B, H, Sq, Sk); varlen: (nseq, H, max Sq, max Sk) with
    positions relative to each sequence's start. Kept entries are scaled by 1/(1-dropout_p).
    scale: defaults to 1/sqrt(headdim).
    compute_dtype: float64 for the oracle; a low-precision dtype gives "PyTorch's own
    low-precision computation", the baseline of the kernels' error rule.
    sinks: (H,) attention-sink logits (portattn/sinks.py); seqused_k: varlen only, sequence b
    uses its first seqused_k[b] keys.
    """
    left, right = window
    if causal:
        right = 0
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    q, k, v = (x.to(compute_dtype) for x in (q, k, v))
    options = dict(window=(left, right), softcap=softcap, dropout_p=dropout_p, scale=scale,
                   sinks=None if sinks is None else sinks.to(compute_dtype))
    if cu_seqlens_q is None:
        return _attention_batched(q, k, v, alibi_slopes=alibi_slopes, dropout_mask=dropout_mask,
                                  **options)
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=compute_dtype, device=q.device)
    if sinks is not None:  # rows outside every sequence see only the sink
        lse = sinks.to(compute_dtype)[:, None].expand(-1, q.shape[0]).clone()
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    used = None if seqused_k is None else [int(x) for x in seqused_k]
    outs, lses = [], []
    for b in range(len(starts_q) - 1):
        q0, q1, k0, k1 = starts_q[b], starts_q[b + 1], starts_k[b], starts_k[b + 1]
        if used is not None:
            k1 = k0 + used[b]
        slopes = alibi_slopes
        if alibi_slopes is not None and alibi_slopes.dim() == 2:
            slopes = alibi_slopes[b]
        mask = None if dropout_mask is None else dropout_mask[b : b + 1, :, : q1 - q0, : k1 - k0]
        o, l = _attention_batched(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                                  alibi_slopes=slopes, dropout_mask=mask, **options)
        outs.append((q0, q1, o[0]))
        lses.append((q0, q1, l[0]))
    # Assembled with index_put-free concatenation so autograd flows to every piece.
    out = _scatter_rows(out, outs, dim=0)
    lse = _scatter_rows(lse, lses, dim=1)
    return out, lse


def _scatter_rows(base: torch.Tensor, pieces, dim: int) -> torch.Tensor:
    """`base` with rows [start, end) along `dim` replaced by each piece, differentiably."""
    parts, cursor = [], 0
    for start, end, piece in sorted(pieces, key=lambda item: item[0]):
        parts.append(base.narrow(dim, cursor, start - cursor))
        parts.append(piece)
        cursor = end
    parts.append(base.narrow(dim, cursor, base.shape[dim] - cursor))
    return torch.cat(parts, dim=dim)
