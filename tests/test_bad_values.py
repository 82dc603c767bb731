"""Issue 39: appends land in the caller's cache whatever its layout, bad per-sequence values
raise a ValueError naming the argument and entry on the CPU (before anything is written),
and the smaller defects (empty inputs, dtypes, numpy scalars, NaN rows, gradients, the
report with a bad PORTATTN_BACKEND, cu_seqlens values on the CPU)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import portattn
from error_rule import assert_lse, assert_output
from naive import naive_attention
from portattn import decode, dispatch, errors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def oracle(q, keys, values, **options):
    """(float64 out, float64 lse, same-dtype out, float32 lse) of one sequence."""
    ref, ref_lse = naive_attention(q, keys, values, compute_dtype=torch.float64, **options)
    low, low_lse = naive_attention(q, keys, values, compute_dtype=q.dtype, **options)
    f32, f32_lse = naive_attention(q, keys, values, compute_dtype=torch.float32, **options)
    return ref, ref_lse, low, f32_lse


# ---- appends land in the caller's tensors, every layout -----------------------------------


def _layout(layout, batch, capacity, heads_k, dim, dtype):
    """(k_cache, v_cache, extra kwargs, logical(b) -> (k rows, v rows) view of sequence b)."""
    if layout == "contiguous":
        k, v = torch.randn(batch, capacity, heads_k, dim, dtype=dtype), torch.randn(batch, capacity, heads_k, dim, dtype=dtype)
        return k, v, {}, lambda kc, vc, b: (kc[b], vc[b])
    if layout == "strided":  # a slice of a larger buffer along the sequence axis (not viewable flat)
        kb = torch.randn(batch, capacity + 7, heads_k, dim, dtype=dtype)
        vb = torch.randn(batch, capacity + 7, heads_k, dim, dtype=dtype)
        return kb[:, :capacity], vb[:, :capacity], {}, lambda kc, vc, b: (kc[b], vc[b])
    if layout == "strided_heads":  # every other head of a buffer
        kb = torch.randn(batch, capacity, 2 * heads_k, dim, dtype=dtype)
        vb = torch.randn(batch, capacity, 2 * heads_k, dim, dtype=dtype)
        return kb[:, :, ::2], vb[:, :, ::2], {}, lambda kc, vc, b: (kc[b], vc[b])
    if layout == "batch_idx":
        entries = batch + 2
        k, v = torch.randn(entries, capacity, heads_k, dim, dtype=dtype), torch.randn(entries, capacity, heads_k, dim, dtype=dtype)
        idx = torch.randperm(entries)[:batch].to(torch.int32)
        return k, v, {"cache_batch_idx": idx}, lambda kc, vc, b: (kc[int(idx[b])], vc[int(idx[b])])
    assert layout.startswith("paged")
    page = 4
    per_seq = capacity // page
    pages = batch * per_seq + 3
    k, v = torch.randn(pages, page, heads_k, dim, dtype=dtype), torch.randn(pages, page, heads_k, dim, dtype=dtype)
    if layout == "paged_strided":
        k = torch.randn(pages, page + 2, heads_k, dim, dtype=dtype)[:, 1:page + 1]
        v = torch.randn(pages, page + 2, heads_k, dim, dtype=dtype)[:, 1:page + 1]
    table = torch.randperm(pages)[: batch * per_seq].reshape(batch, per_seq).to(torch.int32)

    def logical(kc, vc, b):
        rows = table[b].long()
        return kc[rows].reshape(capacity, heads_k, dim), vc[rows].reshape(capacity, heads_k, dim)
    return k, v, {"block_table": table}, logical


@pytest.mark.parametrize("layout", ["contiguous", "strided", "strided_heads", "batch_idx", "paged", "paged_strided"])
def test_appends_land_in_the_callers_cache_after_several_steps(layout):
    """Fails on the old reference path for the strided layouts: it appended into a reshaped
    private copy, so the caller's cache never changed and step 1 attended to stale rows."""
    torch.manual_seed(1)
    batch, heads, heads_k, dim, capacity, new, steps = 2, 4, 2, 16, 24, 2, 3
    k_cache, v_cache, extra, logical = _layout(layout, batch, capacity, heads_k, dim, torch.float32)
    before = [tuple(t.clone() for t in logical(k_cache, v_cache, b)) for b in range(batch)]
    seqlens = torch.tensor([3, 9], dtype=torch.int32)
    history = []
    for step in range(steps):
        q = torch.randn(batch, new, heads, dim)
        k_new, v_new = torch.randn(batch, new, heads_k, dim), torch.randn(batch, new, heads_k, dim)
        history.append((k_new, v_new))
        out = portattn.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=seqlens,
                                               causal=True, **extra)
        for b in range(batch):
            n = int(seqlens[b])
            kc, vc = logical(k_cache, v_cache, b)
            keys, values = kc[: n + new].unsqueeze(0), vc[: n + new].unsqueeze(0)
            ref, _, low, _ = oracle(q[b : b + 1], keys, values, causal=True)
            assert_output(out[b : b + 1], ref, low)
        seqlens = seqlens + new
    for b in range(batch):
        kc, vc = logical(k_cache, v_cache, b)
        start = [3, 9][b]
        for step, (k_new, v_new) in enumerate(history):
            rows = slice(start + step * new, start + (step + 1) * new)
            assert torch.equal(kc[rows], k_new[b]) and torch.equal(vc[rows], v_new[b]), f"step {step} vanished"
        end = start + steps * new
        assert torch.equal(kc[:start], before[b][0][:start]) and torch.equal(kc[end:], before[b][0][end:])
        assert torch.equal(vc[:start], before[b][1][:start]) and torch.equal(vc[end:], before[b][1][end:])


