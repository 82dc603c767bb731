"""Attention sinks (`s_aux`): a learned per-head logit that joins every softmax denominator.

    p_ij = exp(s_ij) / (exp(s_aux[h]) + sum_j exp(s_ij))

(gpt-oss; vLLM's `s_aux`). A sink is a key with a score and no value, so attention with a
sink is the attention without it merged with an empty block of log-sum-exp s_aux[h]:

    lse' = log(exp(lse) + exp(s_aux[h])),  out' = exp(lse - lse') * out

Every backend therefore serves sinks: its kernels run unchanged and `add_sink` folds the sink
into their (out, lse) in one elementwise pass over out. The backward needs no kernel change
either: given out' and lse', the kernels' P_ij = exp(s_ij - lse') are the sink-aware
probabilities and rowsum(dO * out') is the sink-aware softmax correction, so dQ, dK and dV
come out right; the sink's own gradient is

    d s_aux[h] = -sum over rows of exp(s_aux[h] - lse') * rowsum(dO * out')

(`sink_grad`). A row that sees no key gets out = 0 and lse = s_aux[h].
"""
from __future__ import annotations

import torch


def check_s_aux(s_aux, nheads: int, device: torch.device):
    if s_aux is None:
        return None
    if not isinstance(s_aux, torch.Tensor):
        raise TypeError(f"s_aux must be a torch.Tensor of shape ({nheads},), got {type(s_aux).__name__}")
    if s_aux.shape != (nheads,):
        raise ValueError(f"s_aux must have shape (nheads,) = ({nheads},), got {tuple(s_aux.shape)}")
    if not s_aux.is_floating_point():
        raise TypeError(f"s_aux must be a floating-point tensor, got {s_aux.dtype}")
    if s_aux.device != device:
        raise ValueError(f"s_aux must be on {device}, got {s_aux.device}")
    return s_aux


def _per_row(values: torch.Tensor, lse: torch.Tensor, varlen: bool) -> torch.Tensor:
    # (nheads,) broadcast against lse: (nheads, total_q) varlen, else (batch, nheads, seqlen_q).
    values = values.to(lse.dtype)
    return values[:, None] if varlen else values[None, :, None]


def _out_layout(x: torch.Tensor, varlen: bool) -> torch.Tensor:
    # An lse-shaped tensor seen in out's layout, (total_q, nheads, 1) or (batch, seqlen_q, nheads, 1).
    return x.t()[..., None] if varlen else x.transpose(1, 2)[..., None]


def add_sink(out: torch.Tensor, lse: torch.Tensor, s_aux: torch.Tensor, varlen: bool) -> None:
    """Fold the sinks into a finished (out, lse), in place."""
    merged = torch.logaddexp(lse, _per_row(s_aux, lse, varlen))
    weight = torch.exp(lse - merged)  # exp(-inf) = 0 for a row over no keys
    # In fp32 (or the inputs' float64), rounded once into out.
    out.copy_(out * _out_layout(weight, varlen))
    lse.copy_(merged)


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, s_aux: torch.Tensor,
              varlen: bool) -> torch.Tensor:
    """d s_aux from the sink-aware out and lse (see the module docstring)."""
    dtype = torch.float64 if out.dtype == torch.float64 else torch.float32
    delta = (dout.to(dtype) * out.to(dtype)).sum(-1)  # (total_q, H) or (B, Sq, H)
    p_sink = torch.exp(_per_row(s_aux, lse, varlen).to(dtype) - lse.to(dtype))
    p_sink = p_sink.t() if varlen else p_sink.transpose(1, 2)
    rows = tuple(range(delta.dim() - 1))
    return (-(p_sink * delta).sum(dim=rows)).to(s_aux.dtype)
