"""FP8 (e4m3) KV caches in flash_attn_with_kvcache on the reference path (CPU), and their checks.

Oracle: the float64 naive attention on the dequantised cache (e4m3 value * descale); error rule:
tests/error_rule.py, PyTorch's own error being the same attention in q's dtype on the dequantised
cache rounded to that dtype. The GPU kernels' suite is tests/gpu/test_cuda_decode_fp8.py.
"""
import pytest
import torch

import portattn
from error_rule import assert_output
from naive import naive_attention
from portattn import dispatch
from portattn.capability import matrix, probe
from portattn.capability.callspec import CallSpec
from portattn.kvcache import quantize_fp8

FP8 = torch.float8_e4m3fn


def fp8_cache(batch, capacity, heads_k, dim, scale=1.0):
    """An e4m3 cache whose values span e4m3's range, subnormals included."""
    x = torch.randn(batch, capacity, heads_k, dim) * scale
    x.view(-1)[::97] = 2.0 ** -8  # subnormal in e4m3 (min normal 2^-6)
    return x.clamp(-448, 448).to(FP8)


def dequantised(cache, descale):
    values = cache.double()
    return values if descale is None else values * descale.double()[:, None, :, None]


def check(out, q, keys, values, causal=False):
    """keys/values: the dequantised float64 caches of each sequence (lists)."""
    for b in range(q.shape[0]):
        qb = q[b : b + 1]
        want = naive_attention(qb, keys[b], values[b], causal=causal)[0]
        low = naive_attention(qb, keys[b].to(q.dtype), values[b].to(q.dtype), causal=causal,
                              compute_dtype=q.dtype)[0]
        assert_output(out[b : b + 1], want, low)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("descales", [True, False])