# ---- bad index values on the CPU: a ValueError naming argument and entry, nothing written ---

BAD = [
    ("cache_seqlens", dict(cache_seqlens=[3, -1]), r"cache_seqlens\[1\] = -1"),
    ("cache_seqlens", dict(cache_seqlens=[3, 8]), r"cache_seqlens\[1\] = 8 .*\[0, 7\]"),
    ("cache_seqlens", dict(cache_seqlens=[2**31 - 1, 0]), r"cache_seqlens\[0\]"),
    ("cache_batch_idx", dict(cache_batch_idx=[0, -1]), r"cache_batch_idx\[1\] = -1 .*\[0, 2\]"),
    ("cache_batch_idx", dict(cache_batch_idx=[0, 5]), r"cache_batch_idx\[1\] = 5"),
    ("block_table", dict(block_table=[[0, 1], [2, -1]]), r"block_table\[1, 1\] = -1"),
    ("block_table", dict(block_table=[[0, 1], [2, 7]]), r"block_table\[1, 1\] = 7 .*\[0, 3\]"),
    ("cache_leftpad", dict(cache_leftpad=[0, -2]), r"cache_leftpad\[1\] = -2"),
    ("cache_leftpad", dict(cache_leftpad=[0, 30]), r"cache_leftpad\[1\] = 30"),
]


@pytest.mark.parametrize("name,values,message", BAD, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD)])
def test_bad_index_values_raise_and_write_nothing(name, values, message):
    """Fails on the old code: these wrote into other sequences' rows or raised IndexError /
    RuntimeError naming no argument."""
    torch.manual_seed(2)
    batch, heads_k, dim = 2, 1, 8
    paged = "block_table" in values
    if paged:  # 4 pages of 4 rows, 2 per sequence: capacity 8
        k_cache, v_cache = torch.randn(4, 4, heads_k, dim), torch.randn(4, 4, heads_k, dim)
    else:  # 3 entries of 8 rows
        k_cache, v_cache = torch.randn(3, 8, heads_k, dim), torch.randn(3, 8, heads_k, dim)
    kwargs = {key: torch.tensor(value, dtype=torch.int32) for key, value in values.items()}
    kwargs.setdefault("cache_seqlens", torch.tensor([3, 5], dtype=torch.int32))
    if paged:
        kwargs.setdefault("block_table", torch.tensor([[0, 1], [2, 3]], dtype=torch.int32))
    saved = k_cache.clone(), v_cache.clone()
    q = torch.randn(batch, 1, 2, dim)
    k_new, v_new = torch.randn(batch, 1, heads_k, dim), torch.randn(batch, 1, heads_k, dim)
    with pytest.raises(ValueError, match=message):
        portattn.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, **kwargs)
    assert torch.equal(k_cache, saved[0]) and torch.equal(v_cache, saved[1]), "a refused call wrote the cache"


def test_paged_varlen_bad_block_table_and_cu_seqlens_raise():
    k_cache, v_cache = torch.randn(4, 4, 1, 8), torch.randn(4, 4, 1, 8)
    q = torch.randn(4, 2, 8)
    cu_q = torch.tensor([0, 2, 4], dtype=torch.int32)
    table = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = -1"):
        portattn.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, torch.tensor([0, 5, 11], dtype=torch.int32),
                                        2, 6, block_table=table)
    good = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        portattn.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, torch.tensor([0, 5, 3], dtype=torch.int32),
                                        2, 6, block_table=good)


