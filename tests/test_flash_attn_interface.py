"""flash-attn 2.8's low-level interface (portattn.flash_attn_interface) on the reference backend."""
import inspect

import pytest
import torch

import portattn
from naive import naive_attention
from portattn import flash_attn_interface as fai

# flash-attn 2.8.3's signatures (flash_attn/flash_attn_interface.py): (name, default or REQUIRED),
# each followed by FlashAttention-3's sm_margin.
REQUIRED = inspect.Parameter.empty
SIGNATURES = {
    "_flash_attn_forward": [
        ("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED), ("dropout_p", REQUIRED),
        ("softmax_scale", REQUIRED), ("causal", REQUIRED), ("window_size_left", REQUIRED),
        ("window_size_right", REQUIRED), ("softcap", REQUIRED), ("alibi_slopes", REQUIRED),
        ("return_softmax", REQUIRED), ("sm_margin", 0)],
    "_flash_attn_varlen_forward": [
        ("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED), ("cu_seqlens_q", REQUIRED),
        ("cu_seqlens_k", REQUIRED), ("max_seqlen_q", REQUIRED), ("max_seqlen_k", REQUIRED),
        ("dropout_p", REQUIRED), ("softmax_scale", REQUIRED), ("causal", REQUIRED),
        ("window_size_left", -1), ("window_size_right", -1), ("softcap", 0.0),
        ("alibi_slopes", None), ("return_softmax", False), ("block_table", None),
        ("leftpad_k", None), ("seqused_k", None), ("zero_tensors", False),
        ("num_splits", 0), ("sm_margin", 0)],  # num_splits: flash-attn after 2.8.3
    "_flash_attn_backward": [
        ("dout", REQUIRED), ("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED), ("out", REQUIRED),
        ("softmax_lse", REQUIRED), ("dq", REQUIRED), ("dk", REQUIRED), ("dv", REQUIRED),
        ("dropout_p", REQUIRED), ("softmax_scale", REQUIRED), ("causal", REQUIRED),
        ("window_size_left", REQUIRED), ("window_size_right", REQUIRED), ("softcap", REQUIRED),
        ("alibi_slopes", REQUIRED), ("deterministic", REQUIRED), ("rng_state", None), ("sm_margin", 0)],
    "_flash_attn_varlen_backward": [
        ("dout", REQUIRED), ("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED), ("out", REQUIRED),
        ("softmax_lse", REQUIRED), ("dq", REQUIRED), ("dk", REQUIRED), ("dv", REQUIRED),
        ("cu_seqlens_q", REQUIRED), ("cu_seqlens_k", REQUIRED), ("max_seqlen_q", REQUIRED),
        ("max_seqlen_k", REQUIRED), ("dropout_p", REQUIRED), ("softmax_scale", REQUIRED),
        ("causal", REQUIRED), ("window_size_left", REQUIRED), ("window_size_right", REQUIRED),
        ("softcap", REQUIRED), ("alibi_slopes", REQUIRED), ("deterministic", REQUIRED),
        ("rng_state", None), ("zero_tensors", False), ("sm_margin", 0)],
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signatures_are_flash_attn_2_8(name):
    function = getattr(fai, name)
    assert inspect.isfunction(function)  # ring-flash-attn reads getfullargspec of plain functions
    got = [(p.name, p.default) for p in inspect.signature(function).parameters.values()]
    assert got == SIGNATURES[name]


def test_public_names_are_reexported():
    for name in ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache",
                 "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
                 "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func"):
        assert getattr(fai, name) is getattr(portattn, name)


def rand(*shape):
    return torch.randn(*shape, dtype=torch.float32)


def naive_grads(q, k, v, dout, **options):
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    out, lse = naive_attention(*leaves, **options)
    out.backward(dout.double())
    return out.detach(), lse.detach(), [t.grad for t in leaves]


def assert_close(got, want, tol=2e-5):
    assert got.shape == want.shape
    got, want = got.double(), want.double()
    # Rows that see no key have lse -inf on both sides: equal, not NaN apart.
    err = torch.where(got == want, 0.0, got - want).abs().max().item()
    assert err <= tol, err


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (3, 1))])
def test_forward_returns_flash_attn_tuple(causal, window):
    q, k, v = rand(2, 7, 4, 16), rand(2, 9, 2, 16), rand(2, 9, 2, 16)
    out, lse, s_dmask, rng_state = fai._flash_attn_forward(
        q, k, v, 0.0, None, causal, window[0], window[1], 2.0, None, False)
    want, want_lse = naive_attention(q, k, v, causal=causal, window=window, softcap=2.0)
    assert_close(out, want)
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 7)
    assert_close(lse, want_lse)
    assert s_dmask.numel() == 0  # documented: never materialised
    assert rng_state.dtype == torch.int64 and rng_state.shape == (2,)
    assert not out.requires_grad


