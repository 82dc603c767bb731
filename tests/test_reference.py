"""The reference backend against the float64 naive oracle, feature by feature.

Everything runs on CPU. Most tests force tiny chunk sizes so the multi-chunk paths
(online-softmax rescaling, chunk skipping, dropout columns that straddle a four-column
Philox group) run on small inputs; `CHUNKS` also keeps the production sizes.
"""
from __future__ import annotations

import math

import pytest
import torch
from error_rule import assert_grads, assert_output
from naive import naive_attention

from portattn.backends import reference
from portattn.backends.reference import ReferenceBackend, philox_keep_mask
from portattn.capability.callspec import FEATURES, CallSpec

BACKEND = ReferenceBackend()
F64 = torch.float64

# (query chunk, key chunk): odd tiny sizes, and the module's own defaults.
CHUNKS = [(3, 5), (reference.QUERY_CHUNK, reference.KEY_CHUNK)]


@pytest.fixture(params=CHUNKS, ids=lambda c: f"chunks{c[0]}x{c[1]}")
def chunks(request, monkeypatch):
    monkeypatch.setattr(reference, "QUERY_CHUNK", request.param[0])
    monkeypatch.setattr(reference, "KEY_CHUNK", request.param[1])
    return request.param


@pytest.fixture
def tiny_chunks(monkeypatch):
    monkeypatch.setattr(reference, "QUERY_CHUNK", 4)
    monkeypatch.setattr(reference, "KEY_CHUNK", 6)


# ---------------------------------------------------------------------------------------
# Calling the backend the way dispatch does: caller-allocated, NaN-poisoned outputs
# ---------------------------------------------------------------------------------------


def _backend_options(q, causal=False, window=(-1, -1), softcap=0.0, alibi=None, dropout_p=0.0,
                     seed=0, offset=0, cu_q=None, cu_k=None, scale=None):
    left, right = window
    return dict(
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=0 if cu_q is None else int((cu_q[1:] - cu_q[:-1]).max()),
        max_seqlen_k=0 if cu_k is None else int((cu_k[1:] - cu_k[:-1]).max()),
        softmax_scale=1.0 / math.sqrt(q.shape[-1]) if scale is None else scale,
        window_left=left,
        window_right=0 if causal else right,
        softcap=softcap,
        alibi_slopes=alibi,
        dropout_p=dropout_p,
        rng_seed=seed,
        rng_offset=offset,
    )


def poisoned_like(x, dtype=None):
    return torch.full_like(x, float("nan"), dtype=dtype)


def run_forward(q, k, v, *, out=None, lse_dtype=None, **options):
    """(out, lse) from the backend; lse is float32 by contract, float64 on request."""
    if out is None:
        out = q.new_full((*q.shape[:-1], v.shape[-1]), float("nan"))
    out.fill_(float("nan"))
    if options.get("cu_q") is None:
        lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    else:
        lse_shape = (q.shape[1], q.shape[0])
    lse = torch.full(lse_shape, float("nan"), dtype=lse_dtype or torch.float32)
    BACKEND.forward(q, k, v, out, lse, **_backend_options(q, **options))
    return out, lse


def run_backward(dout, q, k, v, out, lse, **options):
    dq, dk, dv = poisoned_like(q), poisoned_like(k), poisoned_like(v)
    BACKEND.backward(dout, q, k, v, out, lse, dq, dk, dv, deterministic=False,
                     **_backend_options(q, **options))
    return dq, dk, dv


def run_naive(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, alibi=None,
              dropout_p=0.0, seed=0, offset=0, cu_q=None, cu_k=None, scale=None,
              compute_dtype=F64):
    mask = None
    if dropout_p > 0:
        mask = philox_mask(q, k, seed, offset, dropout_p, cu_q, cu_k)
    return naive_attention(q, k, v, causal=causal, window=window, softcap=softcap,
                           alibi_slopes=alibi, dropout_mask=mask, dropout_p=dropout_p,
                           scale=scale, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                           compute_dtype=compute_dtype)