@pytest.mark.parametrize("cu_k,message", [
    ([0, 5, 3, 8], r"non-decreasing.*cu_seqlens_k\[2\] < cu_seqlens_k\[1\]"),
    ([2, 5, 8, 8], r"cu_seqlens_k\[0\] must be 0"),
    ([-1, 5, 8, 8], r"cu_seqlens_k\[0\] must be 0"),
    ([0, 3, 6, 12], r"cu_seqlens_k\[-1\] = 12 exceeds the 8"),
    ([0, 1, 2, 8], r"max_seqlen_k = 4 is smaller than the longest sequence"),
])
def test_cpu_cu_seqlens_values_are_checked(cu_k, message):
    """Fails on the old code: no check on the CPU without PORTATTN_DEBUG_CHECKS, silent wrong answers."""
    q, k, v = torch.randn(6, 2, 8), torch.randn(8, 2, 8), torch.randn(8, 2, 8)
    cu_q = torch.tensor([0, 2, 4, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        portattn.flash_attn_varlen_func(q, k, v, cu_q, torch.tensor(cu_k, dtype=torch.int32), 2, 4)


# ---- smaller defects --------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(0, 1, 2, 8), (2, 0, 2, 8)], ids=["batch0", "seqlen_q0"])
def test_kvcache_empty_inputs(shape):
    batch, seqlen_q, heads, dim = shape
    q = torch.randn(shape)
    k_cache, v_cache = torch.randn(max(batch, 1), 6, 1, dim), torch.randn(max(batch, 1), 6, 1, dim)
    k_new, v_new = torch.randn(batch, 1, 1, dim), torch.randn(batch, 1, 1, dim)
    seqlens = torch.full((batch,), 2, dtype=torch.int32)
    out, lse = portattn.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=seqlens,
                                                return_softmax_lse=True)
    assert out.shape == shape and lse.shape == (batch, heads, seqlen_q)
    if batch:  # the append still happened
        assert torch.equal(k_cache[:, 2], k_new[:, 0]) and torch.equal(v_cache[:, 2], v_new[:, 0])


def test_kvcache_integer_dtype_is_a_type_error():
    q = torch.zeros(1, 1, 2, 8, dtype=torch.int32)
    with pytest.raises(TypeError, match="q has dtype torch.int32"):
        portattn.flash_attn_with_kvcache(q, q.clone(), q.clone(), cache_seqlens=1)


def test_short_rotary_table_raises():
    q, kc, vc = torch.randn(1, 1, 2, 8), torch.randn(1, 16, 2, 8), torch.randn(1, 16, 2, 8)
    angles = torch.rand(10, 2)
    with pytest.raises(ValueError, match=r"rotary_cos/rotary_sin must have at least .* \(16\), got 10"):
        portattn.flash_attn_with_kvcache(q, kc, vc, k=torch.randn(1, 1, 2, 8), v=torch.randn(1, 1, 2, 8),
                                         rotary_cos=angles.cos(), rotary_sin=angles.sin(), cache_seqlens=12)


def test_numpy_scalars_are_accepted():
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 5, 2, 8), torch.randn(1, 7, 2, 8), torch.randn(1, 7, 2, 8)
    got = portattn.flash_attn_func(q, k, v, softmax_scale=np.float32(0.25), causal=np.bool_(True),
                                   softcap=np.float32(2.0))
    ref, _, low, _ = oracle(q, k, v, causal=True, scale=0.25, softcap=2.0)
    assert_output(got, ref, low)
    with pytest.raises(TypeError, match="causal must be a bool"):
        portattn.flash_attn_func(q, k, v, causal=1)
    with pytest.raises(TypeError, match="softmax_scale"):
        portattn.flash_attn_func(q, k, v, softmax_scale=np.bool_(True))


