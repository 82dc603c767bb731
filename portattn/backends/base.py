"""The interface every backend implements; dispatch (portattn/dispatch.py) is its only caller.

A backend never re-validates user input: portattn/validation.py has already
checked dtypes, shapes, strides, ranges and devices, and dispatch has already
asked `unsupported_reasons` whether this backend serves the call.

Tensor contract for `forward` / `backward` (see also backends/common/params.h):
- q: (B, Sq, H, D) or, varlen, (total_q, H, D); k, v: (B, Sk, Hk, D) / (total_k, Hk, D).
  Any strides with the last dimension contiguous. Hk divides H.
- out: like q (caller-allocated, maybe poisoned; every element must be written).
- lse: float32 (B, H, Sq) or, varlen, (H, total_q); caller-allocated, contiguous;
  or None in `forward` when the caller does not need it (inference calls skip the allocation).
- window_left / window_right: -1 = unbounded; causal is window_right == 0.
- softcap: 0.0 = off. alibi_slopes: None or float32 (H,) / (B, H).
- dropout_p: 0.0 = off; (rng_seed, rng_offset) select the philox.h mask, or, when the
  keyword rng_state (a device int64 [seed, offset]) is given, that pair does: it is drawn
  on the device under CUDA-graph capture (portattn/rng.py) and read by the kernels.
- backward writes dq, dk, dv (caller-allocated, shapes of q, k, v). For GQA, dk and
  dv are the gradients of the un-expanded k and v (summed over each group).
- sm_margin: SMs a persistent grid leaves free for other kernels (common/params.h); a
  tuning hint for the launch, never a change of any result. Backends without such grids
  accept and ignore it.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..capability.callspec import CallSpec


class Backend:
    """Base class: a name, a support declaration and two kernels."""

    name: str = "?"

    def unsupported_reasons(self, call: CallSpec) -> list[str]:
        """Every reason this backend cannot run `call` on the current device; [] = supported."""
        raise NotImplementedError

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        *,
        cu_seqlens_q: Optional[torch.Tensor],
        cu_seqlens_k: Optional[torch.Tensor],
        max_seqlen_q: int,
        max_seqlen_k: int,
        softmax_scale: float,
        window_left: int,
        window_right: int,
        softcap: float,
        alibi_slopes: Optional[torch.Tensor],
        dropout_p: float,
        rng_seed: int,
        rng_offset: int,
        rng_state: Optional[torch.Tensor] = None,
        seqused_k: Optional[torch.Tensor] = None,
        sm_margin: int = 0,
    ) -> None:
        raise NotImplementedError

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        dq: torch.Tensor,
        dk: torch.Tensor,
        dv: torch.Tensor,
        *,
        cu_seqlens_q: Optional[torch.Tensor],
        cu_seqlens_k: Optional[torch.Tensor],
        max_seqlen_q: int,
        max_seqlen_k: int,
        softmax_scale: float,
        window_left: int,
        window_right: int,
        softcap: float,
        alibi_slopes: Optional[torch.Tensor],
        dropout_p: float,
        rng_seed: int,
        rng_offset: int,
        deterministic: bool,
        rng_state: Optional[torch.Tensor] = None,
        seqused_k: Optional[torch.Tensor] = None,
        sm_margin: int = 0,
    ) -> None:
        raise NotImplementedError
