"""Safety never depends on a host check (issue 12 item 4): adversarial cu_seqlens_q/k and
seqused_k values, passed straight to the compiled modules' fwd / bwd (and the sm_90a
forward and backward where they run), never make a kernel read or write outside its tensors.

The host check (ops.run_forward's check_cu_seqlens_values) is bypassed on purpose: the
values reach the kernels as they do by default (no host check) or under CUDA-graph
capture. Each call must leave no CUDA error for the following torch.cuda.synchronize(),
leave the guard rows around every output untouched, and write only rows inside the
sequences as common/seq_bounds.h clamps them (mirrored by `clamped` below). The values
the kernels compute for invalid inputs are unspecified and not checked. Out-of-bounds
reads (which the guards cannot see) are compute-sanitizer memcheck's job:
tests/gpu/sanitize_cuda.py runs these cases (`adversarial_cases`).
"""
from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA/ROCm GPU", allow_module_level=True)

from portattn.backends.abi import fwd_args, workspace_shape  # noqa: E402

_INT_MIN, _INT_MAX = -(2**31), 2**31 - 1
BATCH, HEADS, HEADS_K, HEAD_DIM = 3, 4, 2, 64
TOTAL_Q, TOTAL_K, MAX_Q, MAX_K = 100, 120, 64, 80
GUARD = 16  # rows of sentinel before and after every output

# name -> (cu_seqlens_q, cu_seqlens_k, seqused_k); None: dense or not given.
CASES = {
    "decreasing": ([0, 50, 20, 100], [0, 90, 30, 120], None),
    "past_the_end": ([0, 30, 90, 400], [0, 60, 500, 1000], None),
    "negative": ([-50, 10, -3, 100], [-7, -1, 40, 120], None),
    "int_extremes": ([0, _INT_MAX, _INT_MIN, 5], [_INT_MIN, _INT_MAX, 0, _INT_MAX], None),
    "longer_than_max": ([0, 100, 100, 100], [0, 120, 120, 120], None),
    "seqused_k": ([0, 30, 60, 100], [0, 40, 80, 120], [-5, 1000, _INT_MAX]),
    "dense_seqused_k": (None, None, [-1, 10**6, 3]),
}


def adversarial_cases():
    return list(CASES)


def clamped(cu, total, max_len, b):
    """seq_bounds.h's rule for one packed sequence: (start, len)."""
    begin = min(max(cu[b], 0), total)
    end = min(max(cu[b + 1], begin), total)
    return begin, min(end - begin, max_len)


def _guarded(shape, dtype, fill):
    """A tensor of `shape` (rows first) inside a buffer with GUARD sentinel rows either side."""
    buffer = torch.full((shape[0] + 2 * GUARD, *shape[1:]), fill, dtype=dtype, device="cuda")
    return buffer, buffer[GUARD:GUARD + shape[0]]


def _guards_intact(buffer, fill):
    rows = torch.cat([buffer[:GUARD], buffer[-GUARD:]])
    return bool((rows.isnan() if math.isnan(fill) else rows == fill).all())


def _inputs(case):
    cu_q, cu_k, used = CASES[case]
    dtype = torch.bfloat16
    if cu_q is None:
        q = torch.randn(BATCH, MAX_Q, HEADS, HEAD_DIM, device="cuda", dtype=dtype)
        k, v = (torch.randn(BATCH, MAX_K, HEADS_K, HEAD_DIM, device="cuda", dtype=dtype) for _ in range(2))
        cu_q_t = cu_k_t = None
    else:
        q = torch.randn(TOTAL_Q, HEADS, HEAD_DIM, device="cuda", dtype=dtype)
        k, v = (torch.randn(TOTAL_K, HEADS_K, HEAD_DIM, device="cuda", dtype=dtype) for _ in range(2))
        cu_q_t = torch.tensor(cu_q, dtype=torch.int32, device="cuda")
        cu_k_t = torch.tensor(cu_k, dtype=torch.int32, device="cuda")
    used_t = None if used is None else torch.tensor(used, dtype=torch.int32, device="cuda")
    return q, k, v, cu_q_t, cu_k_t, used_t


def _args(q, k, v, out, lse, cu_q, cu_k, used, window):
    args = fwd_args(q, k, v, out, lse, cu_q, cu_k, MAX_Q, MAX_K, 1 / math.sqrt(HEAD_DIM), window[0],
                    window[1], 0.0, None, 0.0, 0, 0)
    return args._replace(seqused_k=0 if used is None else used.data_ptr())


def _written_rows(cu, total, max_len):
    """Rows of a packed tensor some clamped sequence covers (bool, length total)."""
    rows = torch.zeros(total, dtype=torch.bool)
    for b in range(len(cu) - 1):
        start, length = clamped(cu, total, max_len, b)
        rows[start:start + length] = True
    return rows