def test_fp8_cache_against_the_dequantised_oracle(dtype, paged, descales):
    torch.manual_seed(0)
    batch, heads, heads_k, dim, capacity, page = 3, 8, 2, 32, 48, 16
    q = torch.randn(batch, 1, heads, dim, dtype=dtype)
    dense_k, dense_v = fp8_cache(batch, capacity, heads_k, dim, 4.0), fp8_cache(batch, capacity, heads_k, dim)
    k_descale = torch.rand(batch, heads_k) * 0.5 + 0.1 if descales else None
    v_descale = torch.rand(batch, heads_k) * 2 + 0.5 if descales else None
    seqlens = torch.tensor([1, 30, 48], dtype=torch.int32)
    block_table = None
    k_cache, v_cache = dense_k.clone(), dense_v.clone()
    if paged:
        order = torch.randperm(batch * capacity // page)
        block_table = order.reshape(batch, capacity // page).to(torch.int32)
        rows = (block_table.long()[:, :, None] * page + torch.arange(page)).flatten()
        k_cache = torch.empty(batch * capacity // page, page, heads_k, dim, dtype=FP8)
        v_cache = torch.empty_like(k_cache)
        k_cache.view(-1, heads_k, dim)[rows] = dense_k.reshape(-1, heads_k, dim)
        v_cache.view(-1, heads_k, dim)[rows] = dense_v.reshape(-1, heads_k, dim)
    out = portattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=block_table,
                                           k_descale=k_descale, v_descale=v_descale)
    assert out.dtype == dtype
    keys, values = dequantised(dense_k, k_descale), dequantised(dense_v, v_descale)
    check(out, q, [keys[b : b + 1, : int(seqlens[b])] for b in range(batch)],
          [values[b : b + 1, : int(seqlens[b])] for b in range(batch)])


def test_append_quantises_the_new_rows_with_their_descales():
    torch.manual_seed(1)
    batch, heads, heads_k, dim, capacity, new = 2, 4, 2, 16, 24, 3
    q = torch.randn(batch, new, heads, dim, dtype=torch.bfloat16)
    k_new = torch.randn(batch, new, heads_k, dim, dtype=torch.bfloat16) * 3
    v_new = torch.randn(batch, new, heads_k, dim, dtype=torch.bfloat16)
    k_new[0, 0, 0, 0] = 1000.0  # past 448 * descale: saturates, never NaN
    k_new[0, 0, 0, 1] = -1000.0
    k_new[1, 0, 1, 0] = 1.0625  # halfway between e4m3's 1.0 and 1.125: rounds to even (1.0)
    k_descale = torch.tensor([[0.5, 2.0], [0.25, 1.0]])
    v_descale = torch.tensor([[1.5, 0.75], [1.0, 3.0]])
    k_cache, v_cache = fp8_cache(batch, capacity, heads_k, dim), fp8_cache(batch, capacity, heads_k, dim)
    before_k = k_cache.clone()
    seqlens = torch.tensor([4, 17], dtype=torch.int32)
    out = portattn.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=seqlens,
                                           causal=True, k_descale=k_descale, v_descale=v_descale)
    for b in range(batch):
        n = int(seqlens[b])
        rows = k_cache[b, n : n + new]
        want = ((k_new[b].float() / k_descale[b][None, :, None]).clamp(-448, 448)).to(FP8)
        assert torch.equal(rows.view(torch.uint8), want.view(torch.uint8))
        want_v = ((v_new[b].float() / v_descale[b][None, :, None]).clamp(-448, 448)).to(FP8)
        assert torch.equal(v_cache[b, n : n + new].view(torch.uint8), want_v.view(torch.uint8))
        assert torch.equal(k_cache[b, :n].view(torch.uint8), before_k[b, :n].view(torch.uint8))
    assert k_cache[0, 4, 0, 0].float() == 448 and k_cache[0, 4, 0, 1].float() == -448
    assert k_cache[1, 17, 1, 0].float() == 1.0
    assert not k_cache.float().isnan().any()
    keys = dequantised(k_cache, k_descale)
    values = dequantised(v_cache, v_descale)
    check(out, q, [keys[b : b + 1, : int(seqlens[b]) + new] for b in range(batch)],
          [values[b : b + 1, : int(seqlens[b]) + new] for b in range(batch)], causal=True)


def test_quantize_fp8_rounds_to_nearest_even_and_saturates():
    x = torch.tensor([1.0625, 1.1875, 448.0, 464.0, 1e6, -1e6, 2.0 ** -10, 0.0]).reshape(1, 1, 1, 8)
    got = quantize_fp8(x, None).float().flatten().tolist()
    assert got == [1.0, 1.25, 448.0, 448.0, 448.0, -448.0, 0.0, 0.0]
    halved = quantize_fp8(x, torch.tensor([[2.0]])).float().flatten().tolist()
    assert halved[:4] == [0.5, 0.625, 224.0, 224.0]  # x / 2 rounded once: ties to even


def test_descales_default_to_one_and_may_be_expanded_views():
    torch.manual_seed(2)
    batch, heads_k, dim = 2, 2, 16
    q = torch.randn(batch, 1, 4, dim, dtype=torch.bfloat16)
    k_cache, v_cache = fp8_cache(batch, 32, heads_k, dim), fp8_cache(batch, 32, heads_k, dim)
    plain = portattn.flash_attn_with_kvcache(q, k_cache, v_cache)
    ones = torch.ones(batch, heads_k)
    assert torch.equal(plain, portattn.flash_attn_with_kvcache(q, k_cache, v_cache, k_descale=ones, v_descale=ones))
    scale = torch.tensor(0.5)
    expanded = portattn.flash_attn_with_kvcache(q, k_cache, v_cache, k_descale=scale.expand(batch, heads_k),
                                                v_descale=scale.expand(batch, heads_k))
    full = torch.full((batch, heads_k), 0.5)
    assert torch.equal(expanded, portattn.flash_attn_with_kvcache(q, k_cache, v_cache, k_descale=full, v_descale=full))
    assert not torch.equal(expanded, plain)


def _call(**overrides):
    batch, heads_k, dim = 2, 2, 16
    args = dict(q=torch.randn(batch, 1, 4, dim, dtype=torch.bfloat16), k_cache=fp8_cache(batch, 8, heads_k, dim),
                v_cache=fp8_cache(batch, 8, heads_k, dim))
    args.update(overrides)
    return portattn.flash_attn_with_kvcache(**args)


@pytest.mark.parametrize("overrides, error, words", [
    (dict(q_descale=torch.ones(2, 2)), TypeError, "q_descale scales an FP8 (torch.float8_e4m3fn) query"),
    (dict(q=torch.randn(2, 1, 4, 16).to(FP8), q_descale=torch.ones(2, 3)), ValueError,
     "q_descale must have shape (batch, nheads_k) = (2, 2)"),
    (dict(q=torch.randn(2, 1, 4, 16).to(FP8), k_cache=torch.zeros(2, 8, 2, 16, dtype=torch.bfloat16),
          v_cache=torch.zeros(2, 8, 2, 16, dtype=torch.bfloat16)), TypeError, "FP8 keys and values only"),
    (dict(q=torch.randn(2, 1, 4, 16).to(FP8), q_descale=torch.ones(2, 2), k=torch.zeros(2, 1, 2, 16, dtype=FP8),
          v=torch.zeros(2, 1, 2, 16, dtype=FP8), cache_seqlens=torch.zeros(2, dtype=torch.int32)), TypeError,
     "the new k and v are bfloat16"),
    (dict(k_descale=torch.ones(2, 2, dtype=torch.float16)), TypeError, "float32"),
    (dict(v_descale=[1.0, 1.0]), TypeError, "v_descale"),
    (dict(k_descale=torch.ones(2)), ValueError, "(batch, nheads_k) = (2, 2)"),
    (dict(v_descale=torch.ones(2, 3)), ValueError, "(batch, nheads_k) = (2, 2)"),
    (dict(k_cache=torch.zeros(2, 8, 2, 16, dtype=torch.bfloat16), v_cache=torch.zeros(2, 8, 2, 16, dtype=torch.bfloat16),
          k_descale=torch.ones(2, 2)), ValueError,
     "FP8 (torch.float8_e4m3fn) caches only"),
    (dict(v_cache=torch.zeros(2, 8, 2, 16, dtype=torch.bfloat16)), ValueError, "float8_e4m3fn"),
    (dict(k_cache=torch.zeros(2, 8, 2, 16, dtype=torch.float8_e5m2),
          v_cache=torch.zeros(2, 8, 2, 16, dtype=torch.float8_e5m2)), ValueError, "float8_e4m3fn"),
    (dict(q=torch.randn(2, 1, 4, 16)), TypeError, "float16 or bfloat16 q"),
    (dict(k=torch.zeros(2, 1, 2, 16, dtype=FP8), v=torch.zeros(2, 1, 2, 16, dtype=FP8),
          cache_seqlens=torch.zeros(2, dtype=torch.int32)), ValueError, "q's dtype"),
])
def test_bad_fp8_arguments_name_the_argument(overrides, error, words):
    with pytest.raises(error) as caught:
        _call(**overrides)
    assert words in str(caught.value)


def test_bad_descale_is_refused_before_the_cache_is_written():
    k_cache = fp8_cache(2, 8, 2, 16)
    before = k_cache.clone()
    with pytest.raises(ValueError):
        _call(k_cache=k_cache, k=torch.ones(2, 1, 2, 16, dtype=torch.bfloat16),
              v=torch.ones(2, 1, 2, 16, dtype=torch.bfloat16), cache_seqlens=torch.zeros(2, dtype=torch.int32),
              k_descale=torch.ones(3, 2))
    assert torch.equal(k_cache.view(torch.uint8), before.view(torch.uint8))


def test_fp8_kv_is_a_feature_of_the_support_matrix():
    bits = dispatch.feature_bits(-1, -1, 0.0, False, 0.0, True, False, decode=True, fp8_kv=True)
    assert "fp8_kv" in dispatch.call_spec(torch.device("cpu"), torch.bfloat16, 128, bits).features
    fp8_call = CallSpec("bfloat16", 128, 128, "cuda", frozenset({"forward", "decode", "gqa", "fp8_kv"}))
    assert matrix.check_call("cuda", probe.fake_device("h100"), fp8_call) == []
    assert matrix.check_call("rocm", probe.fake_device("mi300x"), fp8_call) == []  # the HIP decode (docs/rocm.md)
    assert matrix.check_call("cuda-sm90", probe.fake_device("h100"), fp8_call) != []
    assert matrix.check_call("reference", None, CallSpec("bfloat16", 72, 72, "cpu", fp8_call.features)) == []


# ---- flash_attn_varlen_func on FP8 keys and values (paged, as vLLM calls it, and packed) ----


def _varlen_fp8_case(page, paged, descales, seed=0):
    """Mixed prefill and decode rows over an e4m3 pool; returns the call's arguments and the
    dequantised float64 keys/values of each sequence."""
    torch.manual_seed(seed)
    heads, heads_k, dim = 8, 2, 32
    lens_q, lens_k = [5, 1, 1, 7], [40, 17, 1, 64]
    batch = len(lens_q)
    k_descale = torch.rand(batch, heads_k) * 0.5 + 0.1 if descales else None
    v_descale = torch.rand(batch, heads_k) * 2 + 0.5 if descales else None
    per = max(-(-n // page) for n in lens_k)
    pool_k = fp8_cache(batch * per + 3, page, heads_k, dim, 4.0)
    pool_v = fp8_cache(batch * per + 3, page, heads_k, dim)
    table = torch.randperm(batch * per + 3)[: batch * per].view(batch, per).to(torch.int32)
    keys, values = [], []
    for b, n in enumerate(lens_k):
        pos = torch.arange(n)
        pages, rows = table[b, pos // page].long(), pos % page
        scale_k = 1.0 if k_descale is None else k_descale[b].double()[None, :, None]
        scale_v = 1.0 if v_descale is None else v_descale[b].double()[None, :, None]
        keys.append(pool_k[pages, rows].double() * scale_k)
        values.append(pool_v[pages, rows].double() * scale_v)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), heads, dim, dtype=torch.bfloat16)
    if paged:
        args = dict(k=pool_k, v=pool_v, block_table=table, seqused_k=torch.tensor(lens_k, dtype=torch.int32),
                    cu_seqlens_k=None)
    else:
        packed = [torch.cat([pool.view(torch.uint8)[table[b, torch.arange(n) // page].long(), torch.arange(n) % page]
                             for b, n in enumerate(lens_k)]).view(FP8) for pool in (pool_k, pool_v)]
        args = dict(k=packed[0], v=packed[1], block_table=None, seqused_k=None, cu_seqlens_k=cu_k)
    return q, cu_q, cu_k, max(lens_q), max(lens_k), args, k_descale, v_descale, keys, values


@pytest.mark.parametrize("paged", [True, False], ids=["paged16", "packed"])
@pytest.mark.parametrize("descales", [True, False])
def test_varlen_on_fp8_keys_against_the_dequantised_oracle(paged, descales):
    q, cu_q, cu_k, max_q, max_k, args, k_descale, v_descale, keys, values = _varlen_fp8_case(16, paged, descales)
    with torch.no_grad():
        out = portattn.flash_attn_varlen_func(
            q, args["k"], args["v"], cu_q, args["cu_seqlens_k"], max_q, max_k, causal=True,
            block_table=args["block_table"], seqused_k=args["seqused_k"], k_descale=k_descale, v_descale=v_descale)
    keys_all, values_all = torch.cat(keys), torch.cat(values)
    want, _ = naive_attention(q, keys_all, values_all, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    low, _ = naive_attention(q, keys_all.to(q.dtype), values_all.to(q.dtype), causal=True, cu_seqlens_q=cu_q,
                             cu_seqlens_k=cu_k, compute_dtype=q.dtype)
    assert_output(out, want, low)


def test_varlen_fp8_arguments_are_checked():
    q, cu_q, cu_k, max_q, max_k, args, k_descale, v_descale, _, _ = _varlen_fp8_case(16, False, True)
    k, v = args["k"], args["v"]
    with pytest.raises(TypeError, match=r"q_descale scales an FP8 \(torch.float8_e4m3fn\) query"):
        portattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, q_descale=torch.ones(4, 2))
    with pytest.raises(ValueError, match=r"q_descale must have shape \(batch, nheads_k\) = \(4, 2\)"):
        portattn.flash_attn_varlen_func(q.to(FP8), k, v, cu_q, cu_k, max_q, max_k, q_descale=torch.ones(3, 2))
    with pytest.raises(ValueError, match=r"k_descale must have shape \(batch, nheads_k\) = \(4, 2\)"):
        portattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, k_descale=torch.ones(3, 2))
    with pytest.raises(ValueError, match="k_descale applies to FP8"):
        portattn.flash_attn_varlen_func(q, k.float().to(q.dtype), v.float().to(q.dtype), cu_q, cu_k, max_q, max_k,
                                        k_descale=k_descale)
    with pytest.raises(ValueError, match="inference only"):
        portattn.flash_attn_varlen_func(q.clone().requires_grad_(), k, v, cu_q, cu_k, max_q, max_k)
    with pytest.raises(TypeError, match="k and v must share one dtype"):
        portattn.flash_attn_varlen_func(q, k, v.float().to(q.dtype), cu_q, cu_k, max_q, max_k)


@pytest.mark.parametrize("append", [False, True], ids=["read", "append"])
def test_fp8_cache_under_torch_compile_matches_eager(append):
    """fullgraph=True through the kvcache custom ops, descales passed on: the eager call's numbers
    and cache writes, and a descale that differs changes the result (it is not dropped)."""
    torch.manual_seed(2)
    batch, heads, heads_k, dim, capacity, new = 2, 4, 2, 16, 32, 2
    q = torch.randn(batch, new, heads, dim, dtype=torch.bfloat16)
    k_new = torch.randn(batch, new, heads_k, dim, dtype=torch.bfloat16) if append else None
    v_new = torch.randn(batch, new, heads_k, dim, dtype=torch.bfloat16) if append else None
    k_descale = torch.rand(batch, heads_k) + 0.5
    v_descale = torch.rand(batch, heads_k) + 0.5
    seqlens = torch.tensor([5, 20], dtype=torch.int32)
    caches = fp8_cache(batch, capacity, heads_k, dim), fp8_cache(batch, capacity, heads_k, dim)

    def step(q, k_cache, v_cache, k_descale, v_descale):
        return portattn.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=seqlens,
                                                causal=True, k_descale=k_descale, v_descale=v_descale)

    eager_caches = [c.clone() for c in caches]
    compiled_caches = [c.clone() for c in caches]
    want = step(q, *eager_caches, k_descale, v_descale)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(q, *compiled_caches, k_descale, v_descale)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for mine, theirs in zip(compiled_caches, eager_caches):
        assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))
    if not append:
        other = compiled(q, *compiled_caches, k_descale * 2, v_descale)
        assert (other - got).abs().max() > 1e-2