def test_backward_uses_given_out_lse_and_writes_strided_grads():
    q, k, v, dout = rand(2, 7, 4, 16), rand(2, 9, 2, 16), rand(2, 9, 2, 16), rand(2, 7, 4, 16)
    want_out, want_lse, grads = naive_grads(q, k, v, dout, causal=True)
    # Non-contiguous destinations: every other channel of wider buffers, and a transposed view.
    dq_buffer = torch.full((2, 7, 4, 32), 7.0)
    dq = dq_buffer[..., ::2]
    dk = torch.empty(2, 2, 9, 16).transpose(1, 2)
    dv = torch.empty_like(v)
    # The backward must take out/lse from the caller: hand it the float64 oracle's.
    softmax_d = fai._flash_attn_backward(dout, q, k, v, want_out.float(), want_lse.float().transpose(1, 2).contiguous().transpose(1, 2),
                                         dq, dk, dv, 0.0, None, True, -1, -1, 0.0, None, False)
    for got, want in zip((dq, dk, dv), grads):
        assert_close(got, want, tol=1e-4)
    assert (dq_buffer[..., 1::2] == 7.0).all()  # nothing written outside the view
    assert softmax_d.shape == (2, 4, 7)
    assert_close(softmax_d, (dout.double() * want_out).sum(-1).transpose(1, 2), tol=1e-4)


def test_ring_merge_of_chunks_equals_whole_call():
    """What ring attention does: attend to K/V chunks, merge by LSE, then backward each
    chunk with the global out/lse; summed dq and per-chunk dk/dv equal the whole call's."""
    q, k, v, dout = rand(1, 12, 4, 16), rand(1, 12, 2, 16), rand(1, 12, 2, 16), rand(1, 12, 4, 16)
    want_out, _, grads = naive_grads(q, k, v, dout)
    pieces = [fai._flash_attn_forward(q, k[:, j:j + 4], v[:, j:j + 4], 0.0, None, False, -1, -1,
                                      0.0, None, False)[:2] for j in (0, 4, 8)]
    lse = torch.logsumexp(torch.stack([p[1] for p in pieces]), dim=0)
    out = sum(p[0] * torch.exp(p[1] - lse).transpose(1, 2)[..., None] for p in pieces)
    assert_close(out, want_out, tol=1e-5)
    dq = torch.zeros_like(q)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    for j in (0, 4, 8):
        step_dq = torch.empty_like(q)
        fai._flash_attn_backward(dout, q, k[:, j:j + 4], v[:, j:j + 4], out, lse, step_dq,
                                 dk[:, j:j + 4], dv[:, j:j + 4], 0.0, None, False, -1, -1, 0.0,
                                 None, False)
        dq += step_dq
    for got, want in zip((dq, dk, dv), grads):
        assert_close(got, want, tol=1e-4)


def test_varlen_forward_and_backward_match_naive():
    cu_q = torch.tensor([0, 3, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 11], dtype=torch.int32)
    q, k, v, dout = rand(10, 4, 8), rand(11, 2, 8), rand(11, 2, 8), rand(10, 4, 8)
    out, lse, _, _ = fai._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 7, 6, 0.0, None, True)
    options = dict(causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    want_out, want_lse, grads = naive_grads(q, k, v, dout, **options)
    assert_close(out, want_out)
    assert lse.shape == (4, 10)
    assert_close(lse, want_lse)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    softmax_d = fai._flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k,
                                                7, 6, 0.0, None, True, -1, -1, 0.0, None, False)
    for got, want in zip((dq, dk, dv), grads):
        assert_close(got, want, tol=1e-4)
    assert softmax_d.shape == (4, 10)


def test_dropout_rng_state_reproduces_the_public_api_mask():
    q, k, v, dout = rand(1, 6, 2, 8), rand(1, 6, 2, 8), rand(1, 6, 2, 8), rand(1, 6, 2, 8)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(5)
    public = portattn.flash_attn_func(*leaves, dropout_p=0.4)
    public.backward(dout)
    torch.manual_seed(5)
    out, lse, _, rng_state = fai._flash_attn_forward(q, k, v, 0.4, None, False, -1, -1, 0.0, None, True)
    assert torch.equal(out, public.detach())
    grads = [torch.empty_like(t) for t in (q, k, v)]
    fai._flash_attn_backward(dout, q, k, v, out, lse, *grads, 0.4, None, False, -1, -1, 0.0, None,
                             False, rng_state=rng_state)
    for got, leaf in zip(grads, leaves):
        assert torch.allclose(got, leaf.grad, atol=1e-6)
    # A different mask (another rng_state) gives different gradients: the state matters.
    other = [torch.empty_like(t) for t in (q, k, v)]
    fai._flash_attn_backward(dout, q, k, v, out, lse, *other, 0.4, None, False, -1, -1, 0.0, None,
                             False, rng_state=rng_state + torch.tensor([0, 4]))
    assert not torch.allclose(other[0], grads[0])


