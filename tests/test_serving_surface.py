"""What serving engines and new models call: seqused_k, out=, attention sinks (s_aux), paged
varlen with small pages and K/V as strided views of one buffer. CPU (the reference backend),
against the float64 oracle by the error rule (tests/error_rule.py); the GPU kernels' side is
tests/gpu/test_serving_surface_gpu.py."""
import pytest
import torch

import portattn
from error_rule import assert_grads, assert_lse, assert_output
from naive import naive_attention
from portattn.flash_attn_interface import _flash_attn_varlen_forward

F64 = torch.float64


def rand(*shape, grad=False, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


def oracle_and_lowp(fn, *tensors):
    """fn on float64 copies (the oracle) and on float32 copies (PyTorch's own error)."""
    hi = [t.detach().to(F64).requires_grad_(t.requires_grad) for t in tensors]
    lo = [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
    return (fn(*hi, compute_dtype=F64), hi), (fn(*lo, compute_dtype=torch.float32), lo)


def grads_of(out, dout, tensors):
    return torch.autograd.grad(out, tensors, dout)


# ---- attention sinks ----------------------------------------------------------------


@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (True, (4, 0), 0.0), (False, (-1, -1), 3.0)])
def test_sinks_forward_and_gradients_match_the_oracle(causal, window, softcap):
    q, k, v = rand(2, 9, 4, 16, grad=True), rand(2, 13, 2, 16, grad=True), rand(2, 13, 2, 16, grad=True)
    sinks = (2 * torch.randn(4)).requires_grad_()
    out, lse, _ = portattn.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                           return_attn_probs=True, s_aux=sinks)

    def fn(q, k, v, s, compute_dtype):
        return naive_attention(q, k, v, causal=causal, window=window, softcap=softcap, sinks=s,
                               compute_dtype=compute_dtype)

    ((want, want_lse), hi), ((low, low_lse), lo) = oracle_and_lowp(fn, q, k, v, sinks)
    assert_output(out, want, low)
    assert_lse(lse, want_lse, low_lse)
    dout = torch.randn_like(out)
    got = grads_of(out, dout, (q, k, v, sinks))
    oracle = grads_of(want, dout.to(F64), hi)
    lowp = grads_of(low, dout, lo)
    assert_grads(got, oracle, lowp, names=("dq", "dk", "dv", "ds_aux"))


def test_sinks_change_the_result_and_a_row_without_keys_sees_only_the_sink():
    # Sequence 1 has no keys: out 0 and lse = s_aux; the others are damped by the sink.
    cu_q = torch.tensor([0, 3, 5, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 6, 11], dtype=torch.int32)
    q, k, v = rand(9, 4, 8), rand(11, 4, 8), rand(11, 4, 8)
    sinks = torch.tensor([0.5, -1.0, 3.0, 0.0])
    out, lse, _ = portattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 6, return_attn_probs=True,
                                                  s_aux=sinks)
    want, want_lse = naive_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, sinks=sinks)
    low, low_lse = naive_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, sinks=sinks,
                                   compute_dtype=torch.float32)
    assert_output(out, want, low)
    assert_lse(lse, want_lse, low_lse)
    assert torch.equal(out[3:5], torch.zeros_like(out[3:5]))
    assert torch.allclose(lse[:, 3:5], sinks[:, None].expand(4, 2))
    plain = portattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 6)
    assert (plain[:3] - out[:3]).abs().max() > 1e-3  # the sink is not a no-op


def test_sinks_under_torch_compile_match_eager_with_gradients():
    q, k, v = rand(1, 6, 2, 8, grad=True), rand(1, 6, 2, 8, grad=True), rand(1, 6, 2, 8, grad=True)
    sinks = torch.randn(2).requires_grad_()

    def step(q, k, v, s):
        return portattn.flash_attn_func(q, k, v, causal=True, s_aux=s)

    eager = step(q, k, v, sinks)
    eager_grads = torch.autograd.grad(eager.sum(), (q, k, v, sinks))
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, sinks)
    compiled_grads = torch.autograd.grad(compiled.sum(), (q, k, v, sinks))
    torch.testing.assert_close(compiled, eager)
    for got, want in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(got, want)