def philox_mask(q, k, seed, offset, p, cu_q=None, cu_k=None):
    """The whole (B, H, Sq, Sk) keep-mask, for the naive oracle (varlen: padded)."""
    if cu_q is None:
        batch, seqlen_q, nheads = q.shape[:3]
        seqlen_k = k.shape[1]
    else:
        batch, nheads = len(cu_q) - 1, q.shape[1]
        seqlen_q = max(1, int((cu_q[1:] - cu_q[:-1]).max()))
        seqlen_k = max(1, int((cu_k[1:] - cu_k[:-1]).max()))
    bh = torch.arange(batch * nheads).view(batch, nheads)
    return philox_keep_mask(seed, offset, bh, range(seqlen_q), range(seqlen_k), p)


def naive_grads(q, k, v, dout, **options):
    leaves = [x.detach().to(F64).requires_grad_() for x in (q, k, v)]
    out, _ = run_naive(*leaves, **options)
    return torch.autograd.grad(out, leaves, dout.to(F64))


def random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype=F64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, nheads, headdim, generator=gen, dtype=F64)
    k = torch.randn(batch, seqlen_k, nheads_k, headdim, generator=gen, dtype=F64)
    v = torch.randn(batch, seqlen_k, nheads_k, headdim, generator=gen, dtype=F64)
    dout = torch.randn(batch, seqlen_q, nheads, headdim, generator=gen, dtype=F64)
    return [x.to(dtype) for x in (q, k, v, dout)]


def random_slopes(*shape, seed=1):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) + 0.05


def assert_matches_naive(q, k, v, dout, rtol=1e-9, atol=1e-9, **options):
    """Forward (out, lse) and backward (dq, dk, dv) of the backend against naive fp64."""
    out, lse = run_forward(q, k, v, lse_dtype=F64, **options)
    ref_out, ref_lse = run_naive(q, k, v, **options)
    torch.testing.assert_close(out, ref_out, rtol=rtol, atol=atol)
    torch.testing.assert_close(lse, ref_lse, rtol=rtol, atol=atol)
    grads = run_backward(dout, q, k, v, out, lse, **options)
    for name, got, expected in zip("qkv", grads, naive_grads(q, k, v, dout, **options)):
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, msg=lambda m: f"d{name}: {m}")
    return out, lse, grads


# ---------------------------------------------------------------------------------------
# Every feature and their combinations, fp64 against the naive oracle
# ---------------------------------------------------------------------------------------

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim): square, seqlen_q > seqlen_k,
# seqlen_q < seqlen_k with MQA, GQA 3:1 and a single token.
SHAPES = [
    (2, 7, 7, 2, 2, 8),
    (1, 17, 5, 6, 2, 40),
    (2, 5, 23, 4, 1, 16),
    (1, 11, 13, 6, 2, 8),
    (1, 1, 1, 2, 1, 8),
]

FEATURE_SETS = {
    "plain": {},
    "causal": dict(causal=True),
    "window_3_2": dict(window=(3, 2)),
    "window_left_only": dict(window=(2, -1)),
    "window_right_only": dict(window=(-1, 1)),
    "window_0_0": dict(window=(0, 0)),
    "causal_window_left": dict(causal=True, window=(4, -1)),
    "softcap": dict(softcap=0.7),
    "alibi_heads": dict(alibi="heads"),
    "alibi_batch_heads": dict(alibi="batch_heads"),
    "dropout": dict(dropout_p=0.3, seed=2**40 + 5, offset=12),
    "everything": dict(causal=True, window=(5, -1), softcap=0.9, alibi="batch_heads",
                       dropout_p=0.2, seed=11, offset=2**33),
}


def resolve(options, batch, nheads):
    """Turns the symbolic ALiBi choice of FEATURE_SETS into slopes for this shape."""
    options = dict(options)
    if options.get("alibi") == "heads":
        options["alibi"] = random_slopes(nheads)
    elif options.get("alibi") == "batch_heads":
        options["alibi"] = random_slopes(batch, nheads)
    return options


@pytest.mark.parametrize("features", FEATURE_SETS.values(), ids=FEATURE_SETS.keys())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_naive(chunks, shape, features):
    q, k, v, dout = random_qkv(*shape)
    assert_matches_naive(q, k, v, dout, **resolve(features, shape[0], shape[3]))


