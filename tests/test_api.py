"""The public flash-attn-compatible API on CPU, against the float64 naive oracle."""
import math

import pytest
import torch

import portattn
from error_rule import assert_output
from naive import naive_attention
from portattn.backends.reference import philox_keep_mask


def rand(*shape, dtype=torch.float32, grad=False):
    t = torch.randn(*shape, dtype=dtype)
    return t.requires_grad_(grad)


def close(got, want, tol=2e-5):
    assert got.shape == want.shape
    assert torch.isfinite(got).all() or torch.isfinite(want).logical_not().any()
    err = (got.double() - want.double()).abs().max().item()
    assert err <= tol, err


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(-1, -1), (3, 2)])
def test_flash_attn_func_matches_naive(causal, window):
    q, k, v = rand(2, 9, 4, 16), rand(2, 13, 2, 16), rand(2, 13, 2, 16)
    slopes = torch.rand(4)
    out, lse, probs = portattn.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=5.0,
                                               alibi_slopes=slopes, return_attn_probs=True)
    want, want_lse = naive_attention(q, k, v, causal=causal, window=window, softcap=5.0, alibi_slopes=slopes)
    close(out, want)
    close(lse, want_lse)
    assert probs is None  # documented: probabilities are never materialised


def test_default_scale_and_custom_scale():
    q, k, v = rand(1, 5, 2, 32), rand(1, 7, 2, 32), rand(1, 7, 2, 32)
    close(portattn.flash_attn_func(q, k, v), naive_attention(q, k, v, scale=1 / math.sqrt(32))[0])
    close(portattn.flash_attn_func(q, k, v, softmax_scale=0.3), naive_attention(q, k, v, scale=0.3)[0])


def test_packed_variants_match_unpacked_and_backprop_into_pack():
    qkv = rand(2, 6, 3, 4, 8, grad=True)
    out = portattn.flash_attn_qkvpacked_func(qkv, causal=True)
    want = naive_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)[0]
    close(out, want)
    out.sum().backward()
    ref = qkv.detach().double().requires_grad_()
    naive_attention(ref[:, :, 0], ref[:, :, 1], ref[:, :, 2], causal=True)[0].sum().backward()
    close(qkv.grad, ref.grad, tol=1e-4)

    q, kv = rand(2, 6, 4, 8), rand(2, 5, 2, 2, 8)
    close(portattn.flash_attn_kvpacked_func(q, kv), naive_attention(q, kv[:, :, 0], kv[:, :, 1])[0])


def test_varlen_matches_naive_including_empty_sequences():
    cu_q = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 6, 6], dtype=torch.int32)
    q, k, v = rand(10, 4, 8), rand(6, 2, 8), rand(6, 2, 8)
    out, lse, _ = portattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 4, causal=True, return_attn_probs=True)
    want, want_lse = naive_attention(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    close(out, want)
    assert lse.shape == (4, 10)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    # The third sequence has no keys: zeros and lse = -inf, never NaN.
    assert torch.all(out[3:] == 0) and torch.all(lse[:, 3:] == float("-inf"))

    qkv = rand(10, 3, 2, 8)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    close(portattn.flash_attn_varlen_qkvpacked_func(qkv, cu, 6),
          naive_attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens_q=cu, cu_seqlens_k=cu)[0])
    kv = rand(6, 2, 2, 8)
    close(portattn.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, 7, 4),
          naive_attention(q, kv[:, 0], kv[:, 1], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)[0])


def test_gradients_flow_to_q_k_v_with_gqa():
    q, k, v = rand(1, 7, 4, 8, grad=True), rand(1, 9, 1, 8, grad=True), rand(1, 9, 1, 8, grad=True)
    portattn.flash_attn_func(q, k, v, causal=True, softcap=2.0).square().sum().backward()
    refs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    naive_attention(*refs, causal=True, softcap=2.0)[0].square().sum().backward()
    for got, want in zip((q, k, v), refs):
        close(got.grad, want.grad, tol=1e-4)


