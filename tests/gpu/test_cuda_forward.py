"""GPU tests of the CUDA forward kernel (backends/cuda), against the float64 oracle.

Error rule: tests/error_rule.py (outputs within 2x PyTorch's own low-precision error of the
float64 oracle, the LSE against the float32 naive LSE's error). Outputs are NaN-poisoned before
every launch, so an unwritten element fails.
"""
from __future__ import annotations

import math

import pytest
import torch

from error_rule import assert_lse, assert_output
from naive import naive_attention

pytestmark = pytest.mark.gpu

from cuda_gpu_setup import BACKEND, DTYPES, HEAD_DIMS, SEQLENS, grid_inputs, rand  # noqa: E402  (skips without a GPU)

from portattn.backends.reference import philox_keep_mask  # noqa: E402



def _run(q, k, v, *, window=(-1, -1), softcap=0.0, alibi=None, dropout_p=0.0, seed=0, offset=0,
         cu_q=None, cu_k=None, max_q=0, max_k=0, scale=None):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.full_like(q, float("nan"))
    if cu_q is None:
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device=q.device)
    else:
        lse = torch.full((q.shape[1], q.shape[0]), float("nan"), device=q.device)
    BACKEND.forward(
        q, k, v, out, lse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
        max_seqlen_k=max_k, softmax_scale=scale, window_left=window[0], window_right=window[1],
        softcap=softcap, alibi_slopes=alibi, dropout_p=dropout_p, rng_seed=seed, rng_offset=offset,
    )
    torch.cuda.synchronize()
    return out, lse


def _check(out, lse, q, k, v, **naive_options):
    ref, ref_lse = naive_attention(q, k, v, compute_dtype=torch.float64, **naive_options)
    low, _ = naive_attention(q, k, v, compute_dtype=q.dtype, **naive_options)
    _, low_lse = naive_attention(q.float(), k.float(), v.float(), compute_dtype=torch.float32,
                                 **naive_options)
    assert_output(out, ref, low)
    # Rows with no visible key: -inf exactly, and out exactly 0 there.
    assert_lse(lse, ref_lse, low_lse)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_grid(dtype, head_dim, seqlens, causal):
    q, k, v = grid_inputs(dtype, head_dim, seqlens)
    out, lse = _run(q, k, v, window=(-1, 0 if causal else -1))
    _check(out, lse, q, k, v, causal=causal)


FEATURES = {
    "window": dict(window=(37, 11)),
    "window_left_only": dict(window=(100, -1)),
    "window_right_only": dict(window=(-1, 5)),
    "window_causal_local": dict(window=(64, 0)),
    "softcap": dict(softcap=7.5),
    "alibi_h": dict(alibi="h"),
    "alibi_bh": dict(alibi="bh"),
    "all": dict(window=(90, 0), softcap=20.0, alibi="bh"),
}