def test_bad_sinks_are_clear_errors():
    q, k, v = rand(1, 4, 4, 8), rand(1, 4, 2, 8), rand(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"s_aux must have shape \(nheads,\) = \(4,\)"):
        portattn.flash_attn_func(q, k, v, s_aux=torch.zeros(2))
    with pytest.raises(TypeError, match="s_aux must be a floating-point"):
        portattn.flash_attn_func(q, k, v, s_aux=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(TypeError, match="s_aux must be a torch.Tensor"):
        portattn.flash_attn_func(q, k, v, s_aux=[0.0] * 4)


# ---- seqused_k -----------------------------------------------------------------------


def test_seqused_k_uses_the_first_keys_of_each_sequence_forward_and_backward():
    cu_q = torch.tensor([0, 4, 5, 12], dtype=torch.int32)
    cu_k = torch.tensor([0, 10, 17, 30], dtype=torch.int32)
    used = torch.tensor([6, 0, 13], dtype=torch.int32)
    q, k, v = rand(12, 4, 16, grad=True), rand(30, 2, 16, grad=True), rand(30, 2, 16, grad=True)
    out, lse, _ = portattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 13, causal=True,
                                                  return_attn_probs=True, seqused_k=used)

    def fn(q, k, v, compute_dtype):
        return naive_attention(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used,
                               compute_dtype=compute_dtype)

    ((want, want_lse), hi), ((low, low_lse), lo) = oracle_and_lowp(fn, q, k, v)
    assert_output(out, want, low)
    assert_lse(lse, want_lse, low_lse)
    dout = torch.randn_like(out)
    got = grads_of(out, dout, (q, k, v))
    assert_grads(got, grads_of(want, dout.to(F64), hi), grads_of(low, dout, lo))
    for grad in got[1:]:  # keys past seqused_k take no part: their gradients are 0
        assert torch.equal(grad[6:10], torch.zeros_like(grad[6:10]))
        assert torch.equal(grad[10:17], torch.zeros_like(grad[10:17]))


def test_seqused_k_through_the_low_level_forward():
    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    used = torch.tensor([3, 4], dtype=torch.int32)
    q, k, v = rand(9, 2, 8), rand(9, 2, 8), rand(9, 2, 8)
    out, lse, _, _ = _flash_attn_varlen_forward(q, k, v, cu, cu, 5, 5, 0.0, None, False, seqused_k=used)
    want, _ = naive_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, seqused_k=used)
    low, _ = naive_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, seqused_k=used,
                             compute_dtype=torch.float32)
    assert_output(out, want, low)
    with pytest.raises(ValueError, match="leftpad_k"):
        _flash_attn_varlen_forward(q, k, v, cu, cu, 5, 5, 0.0, None, False, leftpad_k=used)


@pytest.mark.parametrize("bad,match", [
    (torch.tensor([6, -1], dtype=torch.int32), r"seqused_k\[1\] = -1 is out of range: it must be in \[0, 4\]"),
    (torch.tensor([7, 0], dtype=torch.int32), r"seqused_k\[0\] = 7 is out of range: it must be in \[0, 6\]"),
    (torch.tensor([1, 1], dtype=torch.int64), "seqused_k must be an int32 tensor of shape"),
    (torch.tensor([1, 1, 1], dtype=torch.int32), r"shape \(batch,\) = \(2,\)"),
])
def test_bad_seqused_k_is_a_clear_error_on_the_cpu(bad, match):
    cu = torch.tensor([0, 6, 10], dtype=torch.int32)
    q, k, v = rand(10, 2, 8), rand(10, 2, 8), rand(10, 2, 8)
    with pytest.raises(ValueError, match=match):
        portattn.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, seqused_k=bad)