def test_dropout_is_reproducible_and_matches_the_philox_mask():
    q, k, v = rand(1, 8, 2, 8), rand(1, 8, 2, 8), rand(1, 8, 2, 8)
    torch.manual_seed(7)
    first = portattn.flash_attn_func(q, k, v, dropout_p=0.3)
    torch.manual_seed(7)
    second = portattn.flash_attn_func(q, k, v, dropout_p=0.3)
    assert torch.equal(first, second)
    torch.manual_seed(7)
    seed, offset = (int(x) for x in torch.randint(0, 2**62, (2,), dtype=torch.int64))
    mask = philox_keep_mask(seed, offset, torch.arange(2).reshape(1, 2), range(8), range(8), 0.3)
    close(first, naive_attention(q, k, v, dropout_mask=mask, dropout_p=0.3)[0])


def test_non_contiguous_last_dim_is_accepted():
    q = rand(1, 5, 2, 8).transpose(-1, -2).contiguous().transpose(-1, -2)  # stride(-1) != 1
    k, v = rand(1, 5, 2, 8), rand(1, 5, 2, 8)
    assert q.stride(-1) != 1
    close(portattn.flash_attn_func(q, k, v), naive_attention(q, k, v)[0])


def test_half_precision_inputs_on_cpu():
    q, k, v = (rand(1, 20, 2, 16).to(torch.bfloat16) for _ in range(3))
    out = portattn.flash_attn_func(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16
    want = naive_attention(q, k, v, causal=True)[0]
    low = naive_attention(q, k, v, causal=True, compute_dtype=torch.bfloat16)[0]
    assert_output(out, want, low)


def test_empty_inputs():
    q, k, v = rand(2, 0, 2, 8), rand(2, 4, 2, 8), rand(2, 4, 2, 8)
    assert portattn.flash_attn_func(q, k, v).shape == (2, 0, 2, 8)
    q, k, v = rand(2, 3, 2, 8), rand(2, 0, 2, 8), rand(2, 0, 2, 8)
    out, lse, _ = portattn.flash_attn_func(q, k, v, return_attn_probs=True)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))


def test_gradcheck_through_the_public_api():
    q, k, v = (torch.randn(1, 5, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    slopes = torch.rand(2)

    def f(q, k, v):
        return portattn.flash_attn_func(q, k, v, causal=True, softcap=3.0, alibi_slopes=slopes.float())

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_sm_margin_is_accepted_and_changes_nothing_on_the_reference_backend():
    """FlashAttention-3's sm_margin sizes persistent GPU grids only: the results are the same bits."""
    q, k, v = rand(2, 9, 4, 16, grad=True), rand(2, 11, 2, 16, grad=True), rand(2, 11, 2, 16, grad=True)
    results = []
    for margin in (0, 8, 131):
        out = portattn.flash_attn_func(q, k, v, causal=True, sm_margin=margin)
        out.sum().backward()
        results.append([out.detach()] + [t.grad.clone() for t in (q, k, v)])
        for t in (q, k, v):
            t.grad = None
    for got in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, results[0]))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    vq, vk = rand(9, 4, 16), rand(9, 2, 16)
    assert torch.equal(portattn.flash_attn_varlen_func(vq, vk, vk, cu, cu, 5, 5, sm_margin=8),
                       portattn.flash_attn_varlen_func(vq, vk, vk, cu, cu, 5, 5))
    cache = rand(2, 16, 2, 16)
    assert torch.equal(portattn.flash_attn_with_kvcache(q.detach()[:, :1], cache, cache, sm_margin=8),
                       portattn.flash_attn_with_kvcache(q.detach()[:, :1], cache, cache))


def test_sm_margin_reaches_the_backend_forward_and_backward(sm_margin_seen):
    seen = sm_margin_seen
    q = rand(1, 5, 2, 8, grad=True)
    portattn.flash_attn_func(q, q, q, sm_margin=7).sum().backward()
    with torch.no_grad():
        portattn.flash_attn_func(q, q, q, sm_margin=3)
    assert seen == [("forward", 7), ("backward", 7), ("forward", 3)]