def test_integer_like_window_sizes():
    q, k, v = rand(1, 8, 2, 8), rand(1, 8, 2, 8), rand(1, 8, 2, 8)
    want = naive_attention(q, k, v, window=(2, 1))[0]
    np = pytest.importorskip("numpy")
    for left, right in ((torch.tensor(2), torch.tensor(1)), (np.int64(2), np.int32(1))):
        out = fai._flash_attn_forward(q, k, v, 0.0, None, False, left, right, 0.0, None, False)[0]
        assert_close(out, want)


BAD_BACKWARD = [
    ("dq shape", dict(dq=torch.empty(2, 7, 4, 8)), ValueError, "dq must have the shape of q"),
    ("dk dtype", dict(dk=torch.empty(2, 9, 2, 16, dtype=torch.float64)), TypeError, "dk must have the dtype of k"),
    ("dout not tensor", dict(dout=1.0), TypeError, "dout must be a torch.Tensor"),
    ("out shape", dict(out=torch.empty(2, 7, 4, 8)), ValueError, "out must have the shape of q"),
    ("lse shape", dict(softmax_lse=torch.empty(2, 7, 4)), ValueError, "softmax_lse must have shape (batch, nheads, seqlen_q)"),
    ("lse dtype", dict(softmax_lse=torch.empty(2, 4, 7, dtype=torch.float16)), TypeError, "softmax_lse must be float32"),
    ("dropout without rng_state", dict(dropout_p=0.1), ValueError, "rng_state is required"),
    ("bad rng_state", dict(dropout_p=0.1, rng_state=torch.zeros(3, dtype=torch.int64)), ValueError, "rng_state must be the int64"),
    ("window float", dict(window_size_left=1.5), TypeError, "window_size left must be an int"),
    ("sm_margin negative", dict(sm_margin=-4), ValueError, "sm_margin must be an int >= 0"),
]


@pytest.mark.parametrize("case", BAD_BACKWARD, ids=[c[0] for c in BAD_BACKWARD])
def test_bad_backward_input_names_the_argument(case):
    _, overrides, error, fragment = case
    q, k, v = rand(2, 7, 4, 16), rand(2, 9, 2, 16), rand(2, 9, 2, 16)
    args = dict(dout=rand(2, 7, 4, 16), q=q, k=k, v=v, out=rand(2, 7, 4, 16), softmax_lse=rand(2, 4, 7),
                dq=torch.empty_like(q), dk=torch.empty_like(k), dv=torch.empty_like(v), dropout_p=0.0,
                softmax_scale=None, causal=False, window_size_left=-1, window_size_right=-1,
                softcap=0.0, alibi_slopes=None, deterministic=False)
    args.update(overrides)
    with pytest.raises(error) as info:
        fai._flash_attn_backward(**args)
    assert fragment in str(info.value)


def test_unsupported_varlen_arguments_are_refused_by_name():
    cu = torch.tensor([0, 4], dtype=torch.int32)
    q = rand(4, 2, 8)
    with pytest.raises(ValueError, match="leftpad_k is not supported"):
        fai._flash_attn_varlen_forward(q, q, q, cu, cu, 4, 4, 0.0, None, False, leftpad_k=cu[:1])


def test_sm_margin_is_flash_attention_3s_keyword_and_changes_no_result():
    q, k, v = rand(2, 7, 4, 16), rand(2, 9, 2, 16), rand(2, 9, 2, 16)
    dout = rand(2, 7, 4, 16)
    results = []
    for margin in (0, 8):
        out, lse, _, rng_state = fai._flash_attn_forward(q, k, v, 0.0, None, True, -1, -1, 0.0, None, False,
                                                         sm_margin=margin)
        grads = [torch.empty_like(t) for t in (q, k, v)]
        fai._flash_attn_backward(dout, q, k, v, out, lse, *grads, 0.0, None, True, -1, -1, 0.0, None, False,
                                 rng_state, sm_margin=margin)
        results.append([out, lse, *grads])
    assert all(torch.equal(a, b) for a, b in zip(*results))
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    vq, vk = rand(7, 4, 16), rand(7, 2, 16)
    out, lse, _, rng_state = fai._flash_attn_varlen_forward(vq, vk, vk, cu, cu, 4, 4, 0.0, None, False, sm_margin=3)
    fai._flash_attn_varlen_backward(rand(7, 4, 16), vq, vk, vk, out, lse, None, None, None, cu, cu, 4, 4, 0.0,
                                    None, False, -1, -1, 0.0, None, False, rng_state, sm_margin=3)
    with pytest.raises(TypeError, match="sm_margin must be an int >= 0"):
        fai._flash_attn_varlen_forward(vq, vk, vk, cu, cu, 4, 4, 0.0, None, False, sm_margin=0.5)