def test_varlen_without_cu_seqlens_k_needs_a_block_table():
    cu = torch.tensor([0, 3], dtype=torch.int32)
    q = rand(3, 2, 8)
    with pytest.raises(ValueError, match="cu_seqlens_k is required without block_table"):
        portattn.flash_attn_varlen_func(q, q, q, cu, None, 3, 3, seqused_k=torch.tensor([3], dtype=torch.int32))
    with pytest.raises(ValueError, match="max_seqlen_q and max_seqlen_k are required"):
        portattn.flash_attn_varlen_func(q, q, q, cu, cu)


# ---- out= ------------------------------------------------------------------------------


def test_out_is_written_in_place_and_returned():
    q, k, v = rand(2, 5, 4, 16), rand(2, 7, 2, 16), rand(2, 7, 2, 16)
    want = portattn.flash_attn_func(q, k, v, causal=True)
    out = torch.full_like(q, float("nan"))
    got = portattn.flash_attn_func(q, k, v, causal=True, out=out)
    assert got is out
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    # A strided view (every other head of a wider buffer): written through a temporary.
    wide = torch.full((2, 5, 8, 16), float("nan"))
    view = wide[:, :, ::2]
    assert portattn.flash_attn_func(q, k, v, causal=True, out=view) is view
    torch.testing.assert_close(view, want, rtol=0, atol=0)
    assert wide[:, :, 1::2].isnan().all()  # nothing outside the view was written


def test_out_in_varlen_and_kvcache_calls():
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q, k, v = rand(8, 4, 8), rand(8, 2, 8), rand(8, 2, 8)
    out = torch.full_like(q, float("nan"))
    got = portattn.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True, out=out)
    assert got is out
    torch.testing.assert_close(out, portattn.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True))
    qd, kc, vc = rand(2, 1, 4, 8), rand(2, 12, 2, 8), rand(2, 12, 2, 8)
    lens = torch.tensor([5, 12], dtype=torch.int32)
    outd = torch.full_like(qd, float("nan"))
    assert portattn.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens, out=outd) is outd
    torch.testing.assert_close(outd, portattn.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens))


def test_bad_out_is_a_clear_error():
    q, k, v = rand(1, 4, 2, 8, grad=True), rand(1, 4, 2, 8), rand(1, 4, 2, 8)
    with pytest.raises(ValueError, match="out= is for inference"):
        portattn.flash_attn_func(q, k, v, out=torch.empty(1, 4, 2, 8))
    with pytest.raises(ValueError, match="out must have q's shape, dtype and device"):
        portattn.flash_attn_func(q.detach(), k, v, out=torch.empty(1, 4, 2, 4))
    with pytest.raises(ValueError, match="out must have q's shape, dtype and device"):
        portattn.flash_attn_func(q.detach(), k, v, out=torch.empty(1, 4, 2, 8, dtype=torch.float64))


# ---- paged varlen as serving engines call it ---------------------------------------------


