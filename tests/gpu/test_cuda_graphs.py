"""CUDA-graph capture of training and inference calls (issue 12 item 4): a captured step,
replayed with new values written into its static inputs (cu_seqlens included), gives
what the same call gives eagerly, bit for bit (deterministic mode, so the backward's
reductions have one order). Decode steps have their own graph test in test_cuda_decode.py.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from cuda_gpu_setup import BACKEND  # noqa: E402,F401  (skips without a GPU)

import portattn  # noqa: E402


def capture(step):
    """A graph of `step` (warmed up on a side stream first, as torch's docs require) and its outputs."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


@pytest.mark.parametrize("head_dim", [64, 128, 96])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("varlen", [False, True])
def test_forward_and_backward_replay_like_eager(varlen, causal, head_dim):
    dtype, heads, heads_k = torch.bfloat16, 4, 2
    total, max_len = 256, 128
    if varlen:
        q = torch.randn(total, heads, head_dim, device="cuda", dtype=dtype, requires_grad=True)
        k = torch.randn(total, heads_k, head_dim, device="cuda", dtype=dtype, requires_grad=True)
        cu = torch.tensor([0, 100, 128, 128, 256], dtype=torch.int32, device="cuda")
    else:
        q = torch.randn(2, max_len, heads, head_dim, device="cuda", dtype=dtype, requires_grad=True)
        k = torch.randn(2, max_len, heads_k, head_dim, device="cuda", dtype=dtype, requires_grad=True)
        cu = None
    v = torch.randn_like(k, requires_grad=True)
    dout = torch.randn_like(q, requires_grad=False)

    def step():
        if varlen:
            out = portattn.flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=causal,
                                                  deterministic=True)
        else:
            out = portattn.flash_attn_func(q, k, v, causal=causal, deterministic=True)
        return (out.detach(),) + torch.autograd.grad(out, (q, k, v), dout)

    graph, static = capture(step)
    for lengths in ([64, 64, 100, 28], [0, 128, 1, 127], [100, 28, 0, 128]):
        with torch.no_grad():
            for t in (q, k, v, dout):
                t.copy_(torch.randn_like(t))
            if varlen:
                cu.copy_(torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        want = step()
        for name, got, expected in zip(("out", "dq", "dk", "dv"), static, want):
            assert not got.isnan().any(), f"{name} has NaN after replay"
            assert torch.equal(got, expected), f"{name} after replay differs from the eager call"


def test_kvcache_step_replays_in_place():
    """flash_attn_with_kvcache appends in place: a replayed step writes the new token at the
    current cache_seqlens, as the eager call does."""
    dtype = torch.float16
    k_cache = torch.randn(2, 512, 2, 64, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(2, 1, 8, 64, device="cuda", dtype=dtype)
    k_new, v_new = torch.randn(2, 1, 2, 64, device="cuda", dtype=dtype), torch.randn(2, 1, 2, 64, device="cuda", dtype=dtype)
    seqlens = torch.tensor([10, 300], dtype=torch.int32, device="cuda")
    step = lambda: portattn.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=seqlens,
                                                    causal=True)
    graph, out = capture(step)
    for lengths in ([11, 301], [500, 0]):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        k_new.copy_(torch.randn_like(k_new))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(k_cache[0, lengths[0], :, :], k_new[0, 0])
        # An eager call this short runs unsplit while the captured one keeps its splits
        # (decode.EAGER_UNSPLIT_MAX_KEYS, docs/decode.md): the same attention in another
        # reduction order, equal to within a few fp16 ulps, not bitwise.
        torch.testing.assert_close(out, step(), atol=2e-3, rtol=2e-3)


def test_dropout_under_capture_draws_a_fresh_reproducible_mask_per_replay():
    """Under capture the dropout key is drawn on the device (portattn/rng.py) and read by the
    kernels: each replay gets a new mask, the same sequence again after the same
    torch.cuda.manual_seed, and the kernels' output is the reference's for the key the
    replay drew (flash_attn_interface returns it as rng_state); the backward reuses it."""
    from naive import naive_attention

    from portattn.backends.reference import philox_keep_mask
    from portattn.flash_attn_interface import _flash_attn_backward, _flash_attn_forward

    dtype, p, batch, heads, seqlen, head_dim = torch.bfloat16, 0.3, 2, 3, 200, 64
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=dtype) for _ in range(3))
    dout = torch.randn_like(q)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    scale = head_dim ** -0.5

    def step():
        out, lse, _, rng_state = _flash_attn_forward(q, k, v, p, scale, True, -1, 0, 0.0, None, False)
        _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, p, scale, True, -1, 0, 0.0, None, False,
                             rng_state)
        return out, rng_state

    graph, (out, rng_state) = capture(step)
    assert rng_state.is_cuda, "under capture the dropout key lives on the device"
    torch.cuda.manual_seed(1234)
    outputs, states = [], []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        outputs.append(out.clone())
        states.append(rng_state.clone())
        seed, offset = (int(x) for x in rng_state.tolist())
        bh = torch.arange(batch * heads, device="cuda").reshape(batch, heads)
        mask = philox_keep_mask(seed, offset, bh, range(seqlen), range(seqlen), p, device="cuda")
        ref, _ = naive_attention(q, k, v, causal=True, dropout_mask=mask, dropout_p=p)
        low, _ = naive_attention(q, k, v, causal=True, dropout_mask=mask, dropout_p=p, compute_dtype=dtype)
        err = (out.double() - ref).abs().max().item()
        base = (low.double() - ref).abs().max().item()
        assert err <= 2 * base + 1e-5, f"replayed dropout output: error {err:.3e} vs torch's {base:.3e}"
        assert not dq.isnan().any() and not dk.isnan().any() and not dv.isnan().any()
    assert not torch.equal(states[0], states[1]) and not torch.equal(outputs[0], outputs[1]), \
        "two replays drew the same dropout mask"
    torch.cuda.manual_seed(1234)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(rng_state, states[0]) and torch.equal(out, outputs[0]), \
        "the same seed did not reproduce the first replay's mask"