@pytest.mark.parametrize("headdim", [8, 40, 80, 256])
def test_head_dims(tiny_chunks, headdim):
    q, k, v, dout = random_qkv(2, 9, 12, 4, 2, headdim)
    assert_matches_naive(q, k, v, dout, causal=True, softcap=1.5, alibi=random_slopes(4))


def test_value_head_dim_differs(tiny_chunks):
    q, k, _, _ = random_qkv(2, 7, 9, 4, 2, 8)
    _, _, v, dout = random_qkv(2, 7, 9, 4, 2, 24, seed=5)
    assert_matches_naive(q, k, v, dout, causal=True, dropout_p=0.2, seed=4)
    q, k, v, dout, cu_q, cu_k = packed_qkv([3, 0, 5], [4, 2, 6], 2, 1, 8)
    v = torch.randn(v.shape[0], 1, 16, dtype=F64)
    dout = torch.randn(q.shape[0], 2, 16, dtype=F64)
    assert_matches_naive(q, k, v, dout, cu_q=cu_q, cu_k=cu_k, window=(2, 0))


def test_explicit_scale(tiny_chunks):
    q, k, v, dout = random_qkv(1, 6, 8, 2, 2, 8)
    assert_matches_naive(q, k, v, dout, scale=0.9, softcap=2.0)


def test_causal_rows_without_keys_are_zero(tiny_chunks):
    # seqlen_q > seqlen_k, bottom-right causal: queries 0..(Sq - Sk - 1) see no key.
    q, k, v, dout = random_qkv(2, 10, 4, 2, 1, 8)
    out, lse, (dq, dk, dv) = assert_matches_naive(q, k, v, dout, causal=True)
    empty = 10 - 4
    assert torch.equal(out[:, :empty], torch.zeros_like(out[:, :empty]))
    assert torch.isneginf(lse[:, :, :empty]).all()
    assert torch.isfinite(lse[:, :, empty:]).all()
    assert torch.equal(dq[:, :empty], torch.zeros_like(dq[:, :empty]))
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()


def test_window_that_hides_every_key(tiny_chunks):
    # A right window of 0 and a negative offset: Sq > Sk puts row 0 far before key 0.
    q, k, v, dout = random_qkv(1, 9, 3, 2, 2, 8)
    out, lse, _ = assert_matches_naive(q, k, v, dout, window=(0, 0))
    assert torch.isneginf(lse[..., :6]).all() and not torch.isnan(out).any()


# ---------------------------------------------------------------------------------------
# Varlen
# ---------------------------------------------------------------------------------------


def packed_qkv(lens_q, lens_k, nheads, nheads_k, headdim, tail=0, dtype=F64):
    """Packed q/k/v/dout with `tail` spare rows after the last sequence, and cu_seqlens."""
    gen = torch.Generator().manual_seed(3)
    total_q, total_k = sum(lens_q) + tail, sum(lens_k) + tail
    q = torch.randn(total_q, nheads, headdim, generator=gen, dtype=F64).to(dtype)
    k = torch.randn(total_k, nheads_k, headdim, generator=gen, dtype=F64).to(dtype)
    v = torch.randn(total_k, nheads_k, headdim, generator=gen, dtype=F64).to(dtype)
    dout = torch.randn(total_q, nheads, headdim, generator=gen, dtype=F64).to(dtype)
    cu = lambda lens: torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return q, k, v, dout, cu(lens_q), cu(lens_k)


# Sequences with zero queries, zero keys, one of each, and longer than the tiny chunks.
LENS_Q = [3, 0, 1, 7, 1, 12, 2]
LENS_K = [5, 2, 0, 9, 1, 10, 0]

VARLEN_FEATURES = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window=(2, 1)),
    "softcap_alibi_heads": dict(softcap=0.8, alibi="heads"),
    "alibi_batch_heads": dict(alibi="batch_heads"),
    "dropout": dict(dropout_p=0.25, seed=77, offset=3),
    "everything": dict(causal=True, window=(3, -1), softcap=1.1, alibi="batch_heads",
                       dropout_p=0.4, seed=5, offset=9),
}


