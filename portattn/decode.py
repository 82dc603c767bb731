"""Decode: few query rows against many keys, on a compiled backend's split-KV kernels.

Note [portattn decode] (backends/common/params.h) describes the kernels. This module
decides the two things the host must: whether a dense or varlen call is decode-shaped
(`prefers_decode`), and how many CTAs share one sequence's keys (`choose_num_splits`).
Both read only static shapes and device properties, never a tensor's values, so a decode
step captured in a CUDA graph replays the same launch whatever `cache_seqlens`,
`block_table` or the new tokens hold: the kernels read those on the device and give each
split an equal share of the actual keys.
"""
from __future__ import annotations

import math
import threading
from typing import Optional

import torch

from .validation import seq_first

# The combine kernel keeps one weight per split in shared memory (csrc/decode_entry.cu).
MAX_SPLITS = 128
# A split shorter than this spends more on its prologue, its partial write and the
# combine than it saves (FA2/FA3 and FlashInfer settle on 128-256 keys).
MIN_KEYS_PER_SPLIT = 256
# Splitting a grid that already has a CTA on most SMs only adds the combine: a decode CTA is
# memory-bound, and one per SM already streams near the bandwidth bound. H100, hd 128, 16/4
# heads, batch 32 (128 CTAs, two resident per SM): 2 splits against 1, 30.7 / 27.9 us at 1k
# keys, 183 / 178 us at 8k (graph replay; docs/decode.md, "The split planner").
FULL_GRID_FRACTION = 0.8
# ... only for kernels of at least this many threads: a 2-warp CTA (head dims over 128) alone
# streams far below the bound. H200, hd 256, 32/8 heads, batch 16 (128 CTAs): one split ran at
# 0.38 of the bound and 0.50-0.55x SDPA (297 / 164 us at 4k keys, 2332 / 1178 at 32k), where
# the same grid planned by resident slots (2 splits) ran at 0.97-1.00x SDPA on an H100
# (bench/results/latest/decode_bench.md has the current table).
FULL_GRID_MIN_THREADS = 128
# Among split counts whose last wave is this close to the best, take the smallest.
WAVE_EFFICIENCY_SLACK = 0.85
# An eager call (no CUDA-graph capture) of at most this many keys per sequence is host-bound:
# the unsplit kernel (16 us at 1k keys, 27 us at 2k on an H100, hd 128) ends before the host has
# issued the next call (23-31 us per decode-shaped call), so a split would save no wall time and
# adds a launch and an allocation that every call pays on the host (31 -> 23 us per call).
# Captured calls replay without host cost and keep their splits (10 against 16 us at 1k keys).
EAGER_UNSPLIT_MAX_KEYS = 2048

# Dense/varlen calls go to the decode kernels when their packed query rows (queries x
# heads per KV head) fill at most this many 16-row tiles and the keys are many: the
# forward kernels give one CTA to each (head, 128 queries) and never split the keys.
DECODE_MAX_PACKED_ROWS = 64
DECODE_MIN_KEYS = 512
DECODE_MIN_KEYS_PER_QUERY = 8


def prefers_decode(seqlen_q: int, group: int, seqlen_k: int) -> bool:
    """Whether a call of this shape is decode-shaped (few query rows, many keys)."""
    return (0 < seqlen_q * group <= DECODE_MAX_PACKED_ROWS and seqlen_k >= DECODE_MIN_KEYS
            and seqlen_k >= DECODE_MIN_KEYS_PER_QUERY * seqlen_q)