def run_case(module, case, window=(-1, -1), backward=True, entry="fwd", deterministic=False):
    """One forward (and backward) of `case` through `module`; returns the list of failures."""
    q, k, v, cu_q, cu_k, used = _inputs(case)
    varlen = cu_q is not None
    nan = float("nan")
    out_buffer, out = _guarded(q.shape, q.dtype, nan)
    if varlen:  # (H, total_q), each head's row with GUARD sentinels either side
        lse_buffer = torch.full((HEADS, TOTAL_Q + 2 * GUARD), nan, device="cuda")
        lse = lse_buffer[:, GUARD:GUARD + TOTAL_Q]
        lse_guards = [lse_buffer[:, :GUARD], lse_buffer[:, -GUARD:]]
    else:  # (B, H, Sq) inside a flat buffer
        lse_buffer, lse_flat = _guarded((BATCH * HEADS * MAX_Q,), torch.float32, nan)
        lse = lse_flat.view(BATCH, HEADS, MAX_Q)
        lse_guards = [lse_buffer[:GUARD], lse_buffer[-GUARD:]]
    args = _args(q, k, v, out, lse, cu_q, cu_k, used, window)
    getattr(module, entry)(*args)
    torch.cuda.synchronize()
    failures = []
    if not _guards_intact(out_buffer, nan) or not all(g.isnan().all() for g in lse_guards):
        failures.append("forward wrote outside out / lse")
    if varlen:
        outside = ~_written_rows(CASES[case][0], TOTAL_Q, MAX_Q).cuda()
        if not out[outside].isnan().all():
            failures.append("forward wrote rows outside every clamped sequence")
    if not backward:
        return failures
    grads = [_guarded(x.shape, x.dtype, nan) for x in (q, k, v)]
    dout = torch.randn_like(q)
    out_c = torch.nan_to_num(out)  # unwritten rows (outside every sequence) read as 0
    bwd_args = _args(q, k, v, out_c, lse, cu_q, cu_k, used, window)
    # The sm_90a forward's calls (varlen included) take the sm_90a backward, the rest `bwd`;
    # each sizes its own workspace.
    hopper = entry == "hopper_fwd"
    workspace_bytes = module.bwd_workspace_bytes(*workspace_shape(bwd_args), deterministic, ordered_dq=hopper)
    workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device="cuda")
    (dq, dk, dv) = (g[1] for g in grads)
    backward_entry = module.hopper_bwd if hopper else module.bwd
    backward_entry(dout.data_ptr(), dout.stride(), dq.data_ptr(), dq.stride(), dk.data_ptr(), dk.stride(),
               dv.data_ptr(), dv.stride(), workspace.data_ptr(), workspace_bytes, deterministic, *bwd_args)
    torch.cuda.synchronize()
    for name, (buffer, _) in zip(("dq", "dk", "dv"), grads):
        if not _guards_intact(buffer, nan):
            failures.append(f"backward wrote outside {name}")
    if varlen:
        outside_q = ~_written_rows(CASES[case][0], TOTAL_Q, MAX_Q).cuda()
        outside_k = ~_written_rows(CASES[case][1], TOTAL_K, MAX_K).cuda()
        if not dq[outside_q].isnan().all():
            failures.append("backward wrote dq rows outside every clamped sequence")
        if not (dk[outside_k].isnan().all() and dv[outside_k].isnan().all()):
            failures.append("backward wrote dk/dv rows outside every clamped sequence")
    return failures


def _modules():
    found = []
    if torch.version.hip is None:
        from portattn.backends import cuda

        if cuda._C is not None:
            found.append(pytest.param(cuda._C, "fwd", id="cuda"))
            if hasattr(cuda._C, "hopper_fwd") and torch.cuda.get_device_capability() == (9, 0):
                # Under a PORTATTN_MAX_SMEM_KIB cap below the device's own budget the sm_90a kernels
                # (sized for 227 KiB) refuse to launch, and dispatch never sends them a call.
                own = getattr(torch.cuda.get_device_properties(0), "shared_memory_per_block_optin", 0)
                capped = 0 < cuda._C.smem_cap() < own
                found.append(pytest.param(cuda._C, "hopper_fwd", id="cuda-sm90-fwd", marks=pytest.mark.skipif(
                    capped, reason="PORTATTN_MAX_SMEM_KIB caps shared memory below the sm_90a kernels' need")))
    else:
        from portattn.backends import rocm

        if rocm._C is not None:
            found.append(pytest.param(rocm._C, "fwd", id="rocm"))
    return found or [pytest.param(None, None, marks=pytest.mark.skip(reason="no compiled backend built"))]


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (10, 3)], ids=["full", "causal", "window"])
@pytest.mark.parametrize("case", adversarial_cases())
@pytest.mark.parametrize("module, entry", _modules())
def test_adversarial_bounds_stay_inside_the_tensors(module, entry, case, window, deterministic):
    if entry == "hopper_fwd" and CASES[case][2] is not None:
        pytest.skip("the sm_90a forward refuses seqused_k (hopper_host.h)")
    failures = run_case(module, case, window=window, backward=True, entry=entry, deterministic=deterministic)
    assert not failures, failures