@pytest.mark.parametrize("features", VARLEN_FEATURES.values(), ids=VARLEN_FEATURES.keys())
def test_varlen_matches_naive(chunks, features):
    nheads, nheads_k = 4, 2
    q, k, v, dout, cu_q, cu_k = packed_qkv(LENS_Q, LENS_K, nheads, nheads_k, 8, tail=2)
    options = resolve(features, len(LENS_Q), nheads)
    out, lse, (dq, dk, dv) = assert_matches_naive(q, k, v, dout, cu_q=cu_q, cu_k=cu_k, **options)
    # Rows outside every sequence: defined (not the NaN poison), zero, lse -inf.
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))
    assert torch.isneginf(lse[:, -2:]).all()
    for grad in (dq, dk, dv):
        assert torch.equal(grad[-2:], torch.zeros_like(grad[-2:]))


def test_varlen_equals_batched_per_sequence(tiny_chunks):
    # The same dropout mask positions (relative to each sequence) and ALiBi row as a
    # batched call over sequence b: varlen is a batch of independent problems.
    nheads = 2
    q, k, v, dout, cu_q, cu_k = packed_qkv([4, 6], [5, 6], nheads, nheads, 8)
    options = dict(causal=True, dropout_p=0.5, seed=3, offset=1, alibi=random_slopes(2, nheads))
    out, lse = run_forward(q, k, v, cu_q=cu_q, cu_k=cu_k, **options)
    for b in range(2):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        # Batch index b must reach the philox counter, so run b as row b of a batch of 2.
        qb = torch.stack([q[q0:q1]] * 2)
        kb, vb = torch.stack([k[k0:k1]] * 2), torch.stack([v[k0:k1]] * 2)
        out_b, lse_b = run_forward(qb, kb, vb, **options)
        torch.testing.assert_close(out[q0:q1], out_b[b], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse[:, q0:q1], lse_b[b], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------
# Layouts, dtypes, memory
# ---------------------------------------------------------------------------------------


def test_non_contiguous_inputs_and_outputs(tiny_chunks):
    q, k, v, dout = random_qkv(2, 9, 11, 4, 2, 16)
    expected = assert_matches_naive(q, k, v, dout, causal=True, alibi=random_slopes(4))

    def strided(x):
        # (B, H, S, 2D) storage seen as (B, S, H, D): heads outer, rows padded.
        wide = torch.randn(x.shape[0], x.shape[2], x.shape[1], 2 * x.shape[3], dtype=x.dtype)
        view = wide.transpose(1, 2)[..., : x.shape[3]]
        view.copy_(x)
        assert not view.is_contiguous() and view.stride(-1) == 1
        return view

    qs, ks, vs, douts = map(strided, (q, k, v, dout))
    options = dict(causal=True, alibi=random_slopes(4))
    out, lse = run_forward(qs, ks, vs, out=strided(q), lse_dtype=F64, **options)
    dq, dk, dv = (strided(poisoned_like(x)) for x in (q, k, v))
    BACKEND.backward(douts, qs, ks, vs, out, lse, dq, dk, dv, deterministic=True,
                     **_backend_options(qs, **options))
    for got, want in zip((out, lse, dq, dk, dv), (expected[0], expected[1], *expected[2])):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("features", [{}, dict(causal=True, softcap=2.0, alibi="heads", dropout_p=0.1)],
                         ids=["plain", "mixed"])
def test_low_precision_error_rule(tiny_chunks, dtype, features):
    """Our error <= 2x (out) / 3x (grads) that of the naive computed in the same dtype."""
    q, k, v, dout = random_qkv(2, 21, 19, 4, 2, 32, dtype=dtype, seed=7)
    options = resolve(features, 2, 4)
    out, lse = run_forward(q, k, v, **options)
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref_out, ref_lse = run_naive(q, k, v, **options)
    low_out, _ = run_naive(q, k, v, compute_dtype=dtype, **options)
    assert_output(out, ref_out, low_out)
    # lse is fp32 whatever the input dtype: it must be accurate to fp32, not to dtype.
    torch.testing.assert_close(lse.to(F64), ref_lse, rtol=1e-5, atol=1e-5)

    grads = run_backward(dout, q, k, v, out, lse, **options)
    ref_grads = naive_grads(q, k, v, dout, **options)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    low_out, _ = run_naive(*leaves, compute_dtype=dtype, **options)
    low_grads = torch.autograd.grad(low_out, leaves, dout)
    assert all(got.dtype == dtype for got in grads)
    assert_grads(grads, ref_grads, low_grads)


def test_fp64_inputs_with_contract_fp32_lse(tiny_chunks):
    # Dispatch hands a float32 lse even for fp64 inputs; the backward then recomputes P
    # from an lse rounded to fp32, so gradients are fp32-accurate, not garbage.
    q, k, v, dout = random_qkv(1, 8, 8, 2, 2, 8)
    out, lse = run_forward(q, k, v, causal=True)
    grads = run_backward(dout, q, k, v, out, lse, causal=True)
    for got, want in zip(grads, naive_grads(q, k, v, dout, causal=True)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_chunks_bound_the_score_matrix(monkeypatch, tiny_chunks):
    """No score tensor larger than one chunk; causal skips chunks above the diagonal."""
    seen = []
    original = reference._Problem.scores

    def recording(self, q_rows, i0, i1, j0, j1):
        s, tanh = original(self, q_rows, i0, i1, j0, j1)
        seen.append(s.shape)
        return s, tanh

    monkeypatch.setattr(reference._Problem, "scores", recording)
    q, k, v, dout = random_qkv(2, 40, 40, 6, 2, 8)
    run_forward(q, k, v)
    full = len(seen)
    group = 6 // 2
    assert full == math.ceil(40 / reference.QUERY_CHUNK) * math.ceil(40 / reference.KEY_CHUNK)
    assert all(s[-2] <= group * reference.QUERY_CHUNK and s[-1] <= reference.KEY_CHUNK for s in seen)
    seen.clear()
    run_forward(q, k, v, causal=True)
    assert len(seen) < 0.7 * full


def test_score_budget_shrinks_query_chunk(monkeypatch):
    monkeypatch.setattr(reference, "SCORE_ELEMENTS", 2 * 8 * 16 * 10)
    monkeypatch.setattr(reference, "KEY_CHUNK", 16)
    q, k, v, _ = random_qkv(2, 30, 40, 8, 8, 8)
    pb = reference._Problem(q, k, v, batch_start=0, **{
        key: value for key, value in _backend_options(q).items()
        if key not in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
    })
    assert pb.query_chunk == 10


def test_backward_is_deterministic(tiny_chunks):
    q, k, v, dout = random_qkv(1, 13, 13, 4, 1, 8, dtype=torch.float32)
    out, lse = run_forward(q, k, v, dropout_p=0.2, seed=1)
    first = run_backward(dout, q, k, v, out, lse, dropout_p=0.2, seed=1)
    second = run_backward(dout, q, k, v, out, lse, dropout_p=0.2, seed=1)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_dropout_depends_on_seed_and_offset(tiny_chunks):
    q, k, v, _ = random_qkv(1, 8, 8, 2, 2, 8)
    base, _ = run_forward(q, k, v, dropout_p=0.5, seed=1, offset=0)
    assert torch.equal(base, run_forward(q, k, v, dropout_p=0.5, seed=1, offset=0)[0])
    assert not torch.allclose(base, run_forward(q, k, v, dropout_p=0.5, seed=2, offset=0)[0])
    assert not torch.allclose(base, run_forward(q, k, v, dropout_p=0.5, seed=1, offset=4)[0])


def test_supports_every_feature():
    call = CallSpec("float16", 72, 72, "cpu", frozenset(FEATURES))
    assert BACKEND.unsupported_reasons(call) == []
    assert BACKEND.name == "reference"


# ---------------------------------------------------------------------------------------
# gradcheck through a thin autograd.Function
# ---------------------------------------------------------------------------------------


class ReferenceAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, options):
        out, lse = run_forward(q, k, v, lse_dtype=F64, **options)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = options
        return out

    @staticmethod
    def backward(ctx, dout):
        return (*run_backward(dout.contiguous(), *ctx.saved_tensors, **ctx.options), None)


GRADCHECK_CASES = {
    "plain_gqa": ((1, 3, 5, 2, 1, 4), {}),
    "causal_softcap_alibi": ((2, 4, 3, 2, 2, 4), dict(causal=True, softcap=0.6, alibi="batch_heads")),
    "window_dropout": ((1, 5, 5, 2, 1, 4), dict(window=(1, 2), dropout_p=0.3, seed=8)),
}


@pytest.mark.parametrize("shape,features", GRADCHECK_CASES.values(), ids=GRADCHECK_CASES.keys())
def test_gradcheck(tiny_chunks, shape, features):
    q, k, v, _ = random_qkv(*shape)
    options = resolve(features, shape[0], shape[3])
    inputs = [x.requires_grad_() for x in (q, k, v)]
    assert torch.autograd.gradcheck(lambda *qkv: ReferenceAttention.apply(*qkv, options), inputs)


def test_gradcheck_varlen(tiny_chunks):
    q, k, v, _, cu_q, cu_k = packed_qkv([2, 0, 3], [3, 1, 2], 2, 1, 4)
    options = dict(cu_q=cu_q, cu_k=cu_k, causal=True, softcap=0.5)
    inputs = [x.requires_grad_() for x in (q, k, v)]
    assert torch.autograd.gradcheck(lambda *qkv: ReferenceAttention.apply(*qkv, options), inputs)


# ---------------------------------------------------------------------------------------
# GPU: the same backend on a CUDA (or ROCm) device
# ---------------------------------------------------------------------------------------


def _to(device, options):
    return {key: value.to(device) if torch.is_tensor(value) else value for key, value in options.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gpu_matches_cpu(chunks, dtype):
    """Philox in CUDA int64 arithmetic, and every other op, give what they give on CPU."""
    nheads = 4
    q, k, v, dout, cu_q, cu_k = packed_qkv(LENS_Q, LENS_K, nheads, 2, 64, tail=1, dtype=dtype)
    options = dict(cu_q=cu_q, cu_k=cu_k, causal=True, window=(6, -1), softcap=3.0,
                   alibi=random_slopes(len(LENS_Q), nheads), dropout_p=0.3,
                   seed=2**35 + 1, offset=2**32 + 8)
    cpu_out, cpu_lse = run_forward(q, k, v, **options)
    cpu_grads = run_backward(dout, q, k, v, cpu_out, cpu_lse, **options)
    cuda = _to("cuda", options)
    qc, kc, vc, doutc = (x.cuda() for x in (q, k, v, dout))
    out = poisoned_like(doutc)
    lse = torch.full(cpu_lse.shape, float("nan"), device="cuda")
    BACKEND.forward(qc, kc, vc, out, lse, **_backend_options(qc, **cuda))
    grads = [poisoned_like(x) for x in (qc, kc, vc)]
    BACKEND.backward(doutc, qc, kc, vc, out, lse, *grads, deterministic=True,
                     **_backend_options(qc, **cuda))
    # Both computed in fp32 with different matmul kernels (different summation orders):
    # equal up to fp32 rounding noise, then at most one ulp apart after rounding to dtype.
    eps = max(torch.finfo(dtype).eps, 1e-5)
    tol = dict(rtol=eps, atol=eps)
    torch.testing.assert_close(out.cpu(), cpu_out, **tol)
    torch.testing.assert_close(lse.cpu(), cpu_lse, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, cpu_grads):
        torch.testing.assert_close(got.cpu(), want, **tol)


@pytest.mark.gpu
def test_gpu_philox_matches_cpu():
    bh = torch.arange(24).view(2, 12)
    for seed, offset in [(0, 0), (2**64 - 1, 2**64 - 5), (123456789, 2**33 + 4)]:
        cpu = reference.philox_random(seed, offset, bh, range(37), range(3, 70))
        gpu = reference.philox_random(seed, offset, bh.cuda(), range(37), range(3, 70))
        assert gpu.is_cuda and torch.equal(gpu.cpu(), cpu)