def choose_num_splits(base_ctas: int, key_stages: int, slots: int, stages_per_split_min: int,
                      requested: int = 0, sms: int = 0) -> int:
    """Split count for a grid of `base_ctas` CTAs whose longest key range has `key_stages`
    stages, on a device with `sms` SMs (0: as many as `slots`) and `slots` resident CTAs.
    `requested` > 0 is honoured (capped at MAX_SPLITS and the stage count: a split beyond the
    last stage would have no keys).

    Without a request: one split when the grid already has a CTA on most SMs; otherwise the
    smallest count whose last wave is within WAVE_EFFICIENCY_SLACK of the best wave
    efficiency (FA2's rule, with resident slots rather than SMs as the unit).
    """
    most = max(1, min(MAX_SPLITS, key_stages))
    if requested > 0:
        return min(requested, most)
    if base_ctas <= 0 or base_ctas >= FULL_GRID_FRACTION * (sms or slots):
        return 1
    most = max(1, min(most, key_stages // max(1, stages_per_split_min)))

    def efficiency(splits: int) -> float:
        waves = base_ctas * splits / slots
        return waves / math.ceil(waves)

    best = max(efficiency(s) for s in range(1, most + 1))
    return next(s for s in range(1, most + 1) if efficiency(s) >= WAVE_EFFICIENCY_SLACK * best)


_FP8 = getattr(torch, "float8_e4m3fn", None)
_SLOTS: dict = {}
# Whether the current stream is capturing a CUDA graph (torch.cuda.is_current_stream_capturing
# minus its Python wrapper; HIP builds answer for HIP graphs).
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
# Split counts per call shape: the planner runs once per shape, not per decode step. The key
# length enters as a bucket (`key_bucket`), so a dynamic cache growing by one key per step
# adds an entry per bucket, not per step; the table is bounded all the same (past _MAX_PLANS
# shapes the oldest plan is dropped; a re-plan costs a few microseconds). Reads are lock-free
# dict lookups; inserts take _PLANS_LOCK.
_PLANS: dict = {}
_MAX_PLANS = 4096
_PLANS_LOCK = threading.Lock()


def forget_plans() -> None:
    """Drops every split plan. A plan depends on the kernel's occupancy, which the shared-memory
    cap decides (PORTATTN_MAX_SMEM_KIB, read once per process); whoever changes the cap in-process
    (`_C.set_smem_cap`, tests and tuning only) calls this so the next calls plan again."""
    with _PLANS_LOCK:
        _PLANS.clear()


def _remember_plan(key, splits: int) -> int:
    with _PLANS_LOCK:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.pop(next(iter(_PLANS)), None)  # insertion order: the oldest
        _PLANS[key] = splits
    return splits


def key_bucket(keys: int) -> int:
    """keys rounded up to a multiple of a quarter of its power of two (at least 64): at most
    4 buckets per doubling, at most 25% (or 63 keys) over. Planning for a few more keys than there are only leaves
    the last split shorter: each split takes an equal share of the actual keys on the device."""
    # 1 << (bit_length - 3) is at most 64 below 512 keys: one comparison instead of two max().
    step = 1 << (keys.bit_length() - 3) if keys >= 512 else 64
    return -(-keys // step) * step


def resident_slots(device: torch.device, tile: dict) -> tuple:
    """(SMs, CTAs of the decode kernel that fit on the device at once: SMs x CTAs per SM).

    CTAs per SM are the tile's "ctas_per_sm" where the backend measured them (the CUDA module's
    occupancy query: shared memory and registers of the kernel the call launches, e.g. two for
    the FP8 regs path's 48 KiB at hd 128 with softcap's 210 registers, three without); otherwise
    (ROCm, a failed query) counted from shared memory and threads alone."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    measured = tile.get("ctas_per_sm", -1)
    key = (index, tile["smem_bytes"], tile["threads"], measured)
    slots = _SLOTS.get(key)
    if slots is None:
        props = torch.cuda.get_device_properties(index)
        if measured > 0:
            per_sm = measured
        else:
            smem_per_sm = getattr(props, "shared_memory_per_multiprocessor", 0) or 100 * 1024
            threads_per_sm = getattr(props, "max_threads_per_multi_processor", 0) or 2048
            # 1 KiB per block is reserved by the hardware on sm80+.
            per_sm = min(smem_per_sm // (tile["smem_bytes"] + 1024), threads_per_sm // tile["threads"])
        sms = props.multi_processor_count
        slots = _SLOTS[key] = (sms, sms * max(1, per_sm))
    return slots


def empty_seq_first(q: torch.Tensor) -> torch.Tensor:
    """torch.empty_like(q.transpose(1, 2)) of a 4-D (batch, heads, seq, dim) q: the output a
    heads-first call returns, the same shape and strides as the seq-first call's
    `torch.empty_like(q)`. A contiguous q is non-overlapping and dense, and so is its transpose,
    whose strides empty_like then keeps: they are allocated directly (no view made). Any other q
    takes the transpose (empty_like's dense-stride inference for it is torch's own)."""
    if q.is_contiguous():
        return q.new_empty_strided(seq_first(q.shape), seq_first(q.stride()))
    return torch.empty_like(q.transpose(1, 2))


def run_decode(backend, q, k, v, need_lse: bool, softmax_scale: float, window_left: int,
               window_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
               num_splits: int = 0, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q: int = 0,
               max_seqlen_k: int = 0, cache_seqlens=None, seqlen_new: int = 0, cache_leftpad=None,
               cache_batch_idx=None, block_table=None, out=None, lse=None, errors=None,
               k_descale=None, v_descale=None, sm_margin=0, heads_first=False):
    """One decode call on `backend` (a compiled backend with decode kernels): (out, lse).

    lse is (batch, nheads, seqlen_q), or (nheads, total_q) with cu_seqlens_q, or None
    when not `need_lse`. Allocations (out, lse, the split workspace) come from torch's
    caching allocator, which CUDA-graph capture redirects to the graph's pool; `out` and
    `lse` may be passed in already allocated. `errors`: the device's error buffer
    (portattn/errors.py) where the kernels record out-of-range cache metadata, or None.
    k and v may be float8_e4m3fn caches with fp32 (batch, nheads_k) descales or None (1.0).
    sm_margin: SMs to leave free for other kernels (validated), taken off the SMs the split
    count is planned for, as FlashAttention-3 does: the decode grid is not persistent (the
    hardware hands its CTAs to whichever SMs are free), but a grid planned to fill every SM in
    one wave would need a second, mostly empty wave while another kernel holds some of them.

    A decode step of generation runs this once per layer, so the arguments are positional
    all the way to the C call (ops.run_forward passes them so): keyword passing through the
    layers down to abi.decode_args cost ~8 us of a 35 us `flash_attn_func` decode call on an
    H200's host (docs/host-overhead.md; bench/results/latest/overhead.md has the totals).

    heads_first: q, k and v are 4-D (batch, heads, seq, dim) views (k and v a dense cache: no
    cu_seqlens, no block table) of the tensors described above; the launch gets the same pointers
    with the strides of dims 1 and 2 swapped (abi.decode_args), and `out` (given or allocated)
    is (batch, seqlen_q, nheads, head_dim) as always (`empty_seq_first`)."""
    if cu_seqlens_q is not None:
        batch, seqlen_q = cu_seqlens_q.shape[0] - 1, max_seqlen_q
        _, nheads, head_dim = q.shape
        lse_shape = (nheads, q.shape[0])
    elif heads_first:
        batch, nheads, seqlen_q, head_dim = q.shape
        lse_shape = (batch, nheads, seqlen_q)
    else:
        batch, seqlen_q, nheads, head_dim = q.shape
        lse_shape = (batch, nheads, seqlen_q)
    k_shape = k.shape
    if heads_first:
        k_shape = seq_first(k_shape)
    nheads_k = k_shape[-2]
    if out is None:
        out = empty_seq_first(q) if heads_first else torch.empty_like(q)
    if lse is None and need_lse:
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if block_table is not None:
        key_capacity = block_table.shape[1] * k_shape[1]
    elif cu_seqlens_k is not None:
        key_capacity = max_seqlen_k
    else:
        key_capacity = k_shape[1]
    fp8_kv = k.dtype is _FP8
    keys = key_bucket(key_capacity)
    # Short eager calls run unsplit (EAGER_UNSPLIT_MAX_KEYS); only they query the capture state.
    eager_short = num_splits == 0 and keys <= EAGER_UNSPLIT_MAX_KEYS and _capturing is not None and not _capturing()
    # The kernel differs by the FP8 path (its tile and occupancy: the path can change in-process),
    # by softcap/ALiBi (registers) and by q's dtype: each its own plan.
    extras = softcap > 0.0 or alibi_slopes is not None
    path = backend.decode_path_id() if fp8_kv else 0
    # q.get_device(): the GPU's index as an int, without building a torch.device.
    plan_key = (q.get_device(), head_dim, batch, nheads, nheads_k, seqlen_q, keys, num_splits, fp8_kv, eager_short,
                sm_margin, q.dtype, extras, path)
    splits = _PLANS.get(plan_key)
    if splits is None:
        device = q.device
        tile = backend.decode_tile(head_dim, device, fp8_kv, q.dtype, extras, path)
        m_tiles = -(-seqlen_q * (nheads // nheads_k) // 16)
        sms, slots = resident_slots(device, tile)
        if sm_margin:
            free = max(1, sms - sm_margin)
            sms, slots = free, slots // sms * free
        splits = _remember_plan(plan_key, 1 if eager_short else choose_num_splits(
            batch * nheads_k * m_tiles, -(-keys // tile["stage_keys"]), slots,
            MIN_KEYS_PER_SPLIT // tile["stage_keys"], num_splits,
            sms if tile["threads"] >= FULL_GRID_MIN_THREADS else 0,
        ))
    o_partial = lse_partial = 0
    if splits > 1:
        # One allocation for both: (splits, batch, nheads, seqlen_q, head_dim) partial outputs,
        # then (splits, batch, nheads, seqlen_q) partial LSEs (16-byte aligned: head_dim % 8 == 0).
        rows = splits * batch * nheads * seqlen_q
        workspace = torch.empty(rows * (head_dim + 1), dtype=torch.float32, device=q.device)
        o_partial = workspace.data_ptr()
        lse_partial = o_partial + rows * head_dim * 4
    backend.decode(
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, cache_seqlens, seqlen_new,
        cache_leftpad, cache_batch_idx, block_table, softmax_scale, window_left, window_right, softcap,
        alibi_slopes, splits, o_partial, lse_partial, errors, k_descale, v_descale, heads_first,
    )
    return out, lse
