"""The serving surface on the CUDA kernels (bf16), against the float64 oracle by the error rule:
seqused_k (varlen forward and backward on the sm80+ kernels), attention sinks (dense and
varlen, forward and gradients, on whichever kernels dispatch picks; decode), paged varlen with
16-token pages, K and V as strided views of one buffer, mixed prefill and decode rows, out=,
CUDA-graph capture of a paged step with changing seqused_k, and the same step under
torch.compile (fullgraph, reduce-overhead). The CPU side is
tests/test_serving_surface.py.
"""
from __future__ import annotations

import pytest
import torch

from error_rule import assert_grads, assert_lse, assert_output, assert_sink_grad, sink_grad_from
from naive import naive_attention

pytestmark = pytest.mark.gpu

from cuda_gpu_setup import cuda_backend  # noqa: E402  (skips without a GPU)

import portattn  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16
F64 = torch.float64


def rand(*shape, grad=False, scale=1.0):
    return (scale * torch.randn(*shape, device=DEV, dtype=BF16)).requires_grad_(grad)


def oracle_pair(fn, *tensors):
    hi = [t.detach().to(F64).requires_grad_(t.requires_grad) for t in tensors]
    lo = [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
    return (fn(*hi, compute_dtype=F64), hi), (fn(*lo, compute_dtype=BF16), lo)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_seqused_k_forward_and_backward(head_dim, causal):
    lengths_q, lengths_k, used = [130, 1, 257, 64], [300, 40, 257, 512], [211, 0, 257, 500]
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    seqused = torch.tensor(used, dtype=torch.int32, device=DEV)
    q = rand(sum(lengths_q), 8, head_dim, grad=True)
    k, v = rand(sum(lengths_k), 2, head_dim, grad=True), rand(sum(lengths_k), 2, head_dim, grad=True)
    out, lse, _ = portattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                                                  return_attn_probs=True, seqused_k=seqused)

    def fn(q, k, v, compute_dtype):
        return naive_attention(q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=seqused,
                               compute_dtype=compute_dtype)

    ((want, want_lse), hi), ((low, _), lo) = oracle_pair(fn, q, k, v)
    assert_output(out, want, low)
    fp32_lse = fn(q.float(), k.float(), v.float(), compute_dtype=torch.float32)[1]
    assert_lse(lse, want_lse, fp32_lse)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    assert_grads(got, torch.autograd.grad(want, hi, dout.to(F64)), torch.autograd.grad(low, lo, dout))
    assert torch.equal(got[1][211:300], torch.zeros_like(got[1][211:300]))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_sinks_forward_and_gradients(head_dim, causal):
    q = rand(2, 300, 8, head_dim, grad=True)
    k, v = rand(2, 300, 2, head_dim, grad=True), rand(2, 300, 2, head_dim, grad=True)
    sinks = (2 * torch.randn(8, device=DEV)).requires_grad_()
    out, lse, _ = portattn.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, s_aux=sinks)

    def fn(q, k, v, s, compute_dtype):
        return naive_attention(q, k, v, causal=causal, sinks=s, compute_dtype=compute_dtype)

    ((want, want_lse), hi), ((low, _), lo) = oracle_pair(fn, q, k, v, sinks)
    assert_output(out, want, low)
    fp32_lse = fn(q.float(), k.float(), v.float(), sinks.float(), compute_dtype=torch.float32)[1]
    assert_lse(lse, want_lse, fp32_lse)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, sinks), dout)
    oracle = torch.autograd.grad(want, hi, dout.to(F64))
    lowp = torch.autograd.grad(low, lo, dout)
    assert_grads(got[:3], oracle[:3], lowp[:3])
    assert_sink_grad(got[3], oracle[3], lowp[3], sink_grad_from(low, fp32_lse, dout, sinks.detach()))