@pytest.mark.parametrize("paged", [True, False], ids=["paged16", "packed"])
def test_fp8_varlen_under_torch_compile_matches_eager(paged):
    """flash_attn_varlen_func on FP8 keys under fullgraph=True (paged: the portattn::paged_varlen
    custom op; packed: the traced dequantisation): the eager call's numbers and LSE, a changed
    descale changes the result, and `out=` is filled."""
    q, cu_q, cu_k, max_q, max_k, args, k_descale, v_descale, _, _ = _varlen_fp8_case(17, paged, True)

    def call(q, k, v, k_descale, v_descale, out=None):
        return portattn.flash_attn_varlen_func(
            q, k, v, cu_q, args["cu_seqlens_k"], max_q, max_k, causal=True, return_attn_probs=True,
            block_table=args["block_table"], seqused_k=args["seqused_k"], k_descale=k_descale, v_descale=v_descale,
            out=out)

    with torch.no_grad():
        want, want_lse, _ = call(q, args["k"], args["v"], k_descale, v_descale)
        torch._dynamo.reset()
        compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
        got, got_lse, _ = compiled(q, args["k"], args["v"], k_descale, v_descale)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(got_lse, want_lse, rtol=0, atol=0)
        other, _, _ = compiled(q, args["k"], args["v"], k_descale * 2, v_descale)
        assert (other.float() - got.float()).abs().max() > 1e-2
        target = torch.full_like(q, float("nan"))
        filled, _, _ = compiled(q, args["k"], args["v"], k_descale, v_descale, out=target)
        assert filled.data_ptr() == target.data_ptr()
        torch.testing.assert_close(target, want, rtol=0, atol=0)


