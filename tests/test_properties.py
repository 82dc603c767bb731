"""Property-based tests (hypothesis) of the public API on the CPU against the float64 oracle
(tests/error_rule.py): shapes, GQA ratios, head dims, dtypes, windows, softcap, ALiBi,
varlen with zero-length sequences, kvcache (contiguous, strided, paged); and containment:
any out-of-range cache metadata raises a ValueError naming the argument, and writes nothing.

Kept small for CI (2 cores): tiny shapes, max_examples 25-40, no deadline."""
from __future__ import annotations

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import portattn  # noqa: E402
from error_rule import assert_lse, assert_output  # noqa: E402
from naive import naive_attention  # noqa: E402

SETTINGS = dict(deadline=None, derandomize=True, database=None, print_blob=True)
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _oracle(q, k, v, **options):
    ref, ref_lse = naive_attention(q, k, v, compute_dtype=torch.float64, **options)
    low, _ = naive_attention(q, k, v, compute_dtype=q.dtype, **options)
    _, f32_lse = naive_attention(q, k, v, compute_dtype=torch.float32, **options)
    return ref, ref_lse, low, f32_lse


@st.composite
def problems(draw):
    heads_k = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 2, 3]))
    return dict(
        batch=draw(st.integers(1, 2)), seqlen_q=draw(st.integers(1, 6)), seqlen_k=draw(st.integers(0, 9)),
        heads_k=heads_k, heads=heads_k * group, dim=draw(st.sampled_from([8, 16, 24, 40])),
        dtype=draw(st.sampled_from(DTYPES)), causal=draw(st.booleans()),
        window=(draw(st.integers(-1, 4)), draw(st.integers(-1, 4))),
        softcap=draw(st.sampled_from([0.0, 0.0, 5.0])), alibi=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)))


@settings(max_examples=40, **SETTINGS)
@given(problems())
def test_dense_matches_the_oracle(p):
    torch.manual_seed(p["seed"])
    shape_q = (p["batch"], p["seqlen_q"], p["heads"], p["dim"])
    shape_k = (p["batch"], p["seqlen_k"], p["heads_k"], p["dim"])
    q, k, v = (torch.randn(s).to(p["dtype"]) for s in (shape_q, shape_k, shape_k))
    slopes = torch.rand(p["heads"]) if p["alibi"] else None
    options = dict(causal=p["causal"], window=p["window"], softcap=p["softcap"], alibi_slopes=slopes)
    out, lse, _ = portattn.flash_attn_func(q, k, v, causal=p["causal"], window_size=p["window"],
                                           softcap=p["softcap"], alibi_slopes=slopes, return_attn_probs=True)
    ref, ref_lse, low, f32_lse = _oracle(q, k, v, **options)
    assert_output(out, ref, low)
    assert_lse(lse, ref_lse, f32_lse)


@settings(max_examples=30, **SETTINGS)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 7)), min_size=1, max_size=4),
       st.sampled_from([(2, 1), (4, 2), (3, 3)]), st.booleans(), st.integers(0, 2**16))
def test_varlen_with_empty_sequences_matches_the_oracle(lengths, heads, causal, seed):
    torch.manual_seed(seed)
    heads_q, heads_k = heads
    dim = 16
    cu_q = torch.tensor([0] + [a for a, _ in lengths]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + [b for _, b in lengths]).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu_q[-1]), heads_q, dim)
    k, v = torch.randn(int(cu_k[-1]), heads_k, dim), torch.randn(int(cu_k[-1]), heads_k, dim)
    out, lse, _ = portattn.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(a for a, _ in lengths), max(b for _, b in lengths), causal=causal,
        return_attn_probs=True)
    for b in range(len(lengths)):
        rows_q = slice(int(cu_q[b]), int(cu_q[b + 1]))
        rows_k = slice(int(cu_k[b]), int(cu_k[b + 1]))
        ref, ref_lse, low, f32_lse = _oracle(q[None, rows_q], k[None, rows_k], v[None, rows_k], causal=causal)
        assert_output(out[None, rows_q], ref, low)
        assert_lse(lse[None, :, rows_q], ref_lse, f32_lse)


