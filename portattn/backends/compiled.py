"""What the two vendor backends share: a compiled module with abi.py's `fwd` / `bwd`.

The subclasses (cuda.CudaBackend, rocm.RocmBackend) say which module and which
support declaration; the calls themselves are the same for both vendors.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from .abi import DTYPE_CODES, append_args, decode_args, fwd_args, run_bwd
from .base import Backend


# torch.cuda.current_device() minus its lazy-init check (the module is loaded, so CUDA is up).
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def on_tensors_device(method):
    """Run a compiled call with its tensors' GPU current.

    The C entry points launch on the current device (cudaGetDevice / hipGetDevice) and
    read its properties there; the stream comes from the tensors' device. So a call on
    cuda:1 while cuda:0 is current switches device for its duration, as flash-attn's
    device guard does. The common case (already current) costs one cheap query.
    """

    @functools.wraps(method)
    def call(self, first, *args, **kwargs):
        index = first.device.index
        if index is None or index == _current_device():
            return method(self, first, *args, **kwargs)
        with torch.cuda.device(index):
            return method(self, first, *args, **kwargs)

    return call


def launch(index, entry, args) -> None:
    """entry(*args) with GPU `index` current: what `on_tensors_device` does for a whole method,
    for the one C call of `forward` / `backward` (the only part that reads the current device:
    the stream, the workspace and every pointer name their device explicitly). The hot paths use
    this instead of the decorator, whose *args/**kwargs re-packing of the keyword options cost
    ~1 us per forward and ~2 us per backward (CPU, bench/tools/host_overhead_cpu.py)."""
    if index is None or index == _current_device():
        entry(*args)
        return
    with torch.cuda.device(index):
        entry(*args)


class CompiledBackend(Backend):
    # The module's entry points this backend calls (CudaSm90Backend names the Hopper ones);
    # ordered_dq: the backward entry's workspace layout (abi.run_bwd).
    fwd_entry = "fwd"
    bwd_entry = "bwd"
    ordered_dq = False

    def __init__(self, module, unavailable_reason: str) -> None:
        self.module = module
        self.unavailable_reason = unavailable_reason
        self._build_config = module.build_config() if module is not None else None
        self._decode_tiles: dict = {}

    def build_config(self) -> Optional[dict]:
        return self._build_config

    def forward(self, q, k, v, out, lse, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p,
                rng_seed, rng_offset, rng_state=None, seqused_k=None, sm_margin=0) -> None:
        launch(q.device.index, getattr(self.module, self.fwd_entry),
               fwd_args(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                        window_left, window_right, softcap, alibi_slopes, dropout_p, rng_seed, rng_offset, rng_state,
                        seqused_k, sm_margin))

    def backward(self, dout, q, k, v, out, lse, dq, dk, dv, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                 max_seqlen_k, softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p,
                 rng_seed, rng_offset, deterministic, rng_state=None, seqused_k=None, sm_margin=0) -> None:
        run_bwd(self.module, dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                softmax_scale=softmax_scale, window_left=window_left, window_right=window_right, softcap=softcap,
                alibi_slopes=alibi_slopes, dropout_p=dropout_p, rng_seed=rng_seed, rng_offset=rng_offset,
                deterministic=deterministic, entry=getattr(self.module, self.bwd_entry), ordered_dq=self.ordered_dq,
                rng_state=rng_state, launch=launch, seqused_k=seqused_k, sm_margin=sm_margin)

    # ---- decode (portattn/decode.py is the caller) ----------------------------------
    def has_decode(self) -> bool:
        return self.module is not None and hasattr(self.module, "decode")

    def decode_tile(self, head_dim: int, device: Optional[torch.device] = None, fp8_kv: bool = False,
                    dtype: Optional[torch.dtype] = None, extras: bool = False, path: int = 0) -> dict:
        """{"stage_keys", "threads", "smem_bytes"} of the decode kernel serving head_dim on `device`
        (asked with it current: the ROCm module's CDNA and RDNA tiles differ); the e4m3-cache
        kernel's with fp8_kv (only the CUDA module has one). Where the module answers
        `decode_occupancy` (CUDA), the facts are those of the kernel a call of q's `dtype` with
        softcap/ALiBi (`extras`) launches on `device` under FP8 path `path` (decode_path_id), with
        "registers" and "ctas_per_sm" (the occupancy calculator's) added; cached per key."""
        key = (device.index if device is not None else None, head_dim, fp8_kv, dtype, extras, path)
        tile = self._decode_tiles.get(key)
        if tile is None:
            occupancy = getattr(self.module, "decode_occupancy", None)
            if occupancy is not None and dtype in DTYPE_CODES:
                args = (head_dim, DTYPE_CODES[dtype], 1 if fp8_kv else 0, extras)
            else:
                occupancy = self.module.decode_tile
                args = (head_dim, 1) if fp8_kv else (head_dim,)
            if device is not None and device.type == "cuda":
                with torch.cuda.device(device):
                    tile = dict(occupancy(*args))
            else:
                tile = dict(occupancy(*args))
            self._decode_tiles[key] = tile
        return tile

    def decode_path_id(self) -> int:
        """The FP8 decode path in effect (0 smem, 1 regs, 2 regs_deep: the CUDA module's
        PORTATTN_DECODE_FP8_PATH); 0 for a module with one FP8 path or none. Part of the plan key."""
        path_id = getattr(self.module, "decode_fp8_path_id", None)
        return path_id() if path_id is not None else 0

    def decode(self, q, k, v, out, lse, *options) -> None:
        """One decode launch; `options` are abi.decode_args' after lse, by position (decode.run_decode)."""
        # launch() rather than @on_tensors_device: the decorator's re-packing of the options is
        # paid on every decode step (bench/host_overhead_cpu.py measured ~1 us on the forward).
        # q.get_device(): the index as an int without building a torch.device (CPU tensors, -1,
        # never get here).
        launch(q.get_device(), self.module.decode, decode_args(q, k, v, out, lse, *options))

    @on_tensors_device
    def kvcache_append(self, k_cache, v_cache, k_new, v_new, q, q_out, **options) -> None:
        self.module.kvcache_append(*append_args(k_cache, v_cache, k_new, v_new, q, q_out, **options))