def test_paged_varlen_under_torch_compile_checks_values_at_run_time():
    """A block-table page outside the pool raises the eager call's ValueError from the compiled call
    too (the CPU value check runs inside the custom op, where dynamo does not trace it)."""
    q, cu_q, cu_k, max_q, max_k, args, k_descale, v_descale, _, _ = _varlen_fp8_case(18, True, True)
    table = args["block_table"].clone()
    table[1, 0] = args["k"].shape[0]

    def call(q, table):
        return portattn.flash_attn_varlen_func(q, args["k"], args["v"], cu_q, None, max_q, max_k, causal=True,
                                               block_table=table, seqused_k=args["seqused_k"],
                                               k_descale=k_descale, v_descale=v_descale)

    torch._dynamo.reset()
    with torch.no_grad():
        with pytest.raises(ValueError, match="block_table") as eager:
            call(q, table)
        with pytest.raises(ValueError, match="block_table") as compiled:
            torch.compile(call, fullgraph=True, backend="aot_eager")(q, table)
    assert str(compiled.value) == str(eager.value)


def fp8_query(batch, seqlen, heads, dim, heads_k):
    """An e4m3 query and its descale (batch, heads_k), with the float64 query it stands for."""
    q = (torch.randn(batch, seqlen, heads, dim) * 8).clamp(-448, 448).to(FP8)
    q_descale = torch.rand(batch, heads_k) * 0.2 + 0.05
    per_head = q_descale.double().repeat_interleave(heads // heads_k, dim=1)
    return q, q_descale, q.double() * per_head[:, None, :, None]


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("append", [False, True], ids=["read", "append"])
def test_fp8_query_against_the_dequantised_oracle(paged, append):
    """FlashAttention-3's FP8 query: q * q_descale[b, hk] attends the dequantised cache; the output
    is bfloat16, within the error rule of the same attention on bfloat16 inputs, and the appended
    rows are quantised with k_descale / v_descale alone."""
    torch.manual_seed(3)
    batch, heads, heads_k, dim, capacity, page, new = 3, 8, 2, 32, 48, 16, 2 if append else 0
    q, q_descale, q_real = fp8_query(batch, new or 1, heads, dim, heads_k)
    k_cache, v_cache = fp8_cache(batch, capacity, heads_k, dim, 4.0), fp8_cache(batch, capacity, heads_k, dim)
    k_descale, v_descale = torch.rand(batch, heads_k) * 0.5 + 0.1, torch.rand(batch, heads_k) * 2 + 0.5
    seqlens = torch.tensor([1, 30, 40], dtype=torch.int32)
    k_new = torch.randn(batch, new, heads_k, dim, dtype=torch.bfloat16) if append else None
    v_new = torch.randn(batch, new, heads_k, dim, dtype=torch.bfloat16) if append else None
    block_table = None
    if paged:
        block_table = torch.randperm(batch * capacity // page).reshape(batch, capacity // page).to(torch.int32)
        pool = [torch.empty(batch * capacity // page, page, heads_k, dim, dtype=FP8) for _ in range(2)]
        rows = (block_table.long()[:, :, None] * page + torch.arange(page)).flatten()
        for target, dense in zip(pool, (k_cache, v_cache)):
            target.view(-1, heads_k, dim)[rows] = dense.reshape(-1, heads_k, dim)
        k_cache, v_cache = pool
    out = portattn.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=seqlens,
                                           block_table=block_table, causal=True, k_descale=k_descale,
                                           v_descale=v_descale, q_descale=q_descale)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    dense_k, dense_v = k_cache, v_cache
    if paged:
        dense_k, dense_v = (c.view(-1, heads_k, dim)[rows].view(batch, capacity, heads_k, dim) for c in (k_cache, v_cache))
    if append:
        for b in range(batch):
            n = int(seqlens[b])
            assert torch.equal(dense_k[b, n : n + new].view(torch.uint8),
                               quantize_fp8(k_new[b : b + 1], k_descale[b : b + 1])[0].view(torch.uint8))
    keys, values = dequantised(dense_k, k_descale), dequantised(dense_v, v_descale)
    for b in range(batch):
        n = int(seqlens[b]) + new
        want = naive_attention(q_real[b : b + 1], keys[b : b + 1, :n], values[b : b + 1, :n], causal=True)[0]
        low = naive_attention(q_real[b : b + 1].to(torch.bfloat16), keys[b : b + 1, :n].to(torch.bfloat16),
                              values[b : b + 1, :n].to(torch.bfloat16), causal=True, compute_dtype=torch.bfloat16)[0]
        assert_output(out[b : b + 1], want, low)


def test_fp8_query_without_q_descale_is_its_e4m3_values():
    torch.manual_seed(4)
    q, _, _ = fp8_query(2, 1, 4, 16, 2)
    k_cache, v_cache = fp8_cache(2, 8, 2, 16), fp8_cache(2, 8, 2, 16)
    got = portattn.flash_attn_with_kvcache(q, k_cache, v_cache)
    assert torch.equal(got, portattn.flash_attn_with_kvcache(q.to(torch.bfloat16), k_cache, v_cache))


@pytest.mark.parametrize("paged", [True, False], ids=["paged16", "packed"])
def test_varlen_fp8_query_against_the_dequantised_oracle(paged):
    q, cu_q, cu_k, max_q, max_k, args, k_descale, v_descale, keys, values = _varlen_fp8_case(19, paged, True)
    batch, heads_k = k_descale.shape
    q8 = (q.float() * 8).clamp(-448, 448).to(FP8)
    q_descale = torch.rand(batch, heads_k) * 0.2 + 0.05
    owner = torch.repeat_interleave(torch.arange(batch), cu_q.diff().long())
    q_real = q8.double() * q_descale.double().repeat_interleave(q.shape[1] // heads_k, dim=1)[owner][:, :, None]
    with torch.no_grad():
        out = portattn.flash_attn_varlen_func(
            q8, args["k"], args["v"], cu_q, args["cu_seqlens_k"], max_q, max_k, causal=True,
            block_table=args["block_table"], seqused_k=args["seqused_k"], k_descale=k_descale, v_descale=v_descale,
            q_descale=q_descale)
    assert out.dtype == torch.bfloat16
    keys_all, values_all = torch.cat(keys), torch.cat(values)
    want, _ = naive_attention(q_real, keys_all, values_all, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    low, _ = naive_attention(q_real.to(torch.bfloat16), keys_all.to(torch.bfloat16), values_all.to(torch.bfloat16),
                             causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, compute_dtype=torch.bfloat16)
    assert_output(out, want, low)


def test_fp8_query_under_torch_compile_matches_eager():
    """fullgraph=True with an FP8 query: the eager call's numbers, and q_descale is not dropped."""
    torch.manual_seed(5)
    batch, heads, heads_k, dim, capacity = 2, 4, 2, 16, 32
    q, q_descale, _ = fp8_query(batch, 1, heads, dim, heads_k)
    k_cache, v_cache = fp8_cache(batch, capacity, heads_k, dim), fp8_cache(batch, capacity, heads_k, dim)
    k_descale = torch.rand(batch, heads_k) + 0.5
    seqlens = torch.tensor([5, 20], dtype=torch.int32)

    def step(q, q_descale):
        return portattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, k_descale=k_descale,
                                                q_descale=q_descale)

    want = step(q, q_descale)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(q, q_descale)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (compiled(q, q_descale * 2).float() - got.float()).abs().max() > 1e-2