def _paged(page=16, nheads=32, nheads_k=8, dim=128, query_lengths=(200, 1, 1, 5, 1), key_lengths=(700, 33, 1, 2048, 16)):
    batch = len(query_lengths)
    per_seq = max(-(-n // page) for n in key_lengths)
    blocks = batch * per_seq + 7
    pool = torch.randn(blocks, nheads_k, page, 2 * dim, device=DEV, dtype=BF16)  # vLLM's recent layout
    k_cache = pool[..., :dim].transpose(1, 2)  # (blocks, page, nheads_k, dim), strided views
    v_cache = pool[..., dim:].transpose(1, 2)
    table = torch.randperm(blocks, device=DEV)[: batch * per_seq].view(batch, per_seq).to(torch.int32)
    cu_q = torch.tensor([0, *torch.tensor(query_lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    q = torch.randn(int(cu_q[-1]), nheads, dim, device=DEV, dtype=BF16)
    used = torch.tensor(key_lengths, dtype=torch.int32, device=DEV)
    return q, k_cache, v_cache, table, cu_q, used


def _gathered(k_cache, v_cache, table, used):
    page = k_cache.shape[1]
    keys, values = [], []
    for b, n in enumerate(used.tolist()):
        pos = torch.arange(n, device=DEV)
        pages, rows = table[b, pos // page].long(), pos % page
        keys.append(k_cache[pages, rows])
        values.append(v_cache[pages, rows])
    cu_k = torch.tensor([0, *used.cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    return torch.cat(keys), torch.cat(values), cu_k


@pytest.mark.parametrize("sinks", [False, True])
def test_paged_varlen_seqused_k_mixed_rows_strided_views_and_out(sinks):
    q, k_cache, v_cache, table, cu_q, used = _paged()
    s_aux = torch.randn(q.shape[1], device=DEV) if sinks else None
    out = torch.full_like(q, float("nan"))
    with torch.no_grad():
        got = portattn.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, max_seqlen_q=200, max_seqlen_k=2048,
                                              causal=True, block_table=table, seqused_k=used, out=out, s_aux=s_aux)
    assert got is out
    keys, values, cu_k = _gathered(k_cache, v_cache, table, used)
    want, _ = naive_attention(q, keys, values, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, sinks=s_aux)
    low, _ = naive_attention(q, keys, values, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, sinks=s_aux,
                             compute_dtype=BF16)
    assert_output(out, want, low)


def test_paged_varlen_step_replays_in_a_cuda_graph_with_new_lengths():
    q, k_cache, v_cache, table, cu_q, used = _paged(query_lengths=(1, 1, 1, 1, 1))
    sinks = torch.randn(q.shape[1], device=DEV)
    out = torch.empty_like(q)

    def step():
        portattn.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, max_seqlen_q=1, max_seqlen_k=2048, causal=True,
                                        block_table=table, seqused_k=used, out=out, s_aux=sinks)

    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # warm-up outside the capture (plans, the error buffer)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for lengths in ([5, 900, 17, 2048, 1], [1, 1, 1, 1, 1], [64, 64, 1000, 3, 16]):
            used.copy_(torch.tensor(lengths, dtype=torch.int32))
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            keys, values, cu_k = _gathered(k_cache, v_cache, table, used)
            want, _ = naive_attention(q, keys, values, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, sinks=sinks)
            low, _ = naive_attention(q, keys, values, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, sinks=sinks,
                                     compute_dtype=BF16)
            assert_output(out, want, low)


def test_kvcache_decode_with_sinks():
    q = rand(4, 1, 32, 128)
    k_cache, v_cache = rand(4, 4096, 8, 128), rand(4, 4096, 8, 128)
    lens = torch.tensor([4096, 1, 3000, 777], dtype=torch.int32, device=DEV)
    sinks = torch.randn(32, device=DEV)
    out, lse = portattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True, s_aux=sinks,
                                                return_softmax_lse=True)
    for b, n in enumerate(lens.tolist()):
        args = (q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n])
        want, want_lse = naive_attention(*args, causal=True, sinks=sinks)
        low, _ = naive_attention(*args, causal=True, sinks=sinks, compute_dtype=BF16)
        assert_output(out[b:b + 1], want, low)
        fp32 = naive_attention(*(a.float() for a in args), causal=True, sinks=sinks, compute_dtype=torch.float32)[1]
        assert_lse(lse[b:b + 1], want_lse, fp32)


@pytest.mark.skipif(torch.cuda.get_device_capability() < (8, 0), reason="the decode kernels need sm80+")
def test_paged_varlen_on_an_fp8_cache_replays_in_a_cuda_graph():
    # vLLM's FP8 layout: one e4m3 pool whose K and V halves are strided views, 16-token pages,
    # descales per (sequence, KV head), mixed prefill and decode rows. Graph capture proves the
    # pages are read in place (the gather path reads lengths on the host, which capture refuses).
    q, k_bf16, v_bf16, table, cu_q, used = _paged()
    dim = q.shape[-1]
    pool = torch.cat((k_bf16, v_bf16), dim=-1).to(torch.float8_e4m3fn)  # (blocks, page, Hk, 2 * dim)
    k_cache, v_cache = pool[..., :dim], pool[..., dim:]
    batch, heads_k = table.shape[0], k_cache.shape[2]
    k_descale = torch.rand(batch, heads_k, device=DEV) * 0.5 + 0.25
    v_descale = torch.rand(batch, heads_k, device=DEV) * 2 + 0.5
    out = torch.empty_like(q)

    def step():
        portattn.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, max_seqlen_q=200, max_seqlen_k=2048, causal=True,
                                        block_table=table, seqused_k=used, out=out, k_descale=k_descale,
                                        v_descale=v_descale)

    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    for lengths in ([700, 33, 1, 2048, 16], [201, 900, 17, 5, 1]):
        used.copy_(torch.tensor(lengths, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        keys, values, cu_k = _gathered(k_cache.view(torch.uint8), v_cache.view(torch.uint8), table, used)
        owner = torch.repeat_interleave(torch.arange(batch, device=DEV), used.long())
        keys = keys.view(torch.float8_e4m3fn).double() * k_descale.double()[owner][:, :, None]
        values = values.view(torch.float8_e4m3fn).double() * v_descale.double()[owner][:, :, None]
        want, _ = naive_attention(q, keys, values, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        low, _ = naive_attention(q, keys.to(BF16), values.to(BF16), causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                 compute_dtype=BF16)
        assert_output(out, want, low)


@pytest.mark.skipif(torch.cuda.get_device_capability() < (8, 0), reason="the decode kernels need sm80+")
@pytest.mark.parametrize("fp8", [False, True])
def test_paged_varlen_under_torch_compile_with_cuda_graphs(fp8):
    # A serving step compiled as vLLM compiles it (fullgraph, CUDA graphs from reduce-overhead):
    # the paged call is one custom op (portattn::paged_varlen) that reads the pages in place, and
    # out= is filled by the compiled graph. New seqused_k values between replays, no recompile.
    q, k_bf16, v_bf16, table, cu_q, used = _paged(query_lengths=(1, 1, 7, 1, 1))
    dim, batch = q.shape[-1], table.shape[0]
    scales = {}
    if fp8:
        pool = torch.cat((k_bf16, v_bf16), dim=-1).to(torch.float8_e4m3fn)
        k_cache, v_cache = pool[..., :dim], pool[..., dim:]
        scales = {"k_descale": torch.rand(batch, k_cache.shape[2], device=DEV) + 0.5,
                  "v_descale": torch.rand(batch, k_cache.shape[2], device=DEV) + 0.5}
    else:
        k_cache, v_cache = k_bf16, v_bf16
    out = torch.empty_like(q)

    def step(q, used, out):
        return portattn.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, max_seqlen_q=7, max_seqlen_k=2048,
                                               causal=True, block_table=table, seqused_k=used, out=out, **scales)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(step, fullgraph=True, mode="reduce-overhead")
    with torch.no_grad():
        for lengths in ([5, 900, 17, 2048, 1], [64, 64, 1000, 3, 16], [1, 1, 1, 1, 1]):
            used.copy_(torch.tensor(lengths, dtype=torch.int32))
            out.fill_(float("nan"))
            got = compiled(q, used, out)
            torch.cuda.synchronize()
            want_eager = step(q, used, torch.empty_like(q))
            torch.testing.assert_close(out, want_eager, rtol=0, atol=0)  # the same kernels, the same bits
            torch.testing.assert_close(got, want_eager, rtol=0, atol=0)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