@st.composite
def cache_calls(draw):
    batch = draw(st.integers(1, 3))
    page = 4
    capacity = 4 * draw(st.integers(1, 4))
    new = draw(st.integers(0, 2))
    seqlens = [draw(st.integers(0, capacity - new)) for _ in range(batch)]
    leftpad = [draw(st.integers(0, s + new)) for s in seqlens] if draw(st.booleans()) else None
    return dict(batch=batch, page=page, capacity=capacity, new=new, seqlens=seqlens, leftpad=leftpad,
                layout=draw(st.sampled_from(["contiguous", "strided", "batch_idx", "paged"])),
                seqlen_q=draw(st.integers(1, 3)), heads=draw(st.sampled_from([(2, 1), (4, 2), (2, 2)])),
                causal=draw(st.booleans()), rotary=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


def _cache(c, dim):
    """(k_cache, v_cache, kwargs, logical(kc, b) -> sequence b's (capacity, Hk, D) rows)."""
    batch, capacity, heads_k = c["batch"], c["capacity"], c["heads"][1]
    if c["layout"] == "paged":
        per = capacity // c["page"]
        pages = batch * per + 1
        k, v = torch.randn(pages, c["page"], heads_k, dim), torch.randn(pages, c["page"], heads_k, dim)
        table = torch.randperm(pages)[: batch * per].reshape(batch, per).to(torch.int32)
        return k, v, dict(block_table=table), lambda t, b: t[table[b].long()].reshape(capacity, heads_k, dim)
    if c["layout"] == "batch_idx":
        k, v = torch.randn(batch + 1, capacity, heads_k, dim), torch.randn(batch + 1, capacity, heads_k, dim)
        idx = torch.randperm(batch + 1)[:batch].to(torch.int32)
        return k, v, dict(cache_batch_idx=idx), lambda t, b: t[int(idx[b])]
    if c["layout"] == "strided":
        k = torch.randn(batch, capacity + 3, heads_k, dim)[:, 2:-1]
        v = torch.randn(batch, capacity + 3, heads_k, dim)[:, 1:-2]
        return k, v, {}, lambda t, b: t[b]
    k, v = torch.randn(batch, capacity, heads_k, dim), torch.randn(batch, capacity, heads_k, dim)
    return k, v, {}, lambda t, b: t[b]


@settings(max_examples=40, **SETTINGS)
@given(cache_calls())
def test_kvcache_matches_the_oracle_and_appends_in_place(c):
    from portattn.kvcache import apply_rotary

    torch.manual_seed(c["seed"])
    dim, (heads, heads_k) = 16, c["heads"]
    k_cache, v_cache, extra, logical = _cache(c, dim)
    before_k = [logical(k_cache, b).clone() for b in range(c["batch"])]
    before_v = [logical(v_cache, b).clone() for b in range(c["batch"])]
    q = torch.randn(c["batch"], c["seqlen_q"], heads, dim)
    k_new = torch.randn(c["batch"], c["new"], heads_k, dim) if c["new"] else None
    v_new = torch.randn(c["batch"], c["new"], heads_k, dim) if c["new"] else None
    seqlens = torch.tensor(c["seqlens"], dtype=torch.int32)
    leftpad = None if c["leftpad"] is None else torch.tensor(c["leftpad"], dtype=torch.int32)
    cos = sin = None
    if c["rotary"]:
        angles = torch.rand(c["capacity"], 4) * 3
        cos, sin = angles.cos(), angles.sin()
    out, lse = portattn.flash_attn_with_kvcache(
        q, k_cache, v_cache, k=k_new, v=v_new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens,
        cache_leftpad=leftpad, causal=c["causal"], return_softmax_lse=True, **extra)
    for b in range(c["batch"]):
        n, start = c["seqlens"][b], 0 if leftpad is None else c["leftpad"][b]
        kb, vb = logical(k_cache, b), logical(v_cache, b)
        qb = q[b : b + 1]
        if c["new"]:
            want_k = k_new[b : b + 1]
            if c["rotary"]:  # rotary_interleaved defaults to True
                want_k = apply_rotary(want_k, cos, sin, (n + torch.arange(c["new"])).unsqueeze(0), True)
            assert torch.allclose(kb[n : n + c["new"]], want_k[0], atol=1e-6)
            assert torch.equal(vb[n : n + c["new"]], v_new[b])
        end = n + c["new"]
        assert torch.equal(kb[:n], before_k[b][:n]) and torch.equal(kb[end:], before_k[b][end:])
        assert torch.equal(vb[:n], before_v[b][:n]) and torch.equal(vb[end:], before_v[b][end:])
        if c["rotary"]:
            offsets = torch.arange(c["seqlen_q"]) if c["causal"] else torch.zeros(c["seqlen_q"], dtype=torch.long)
            qb = apply_rotary(qb, cos, sin, (n + offsets).unsqueeze(0), True)
        ref, ref_lse, low, f32_lse = _oracle(qb, kb[start:end][None], vb[start:end][None], causal=c["causal"])
        assert_output(out[b : b + 1], ref, low)
        assert_lse(lse[b : b + 1], ref_lse, f32_lse)


@settings(max_examples=40, **SETTINGS)
@given(cache_calls(), st.sampled_from(["cache_seqlens", "cache_leftpad", "cache_batch_idx", "block_table"]),
       st.integers(0, 2), st.sampled_from([-(2**31), -5, -1, 1, 7, 2**31 - 1]))
def test_out_of_range_metadata_raises_and_writes_nothing(c, argument, which, offset):
    torch.manual_seed(c["seed"])
    c = dict(c, layout={"cache_batch_idx": "batch_idx", "block_table": "paged"}.get(argument, c["layout"]))
    dim, heads_k = 8, c["heads"][1]
    k_cache, v_cache, extra, _ = _cache(c, dim)
    b = which % c["batch"]
    seqlens = torch.tensor(c["seqlens"], dtype=torch.int32)
    leftpad = torch.tensor(c["leftpad"] or [0] * c["batch"], dtype=torch.int32)
    if argument == "cache_seqlens":
        bad = c["capacity"] - c["new"] + offset if offset > 0 else offset
        seqlens[b] = max(min(bad, 2**31 - 1), -(2**31))
    elif argument == "cache_leftpad":
        bad = c["seqlens"][b] + c["new"] + offset if offset > 0 else offset
        leftpad[b] = max(min(bad, 2**31 - 1), -(2**31))
    elif argument == "cache_batch_idx":
        extent = k_cache.shape[0]
        extra["cache_batch_idx"][b] = max(min(extent - 1 + offset, 2**31 - 1), -(2**31)) if offset > 0 else offset
    else:
        end = c["seqlens"][b] + c["new"]
        if end == 0:  # a sequence without rows uses no page: make it use one
            seqlens[b] = c["capacity"] - c["new"] if c["capacity"] > c["new"] else 0
            end = int(seqlens[b]) + c["new"]
            if end == 0:
                return
        slot = (end - 1) // c["page"]
        pages = k_cache.shape[0]
        extra["block_table"][b, slot] = max(min(pages - 1 + offset, 2**31 - 1), -(2**31)) if offset > 0 else offset
        leftpad[b] = 0
    saved = k_cache.clone(), v_cache.clone()
    q = torch.randn(c["batch"], 1, c["heads"][0], dim)
    new = max(c["new"], 0)
    k_new, v_new = torch.randn(c["batch"], new, heads_k, dim), torch.randn(c["batch"], new, heads_k, dim)
    with pytest.raises(ValueError, match=rf"{argument}\[{b}"):
        portattn.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new if new else None, v=v_new if new else None,
                                         cache_seqlens=seqlens, cache_leftpad=leftpad, **extra)
    assert torch.equal(k_cache, saved[0]) and torch.equal(v_cache, saved[1])