@pytest.mark.parametrize("gqa", [1, 6], ids=lambda g: f"group{g}")
@pytest.mark.parametrize("seqlens", [(113, 203), (1000, 1000)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("head_dim", [80, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_features(dtype, head_dim, feature, seqlens, gqa):
    options = dict(FEATURES[feature])
    seqlen_q, seqlen_k = seqlens
    batch, heads = 2, 6
    q = rand(batch, seqlen_q, heads, head_dim, dtype=dtype)
    k = rand(batch, seqlen_k, heads // gqa, head_dim, dtype=dtype)
    v = rand(batch, seqlen_k, heads // gqa, head_dim, dtype=dtype)
    alibi = options.pop("alibi", None)
    if alibi == "h":
        alibi = torch.rand(heads, device="cuda") * 0.3
    elif alibi == "bh":
        alibi = torch.rand(batch, heads, device="cuda") * 0.3
    out, lse = _run(q, k, v, alibi=alibi, **options)
    _check(out, lse, q, k, v, alibi_slopes=alibi, **options)


# Note [portattn sm80 narrow tiles]: head dims <= 128 run 64 x 64 tiles for short calls
# (fwd_launch.cuh: narrow_pays; at hd <= 32 every call up to 512 and masked ones up to 1024,
# at 96-128 up to 320);
# these points sit on both sides of those limits, of the 64-row and 64-key block edges, and
# take every score path (mask, extras) there.
NARROW_SEQLENS = [(50, 50), (64, 64), (65, 200), (200, 37), (256, 256), (256, 257), (257, 256), (300, 300),
                  (700, 700), (1000, 1024)]
NARROW_OPTIONS = {
    "plain": dict(),
    "causal": dict(window=(-1, 0)),
    "window": dict(window=(37, 11)),
    "softcap_alibi_causal": dict(window=(-1, 0), softcap=7.5, alibi="bh"),
}


@pytest.mark.parametrize("gqa", [1, 3], ids=lambda g: f"group{g}")
@pytest.mark.parametrize("option", list(NARROW_OPTIONS))
@pytest.mark.parametrize("seqlens", NARROW_SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("head_dim", [16, 32, 48, 64, 80, 128])
def test_forward_narrow_tiles(head_dim, seqlens, option, gqa):
    dtype, batch, heads = torch.bfloat16, 3, 6
    options = dict(NARROW_OPTIONS[option])
    seqlen_q, seqlen_k = seqlens
    q = rand(batch, seqlen_q, heads, head_dim, dtype=dtype)
    k = rand(batch, seqlen_k, heads // gqa, head_dim, dtype=dtype)
    v = rand(batch, seqlen_k, heads // gqa, head_dim, dtype=dtype)
    alibi = torch.rand(batch, heads, device="cuda") * 0.3 if options.pop("alibi", None) else None
    out, lse = _run(q, k, v, alibi=alibi, **options)
    _check(out, lse, q, k, v, alibi_slopes=alibi, **options)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_forward_narrow_tiles_varlen(head_dim):
    lens_q, lens_k = [1, 50, 256, 0, 129, 64], [7, 50, 256, 3, 200, 1]
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(torch.int32)
    q = rand(sum(lens_q), 4, head_dim, dtype=torch.float16)
    k = rand(sum(lens_k), 2, head_dim, dtype=torch.float16)
    v = rand(sum(lens_k), 2, head_dim, dtype=torch.float16)
    for window in ((-1, -1), (-1, 0)):
        out, lse = _run(q, k, v, window=window, cu_q=cu_q, cu_k=cu_k, max_q=max(lens_q), max_k=max(lens_k))
        _check(out, lse, q, k, v, causal=window == (-1, 0), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


VARLEN = {
    "mixed": ([0, 1, 17, 113, 300, 1], [5, 1, 0, 200, 300, 64]),
    "equal": ([128, 1, 129], [128, 1, 129]),
    "long": ([1000, 3, 0], [700, 1500, 0]),
}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("gqa", [1, 4], ids=lambda g: f"group{g}")
@pytest.mark.parametrize("lengths", list(VARLEN))
@pytest.mark.parametrize("head_dim", [64, 72, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_varlen(dtype, head_dim, lengths, gqa, causal):
    lens_q, lens_k = VARLEN[lengths]
    heads = 4
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(torch.int32)
    q = rand(sum(lens_q), heads, head_dim, dtype=dtype)
    k = rand(sum(lens_k), heads // gqa, head_dim, dtype=dtype)
    v = rand(sum(lens_k), heads // gqa, head_dim, dtype=dtype)
    window = (-1, 0 if causal else -1)
    out, lse = _run(q, k, v, window=window, cu_q=cu_q, cu_k=cu_k, max_q=max(lens_q), max_k=max(lens_k))
    _check(out, lse, q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


@pytest.mark.parametrize("layout", ["qkv_packed", "heads_first", "kv_packed_sliced"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_forward_strided(layout, head_dim):
    dtype, batch, seqlen, heads = torch.bfloat16, 2, 300, 4
    if layout == "qkv_packed":
        qkv = rand(batch, seqlen, 3, heads, head_dim, dtype=dtype)
        q, k, v = qkv.unbind(2)
    elif layout == "heads_first":
        q, k, v = (rand(batch, heads, seqlen, head_dim, dtype=dtype).transpose(1, 2) for _ in range(3))
    else:  # k/v interleaved along heads, queries a slice of a longer sequence
        q = rand(batch, seqlen + 64, heads, head_dim, dtype=dtype)[:, 32 : 32 + seqlen]
        kv = rand(batch, seqlen, heads, 2, head_dim, dtype=dtype)
        k, v = kv[:, :, :, 0], kv[:, :, :, 1]
    assert not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous())
    out, lse = _run(q, k, v, window=(-1, 0))
    _check(out, lse, q, k, v, causal=True)
    # The output may be strided too.
    out2 = torch.full((batch, heads, seqlen, head_dim), float("nan"), device="cuda", dtype=dtype).transpose(1, 2)
    lse2 = torch.full((batch, heads, seqlen), float("nan"), device="cuda")
    BACKEND.forward(q, k, v, out2, lse2, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0,
                    max_seqlen_k=0, softmax_scale=head_dim**-0.5, window_left=-1, window_right=0,
                    softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_seed=0, rng_offset=0)
    torch.cuda.synchronize()
    torch.testing.assert_close(out2, out, rtol=0, atol=0)


def test_fully_masked_rows_are_zero_with_lse_minus_inf():
    # seqlen_q > seqlen_k with a causal mask: the first rows see no key at all;
    # a narrow window with a large right offset also empties rows.
    q = rand(2, 300, 2, 64, dtype=torch.bfloat16)
    k = rand(2, 100, 2, 64, dtype=torch.bfloat16)
    v = rand(2, 100, 2, 64, dtype=torch.bfloat16)
    out, lse = _run(q, k, v, window=(-1, 0))
    assert torch.isinf(lse[:, :, :200]).all() and (lse[:, :, :200] < 0).all()
    assert (out[:, :200] == 0).all()
    _check(out, lse, q, k, v, causal=True)
    slopes = torch.rand(2, device="cuda")
    out, lse = _run(q, k, v, window=(3, 0), alibi=slopes)
    assert torch.isinf(lse[:, :, :200]).all() and (out[:, :200] == 0).all()
    _check(out, lse, q, k, v, window=(3, 0), alibi_slopes=slopes)


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("p", [0.17, 0.5])
def test_dropout_matches_reference_mask(p, head_dim, varlen):
    dtype, heads = torch.bfloat16, 3
    seed, offset = 1234567, (5 << 32) + 77
    if varlen:
        lens_q, lens_k = [17, 130, 1], [200, 64, 33]
        cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(torch.int32)
        q = rand(sum(lens_q), heads, head_dim, dtype=dtype)
        k = rand(sum(lens_k), heads, head_dim, dtype=dtype)
        v = rand(sum(lens_k), heads, head_dim, dtype=dtype)
        batch, max_q, max_k = len(lens_q), max(lens_q), max(lens_k)
        extra = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        out, lse = _run(q, k, v, dropout_p=p, seed=seed, offset=offset, cu_q=cu_q, cu_k=cu_k,
                        max_q=max_q, max_k=max_k, window=(-1, 0))
    else:
        # 211 x 333 runs the wide tiles at every head dim; hd32's 211 x 199 the narrow ones.
        batch, max_q, max_k = 2, 211, 199 if head_dim == 32 else 333
        q = rand(batch, max_q, heads, head_dim, dtype=dtype)
        k = rand(batch, max_k, heads, head_dim, dtype=dtype)
        v = rand(batch, max_k, heads, head_dim, dtype=dtype)
        extra = {}
        out, lse = _run(q, k, v, dropout_p=p, seed=seed, offset=offset, window=(-1, 0))
    bh = torch.arange(batch * heads, device="cuda").reshape(batch, heads)
    mask = philox_keep_mask(seed, offset, bh, range(max_q), range(max_k), p, device="cuda")
    assert 0.3 < mask.float().mean().item() / (1 - p) < 3, "mask keeps a plausible fraction"
    _check(out, lse, q, k, v, causal=True, dropout_mask=mask, dropout_p=p, **extra)


def test_misaligned_view_raises_clear_error():
    q = rand(64 * 64 + 1, dtype=torch.bfloat16)[1:].view(1, 64, 1, 64)  # 2-byte offset
    k = v = rand(1, 64, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        _run(q, k, v)