def test_nan_in_q_gives_nan_lse_not_the_empty_row_marker():
    torch.manual_seed(4)
    q, k, v = torch.randn(1, 3, 2, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
    q[0, 1, 0, 3] = float("nan")
    out, lse, _ = portattn.flash_attn_func(q, k, v, return_attn_probs=True)
    assert torch.isnan(out[0, 1, 0]).all() and torch.isnan(lse[0, 0, 1])
    clean = torch.ones_like(lse, dtype=torch.bool)
    clean[0, 0, 1] = False
    assert torch.isfinite(lse[clean]).all()


def test_kvcache_and_paged_varlen_outputs_have_no_grad():
    q = torch.randn(1, 2, 2, 8, requires_grad=True)
    kc, vc = torch.randn(1, 6, 2, 8, requires_grad=True), torch.randn(1, 6, 2, 8, requires_grad=True)
    out = portattn.flash_attn_with_kvcache(q, kc.detach(), vc.detach(), cache_seqlens=4)
    assert not out.requires_grad
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    paged_k = torch.randn(2, 4, 2, 8, requires_grad=True)
    out = portattn.flash_attn_varlen_func(q[0], paged_k, paged_k.detach().clone(), torch.tensor([0, 2], dtype=torch.int32),
                                          torch.tensor([0, 6], dtype=torch.int32), 2, 6, block_table=table)
    assert not out.requires_grad


def test_bad_portattn_backend_reports_instead_of_crashing():
    env = dict(os.environ, PORTATTN_BACKEND="bogus")
    run = subprocess.run([sys.executable, "-m", "portattn"], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr
    assert "PORTATTN_BACKEND='bogus' is not a backend" in run.stdout
    # A call raises the same clear ValueError.
    code = ("import torch, portattn\n"
            "try:\n    portattn.flash_attn_func(*[torch.randn(1, 2, 2, 8)] * 3)\n"
            "except ValueError as e:\n    print('raised', e)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert "raised PORTATTN_BACKEND='bogus' is not a backend" in run.stdout, run.stdout + run.stderr


# ---- the error buffer (device containment; its host side is testable on the CPU) ---------


def test_check_errors_reports_and_clears(monkeypatch):
    monkeypatch.setattr(errors, "_BUFFERS", {})
    monkeypatch.setattr(errors, "_BY_DEVICE", {})
    device = torch.device("cpu")
    errors.check_errors()  # nothing recorded: no error
    errors.record(device, "block_table", 3, -7)
    errors.record(device, "block_table", 5, 99)  # the first entry is kept
    errors.record(device, "cache_seqlens", 0, 2**31 - 1)
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = 2147483647 .*block_table\[3\] = -7"):
        portattn.check_errors()
    portattn.check_errors()  # cleared


def test_reference_path_contains_bad_sequences_off_the_cpu(monkeypatch):
    """What the reference backend does on a GPU (the "cpu" test is bypassed here): the bad
    sequence reads and writes nothing, its rows are 0 / -inf, the others are exact."""
    from portattn import kvcache

    monkeypatch.setattr(errors, "_BUFFERS", {})
    monkeypatch.setattr(errors, "_BY_DEVICE", {})
    torch.manual_seed(5)
    q = torch.randn(3, 1, 2, 8)
    k_cache, v_cache = torch.randn(4, 4, 1, 8), torch.randn(4, 4, 1, 8)  # 4 pages of 4
    saved = k_cache.clone()
    table = torch.tensor([[0, 1], [2, -1], [3, 3]], dtype=torch.int32)
    seqlens = torch.tensor([2, 5, 1], dtype=torch.int32)
    k_new, v_new = torch.randn(3, 1, 1, 8), torch.randn(3, 1, 1, 8)
    out, lse = kvcache._gather_and_attend(
        q, k_cache, v_cache, k_new, v_new, None, None, seqlens, None, None, table, 8 ** -0.5, -1, -1, 0.0,
        True, None, True, False, portattn.flash_attn_varlen_func)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isinf(lse[1]).all()
    changed = (k_cache != saved).any(dim=(1, 2, 3))
    assert changed.tolist() == [True, False, False, True]  # page 0 (seq 0), page 3 (seq 2); nothing for seq 1
    with pytest.raises(ValueError, match=r"block_table\[1\] = -1"):
        errors.check_errors()
    for b, n in ((0, 3), (2, 2)):
        rows = table[b].long()
        keys = k_cache[rows].reshape(8, 1, 8)[:n][None]
        values = v_cache[rows].reshape(8, 1, 8)[:n][None]
        ref, ref_lse, low, f32_lse = oracle(q[b : b + 1], keys, values)
        assert_output(out[b : b + 1], ref, low)
        assert_lse(lse[b : b + 1], ref_lse, f32_lse)


# ---- caches under threads ---------------------------------------------------------------


def test_plan_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(decode, "_PLANS", {})
    monkeypatch.setattr(decode, "_MAX_PLANS", 8)
    for key in range(20):
        decode._remember_plan(("shape", key), 1)
    assert len(decode._PLANS) == 8 and ("shape", 19) in decode._PLANS and ("shape", 0) not in decode._PLANS


def test_concurrent_calls_from_threads():
    """Dispatch decisions, plan-cache inserts and the reference path under 4 threads at once."""
    torch.manual_seed(6)
    cases = []
    for t in range(4):
        q, k, v = torch.randn(1, 3, 2 * (t + 1), 8), torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8)
        ref, _, low, _ = oracle(q, k, v, causal=bool(t % 2))
        cases.append((q, k, v, bool(t % 2), ref, low))
    failures = []
    start = threading.Barrier(4)

    def worker(t):
        q, k, v, causal, ref, low = cases[t]
        start.wait()
        try:
            for i in range(10):
                assert_output(portattn.flash_attn_func(q, k, v, causal=causal), ref, low)
                decode._remember_plan(("thread", t, i), i)
        except Exception as error:  # reported below, with the thread
            failures.append((t, repr(error)))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
    assert len(dispatch.DISPATCHER._decisions) >= 2  # both causal settings decided once each