def _paged_problem(page=16, nheads=4, nheads_k=2, dim=16, query_lengths=(9, 1, 1, 3), key_lengths=(40, 17, 1, 33)):
    """A pool of pages in one (num_blocks, page, nheads_k, 2 * dim) buffer, K and V its two halves
    (strided views), a shuffled block table; mixed prefill and decode rows."""
    batch = len(query_lengths)
    blocks_per_seq = max(-(-n // page) for n in key_lengths)
    num_blocks = batch * blocks_per_seq + 3
    pool = torch.randn(num_blocks, page, nheads_k, 2 * dim)
    k_cache, v_cache = pool[..., :dim], pool[..., dim:]
    table = torch.randperm(num_blocks)[: batch * blocks_per_seq].view(batch, blocks_per_seq).to(torch.int32)
    cu_q = torch.tensor([0, *torch.tensor(query_lengths).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), nheads, dim)
    used = torch.tensor(key_lengths, dtype=torch.int32)
    # The keys each sequence sees, packed, for the oracle.
    keys, values = [], []
    for b, n in enumerate(key_lengths):
        rows = [(int(table[b, j // page]), j % page) for j in range(n)]
        keys.append(torch.stack([k_cache[p, r] for p, r in rows]))
        values.append(torch.stack([v_cache[p, r] for p, r in rows]))
    cu_k = torch.tensor([0, *torch.tensor(key_lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k_cache, v_cache, table, cu_q, used, torch.cat(keys), torch.cat(values), cu_k


@pytest.mark.parametrize("sinks", [False, True])
def test_paged_varlen_with_seqused_k_small_pages_and_strided_kv_views(sinks):
    q, k_cache, v_cache, table, cu_q, used, keys, values, cu_k = _paged_problem()
    assert not k_cache.is_contiguous() and k_cache.data_ptr() != v_cache.data_ptr()
    s_aux = torch.randn(q.shape[1]) if sinks else None
    out = torch.full_like(q, float("nan"))
    got = portattn.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, max_seqlen_q=9, max_seqlen_k=40,
                                          causal=True, block_table=table, seqused_k=used, out=out, s_aux=s_aux)
    assert got is out
    want, _ = naive_attention(q, keys, values, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, sinks=s_aux)
    low, _ = naive_attention(q, keys, values, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, sinks=s_aux,
                             compute_dtype=torch.float32)
    assert_output(out, want, low)


def test_paged_seqused_k_past_the_block_table_is_a_clear_error_on_the_cpu():
    q, k_cache, v_cache, table, cu_q, used, *_ = _paged_problem()
    used[2] = table.shape[1] * 16 + 1
    with pytest.raises(ValueError, match=r"seqused_k\[2\] = 49 is out of range"):
        portattn.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, max_seqlen_q=9, max_seqlen_k=40,
                                        block_table=table, seqused_k=used)


def test_kvcache_with_sinks_matches_the_oracle():
    q, kc, vc = rand(2, 2, 4, 8), rand(2, 10, 2, 8), rand(2, 10, 2, 8)
    lens = torch.tensor([4, 10], dtype=torch.int32)
    sinks = torch.randn(4)
    out, lse = portattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True, s_aux=sinks,
                                                return_softmax_lse=True)
    for b, n in enumerate(lens.tolist()):
        want, want_lse = naive_attention(q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], causal=True, sinks=sinks)
        low, low_lse = naive_attention(q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], causal=True, sinks=sinks,
                                       compute_dtype=torch.float32)
        assert_output(out[b:b + 1], want, low)
        assert_lse(lse[b:b + 1], want_lse, low_lse)


@pytest.mark.parametrize("entry", ["dense", "varlen", "kvcache"])
def test_out_under_torch_compile_fills_the_callers_buffer(entry):
    """`out=` traced with fullgraph=True: the result lands in the caller's tensor (returned as is),
    equal to the eager call's. The kernels' direct write needs the buffer's address, which a
    traced graph does not have, so the compiled call copies into it."""
    torch.manual_seed(21)
    q = torch.randn(2, 3, 4, 32, dtype=torch.bfloat16)
    k = torch.randn(2, 12, 2, 32, dtype=torch.bfloat16)
    v = torch.randn(2, 12, 2, 32, dtype=torch.bfloat16)
    cu_q = torch.tensor([0, 3, 6], dtype=torch.int32)
    cu_k = torch.tensor([0, 12, 24], dtype=torch.int32)
    lens = torch.tensor([7, 12], dtype=torch.int32)
    calls = {
        "dense": lambda q, out: portattn.flash_attn_func(q, k, v, causal=True, out=out),
        "varlen": lambda q, out: portattn.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                                                 cu_q, cu_k, 3, 12, causal=True, out=out),
        "kvcache": lambda q, out: portattn.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, causal=True, out=out),
    }
    call = calls[entry]
    shaped = q.flatten(0, 1) if entry == "varlen" else q
    with torch.no_grad():
        want = call(q, torch.empty_like(shaped))
        target = torch.full_like(shaped, float("nan"))
        torch._dynamo.reset()
        got = torch.compile(call, fullgraph=True, backend="aot_eager")(q, target)
    assert got.data_ptr() == target.data_ptr()
    torch.testing.assert_close(target, want, rtol=0, atol=0)
