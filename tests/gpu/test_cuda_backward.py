"""GPU tests of the CUDA backward kernels (backends/cuda, csrc/bwd_*), against the float64 oracle.

Error rule: tests/error_rule.py, applied to dQ, dK and dV separately (within 3x PyTorch's own
low-precision error of the float64 oracle, autograd through tests/naive.py), with the same
low-precision inputs (q, k, v, dout and the forward's out/lse). The fp32 reference backend is
checked against the kernel on a few cases as a second opinion. Gradients are NaN-poisoned
before every launch, so an unwritten element fails.
"""
from __future__ import annotations

import math

import pytest
import torch

from error_rule import GRAD_FACTOR, assert_within
from naive import naive_attention

pytestmark = pytest.mark.gpu

from cuda_gpu_setup import (  # noqa: E402  (skips without a GPU)
    BACKEND, DTYPES, HEAD_DIMS, SEQLENS, grid_inputs, poison_free_memory, rand)

from portattn.backends.reference import ReferenceBackend, philox_keep_mask  # noqa: E402

REFERENCE = ReferenceBackend()


def _options(q, *, window=(-1, -1), softcap=0.0, alibi=None, dropout_p=0.0, seed=0, offset=0,
             cu_q=None, cu_k=None, max_q=0, max_k=0):
    return dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                softmax_scale=1.0 / math.sqrt(q.shape[-1]), window_left=window[0],
                window_right=window[1], softcap=softcap, alibi_slopes=alibi, dropout_p=dropout_p,
                rng_seed=seed, rng_offset=offset)


def _forward(backend, q, k, v, options):
    out = torch.full_like(q, float("nan"))
    if options["cu_seqlens_q"] is None:
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device=q.device)
    else:
        lse = torch.full((q.shape[1], q.shape[0]), float("nan"), device=q.device)
    backend.forward(q, k, v, out, lse, **options)
    return out, lse


def _backward(backend, dout, q, k, v, out, lse, options, deterministic=False):
    dq, dk, dv = (torch.full_like(x, float("nan")) for x in (q, k, v))
    poison_free_memory()  # the workspace run_bwd allocates next starts as NaN
    backend.backward(dout, q, k, v, out, lse, dq, dk, dv, deterministic=deterministic, **options)
    torch.cuda.synchronize()
    return dq, dk, dv


def _naive_grads(q, k, v, dout, compute_dtype, naive_options):
    leaves = [x.detach().to(compute_dtype).requires_grad_() for x in (q, k, v)]
    out, _ = naive_attention(*leaves, compute_dtype=compute_dtype, **naive_options)
    out.backward(dout.to(compute_dtype))
    return [x.grad for x in leaves]


def _check_grads(grads, q, k, v, dout, naive_options, factor=GRAD_FACTOR):
    ref = _naive_grads(q, k, v, dout, torch.float64, naive_options)
    low = _naive_grads(q, k, v, dout, q.dtype, naive_options)
    for name, got, r, lo in zip(("dq", "dk", "dv"), grads, ref, low):
        assert_within(name, got, r, lo, factor)


def _run_and_check(q, k, v, *, naive_options, deterministic=False, dout=None, **opts):
    options = _options(q, **opts)
    out, lse = _forward(BACKEND, q, k, v, options)
    dout = torch.randn_like(out) if dout is None else dout
    grads = _backward(BACKEND, dout, q, k, v, out, lse, options, deterministic)
    _check_grads(grads, q, k, v, dout, naive_options)
    return grads


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_grid(dtype, head_dim, seqlens, causal):
    q, k, v = grid_inputs(dtype, head_dim, seqlens)
    window = (-1, 0 if causal else -1)
    _run_and_check(q, k, v, window=window, naive_options=dict(causal=causal))


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


def _alibi(kind, batch, heads):
    if kind == "h":
        return torch.rand(heads, device="cuda") * 0.3
    if kind == "bh":
        return torch.rand(batch, heads, device="cuda") * 0.3
    return None


# Note [portattn backward zeroing] (bwd_kernel.cuh): the preprocess clears the accumulators the
# main kernel adds into, unless that would leave its CTAs more than 64 KiB each, when a memset
# does. 256 x 256 with GQA takes the first path; 1 query row against 4096 keys the second (hd128:
# one preprocess CTA per (batch, head), 8 of them, for 8 MiB of GQA dK / dV accumulators). The
# workspace starts NaN (_backward poisons the allocator's free memory), so an uncleared byte fails.
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "det"])
@pytest.mark.parametrize("seqlens", [(256, 256), (1, 4096)], ids=["preprocess_zeroes", "memset_zeroes"])
def test_backward_accumulators_start_at_zero(seqlens, deterministic):
    head_dim = 128 if 128 in HEAD_DIMS else HEAD_DIMS[-1]
    batch, heads, gqa = 2, 4, 4
    q = rand(batch, seqlens[0], heads, head_dim, dtype=torch.bfloat16)
    k = rand(batch, seqlens[1], heads // gqa, head_dim, dtype=torch.bfloat16)
    v = rand(batch, seqlens[1], heads // gqa, head_dim, dtype=torch.bfloat16)
    _run_and_check(q, k, v, deterministic=deterministic, naive_options={})


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("gqa", [1, 6], ids=lambda g: f"group{g}")
@pytest.mark.parametrize("seqlens", [(113, 203), (1000, 1000)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("head_dim", [80, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=str)
def test_backward_features(dtype, head_dim, feature, seqlens, gqa, deterministic):
    opts = dict(FEATURES[feature])
    seqlen_q, seqlen_k = seqlens
    batch, heads = 2, 6
    q = rand(batch, seqlen_q, heads, head_dim, dtype=dtype)
    k = rand(batch, seqlen_k, heads // gqa, head_dim, dtype=dtype)
    v = rand(batch, seqlen_k, heads // gqa, head_dim, dtype=dtype)
    alibi = _alibi(opts.pop("alibi", None), batch, heads)
    naive_options = dict(opts, alibi_slopes=alibi)
    _run_and_check(q, k, v, alibi=alibi, deterministic=deterministic, naive_options=naive_options,
                   **opts)


VARLEN = {
    "mixed": ([0, 1, 17, 113, 300, 1], [5, 1, 0, 200, 300, 64]),
    "equal": ([128, 1, 129], [128, 1, 129]),
    "long": ([1000, 3, 0], [700, 1500, 0]),
}


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("gqa", [1, 4], ids=lambda g: f"group{g}")
@pytest.mark.parametrize("lengths", list(VARLEN))
@pytest.mark.parametrize("head_dim", [64, 72, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_varlen(dtype, head_dim, lengths, gqa, causal, deterministic):
    lens_q, lens_k = VARLEN[lengths]
    heads = 4
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(torch.int32)
    q = rand(sum(lens_q), heads, head_dim, dtype=dtype)
    k = rand(sum(lens_k), heads // gqa, head_dim, dtype=dtype)
    v = rand(sum(lens_k), heads // gqa, head_dim, dtype=dtype)
    window = (-1, 0 if causal else -1)
    _run_and_check(q, k, v, window=window, cu_q=cu_q, cu_k=cu_k, max_q=max(lens_q),
                   max_k=max(lens_k), deterministic=deterministic,
                   naive_options=dict(causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k))


@pytest.mark.parametrize("layout", ["qkv_packed", "heads_first", "kv_packed_sliced"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_backward_strided_inputs_and_grads(layout, head_dim):
    dtype, batch, seqlen, heads = torch.bfloat16, 2, 300, 4
    if layout == "qkv_packed":
        q, k, v = rand(batch, seqlen, 3, heads, head_dim, dtype=dtype).unbind(2)
    elif layout == "heads_first":
        q, k, v = (rand(batch, heads, seqlen, head_dim, dtype=dtype).transpose(1, 2) for _ in range(3))
    else:
        q = rand(batch, seqlen + 64, heads, head_dim, dtype=dtype)[:, 32 : 32 + seqlen]
        k, v = rand(batch, seqlen, heads, 2, head_dim, dtype=dtype).unbind(3)
    options = _options(q, window=(-1, 0))
    out, lse = _forward(BACKEND, q, k, v, options)
    # dout heads-first (non-contiguous), gradients written into strided views.
    dout = rand(batch, heads, seqlen, head_dim, dtype=dtype).transpose(1, 2)
    grads = torch.full((3, batch, heads, seqlen, head_dim), float("nan"), device="cuda", dtype=dtype)
    dq, dk, dv = (g.transpose(1, 2) for g in grads)
    BACKEND.backward(dout, q, k, v, out, lse, dq, dk, dv, deterministic=False, **options)
    torch.cuda.synchronize()
    _check_grads((dq, dk, dv), q, k, v, dout, dict(causal=True))
    dense = _backward(BACKEND, dout.contiguous(), q, k, v, out, lse, options, deterministic=True)
    det = _backward(BACKEND, dout, q, k, v, out, lse, options, deterministic=True)
    for a, b in zip(dense, det):
        assert torch.equal(a, b), "a strided dout must give the same deterministic gradients"


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("gqa", [1, 3], ids=lambda g: f"group{g}")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("p", [0.17, 0.5])
def test_backward_dropout_matches_reference_mask(p, head_dim, gqa, varlen):
    dtype, heads = torch.bfloat16, 3
    seed, offset = 1234567, (5 << 32) + 77
    if varlen:
        lens_q, lens_k = [17, 130, 1], [200, 64, 33]
        cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(torch.int32)
        q = rand(sum(lens_q), heads, head_dim, dtype=dtype)
        k = rand(sum(lens_k), heads // gqa, head_dim, dtype=dtype)
        v = rand(sum(lens_k), heads // gqa, head_dim, dtype=dtype)
        batch, max_q, max_k = len(lens_q), max(lens_q), max(lens_k)
        extra = dict(cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k)
        naive_extra = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    else:
        batch, max_q, max_k = 2, 211, 333
        q = rand(batch, max_q, heads, head_dim, dtype=dtype)
        k = rand(batch, max_k, heads // gqa, head_dim, dtype=dtype)
        v = rand(batch, max_k, heads // gqa, head_dim, dtype=dtype)
        extra, naive_extra = {}, {}
    bh = torch.arange(batch * heads, device="cuda").reshape(batch, heads)
    mask = philox_keep_mask(seed, offset, bh, range(max_q), range(max_k), p, device="cuda")
    _run_and_check(q, k, v, window=(-1, 0), dropout_p=p, seed=seed, offset=offset,
                   naive_options=dict(causal=True, dropout_mask=mask, dropout_p=p, **naive_extra),
                   **extra)


CASES = {
    "dense_causal": dict(batch=2, seqlen_q=777, seqlen_k=777, heads=4, heads_k=4, window=(-1, 0)),
    "gqa_window": dict(batch=2, seqlen_q=500, seqlen_k=900, heads=8, heads_k=2, window=(100, 20)),
    "mqa_long": dict(batch=1, seqlen_q=2000, seqlen_k=2000, heads=6, heads_k=1, window=(-1, -1)),
    # Few queries, a window far from the first keys: each deterministic split starts on
    # key blocks no query sees (issue 12 item 7).
    "empty_key_blocks": dict(batch=2, seqlen_q=3, seqlen_k=799, heads=9, heads_k=3, window=(551, 0)),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("head_dim", [64, 128, 192])
def test_deterministic_is_bitwise_reproducible(case, head_dim):
    c = CASES[case]
    dtype = torch.bfloat16
    q = rand(c["batch"], c["seqlen_q"], c["heads"], head_dim, dtype=dtype)
    k = rand(c["batch"], c["seqlen_k"], c["heads_k"], head_dim, dtype=dtype)
    v = rand(c["batch"], c["seqlen_k"], c["heads_k"], head_dim, dtype=dtype)
    options = _options(q, window=c["window"])
    out, lse = _forward(BACKEND, q, k, v, options)
    dout = torch.randn_like(out)
    first = _backward(BACKEND, dout, q, k, v, out, lse, options, deterministic=True)
    for _ in range(3):
        again = _backward(BACKEND, dout, q, k, v, out, lse, options, deterministic=True)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"deterministic {name} differs between runs"
    naive_options = dict(window=c["window"])
    _check_grads(first, q, k, v, dout, naive_options)
    _check_grads(_backward(BACKEND, dout, q, k, v, out, lse, options), q, k, v, dout, naive_options)


def test_reference_backend_agrees_in_fp32():
    # The fp32 reference backend and the kernel agree within the kernel's own error budget.
    dtype, head_dim = torch.bfloat16, 96
    q = rand(2, 300, 4, head_dim, dtype=dtype)
    k = rand(2, 400, 2, head_dim, dtype=dtype)
    v = rand(2, 400, 2, head_dim, dtype=dtype)
    options = _options(q, window=(50, 0), softcap=10.0)
    out, lse = _forward(BACKEND, q, k, v, options)
    dout = torch.randn_like(out)
    ours = _backward(BACKEND, dout, q, k, v, out, lse, options)
    f32 = [x.float() for x in (q, k, v, out, dout)]
    ref = [torch.empty_like(x) for x in f32[:3]]
    REFERENCE.backward(f32[4], *f32[:4], lse, *ref, deterministic=True, **options)
    low = _naive_grads(q, k, v, dout, dtype, dict(window=(50, 0), softcap=10.0))
    for name, a, r, lo in zip(("dq", "dk", "dv"), ours, ref, low):
        # The fp32 reference backend stands in for the oracle here (the comparison is between backends).
        assert_within(f"{name} vs the fp32 reference backend", a, r, lo, GRAD_FACTOR)


def test_public_api_autograd_uses_cuda_backward():
    import portattn

    dtype = torch.bfloat16
    q, k, v = (rand(2, 257, 4, 64, dtype=dtype).requires_grad_() for _ in range(3))
    out = portattn.flash_attn_func(q, k, v, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    _check_grads((q.grad, k.grad, v.grad), q.detach(), k.detach(), v.detach(), dout, dict(causal=True))


def test_torch_compile_training_step_has_no_graph_break():
    import portattn

    def step(q, k, v):
        # deterministic: the eager rerun below must match bit for bit
        return portattn.flash_attn_func(q, k, v, causal=True, deterministic=True).float().square().mean()

    compiled = torch.compile(step, fullgraph=True)  # fullgraph: a graph break raises
    q, k, v = (rand(2, 129, 4, 64, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    compiled(q, k, v).backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    step(q, k, v).backward()
    for name, a, b in zip(("dq", "dk", "dv"), grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"compiled {name} differs from eager")


@pytest.mark.parametrize("heads_k", [16, 8])
def test_large_calls_run_in_head_chunks(heads_k):
    # A call whose fp32 dQ accumulator passes kMinChunkDqBytes (csrc/bwd_entry.cu) runs as
    # launches over chunks of KV heads; the chunk offsets (query heads, KV heads, GQA
    # groups, the dK/dV accumulators) must not change the result: compare the chunked
    # call with the same heads run as separate, unchunked calls. (Deterministic calls
    # chunk only past 4 GiB of dQ slices, beyond what a test should allocate.)
    batch, seqlen, heads, head_dim, dtype = 1, 32768, 16, 128, torch.bfloat16
    group = heads // heads_k
    # bwd_workspace_layout halves the chunk while half of it still holds >= 128 MiB of dQ.
    dq_per_kv_head = batch * group * seqlen * head_dim * 4
    assert dq_per_kv_head * (heads_k // 2) >= 128 << 20, "this shape is meant to run in head chunks"
    q = rand(batch, seqlen, heads, head_dim, dtype=dtype)
    k = rand(batch, seqlen, heads_k, head_dim, dtype=dtype)
    v = rand(batch, seqlen, heads_k, head_dim, dtype=dtype)
    options = _options(q, window=(-1, 0))
    out, lse = _forward(BACKEND, q, k, v, options)
    dout = torch.randn_like(out)
    whole = _backward(BACKEND, dout, q, k, v, out, lse, options)
    part_k = 2  # KV heads per separate call: small enough to run unchunked
    part_q = part_k * group
    assert dq_per_kv_head * (part_k // 2) < 128 << 20, "the separate calls are meant to run unchunked"
    for h in range(0, heads_k, part_k):
        sq, sk = slice(h * group, h * group + part_q), slice(h, h + part_k)
        parts = _backward(BACKEND, dout[:, :, sq].contiguous(), q[:, :, sq].contiguous(),
                          k[:, :, sk].contiguous(), v[:, :, sk].contiguous(), out[:, :, sq].contiguous(),
                          lse[:, sq].contiguous(), options)
        for name, got, want in zip(("dq", "dk", "dv"), (whole[0][:, :, sq], whole[1][:, :, sk],
                                                       whole[2][:, :, sk]), parts):
            assert not got.isnan().any(), f"{name} of heads {h}.. left unwritten"
            # fp32 atomics sum in a different order per launch: a few bf16 ulps, no more.
            diff = (got.float() - want.float()).abs().max().item()
            assert diff <= 2e-2 * want.float().abs().max().item(), f"{name} heads {h}..: chunked differs by {diff}"


def test_flash_attn_deterministic_case_is_bitwise_reproducible_on_dirty_memory():
    """flash-attn's test_flash_attn_deterministic[3-799-False-192-True-True-dtype0], through the
    public API: 50 reruns of the backward, each on freshly NaN-poisoned free memory with a
    cold L2, give the first run's gradients bit for bit, and those meet the error rule.

    It failed (issue 12 item 7) because each deterministic split began with key blocks
    outside the window, whose K/V copies were issued and never waited for.
    """
    import portattn

    torch.manual_seed(0)
    dtype, batch, heads, seqlen_q, seqlen_k, head_dim = torch.float16, 4, 9, 3, 799, 192
    window = (551, 632)  # with causal=True the right bound becomes 0, as in flash-attn
    q = rand(batch, seqlen_q, heads, head_dim, dtype=dtype).requires_grad_()
    k = rand(batch, seqlen_k, heads, head_dim, dtype=dtype).requires_grad_()
    v = rand(batch, seqlen_k, heads, head_dim, dtype=dtype).requires_grad_()
    out = portattn.flash_attn_func(q, k, v, 0.0, causal=True, window_size=window, deterministic=True)
    g = torch.randn_like(out)
    poison_free_memory()
    first = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    for rerun in range(50):
        poison_free_memory()
        again = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"rerun {rerun}: deterministic {name} differs from the first run"
    _check_grads(first, q.detach(), k.detach(), v.detach(), g, dict(causal=True, window=window))


# ---- the full-head-dim kernel above head dim 128 (the default; PORTATTN_SM80_BWD_WIDE=0: halves) ----
# Note [portattn sm80 wide backward] (csrc/bwd_wide_kernel.cuh): one CTA keeps the whole head dim,
# dK/dV split over warps, tiles by the shared-memory budget (BwdWideConfigsFor in bwd_launch.cuh).
# Each test runs under three budgets in one process: the device's own, 163 KiB (the A100's tiles)
# and 99 KiB (the sm86/sm89 tiles; 48 x 32 with 6 warps at head dim 256; at 96 and 128 those parts keep
# bwd_kernel, so those cases skip there). 112, 200 and 248 run the 128, 224 and 256 kernels with a
# zero-filled tail.
WIDE_HEAD_DIMS = [64, 96, 112, 128, 160, 192, 200, 224, 248, 256]
WIDE_BUDGETS = {"own": None, "163kib": 163, "99kib": 99}


@pytest.fixture(params=list(WIDE_BUDGETS))
def wide_budget(request, monkeypatch):
    """The wide kernel on (environment variable and the module's switch) under one budget (KiB,
    None: the process's); both restored afterwards."""
    from portattn.backends.cuda import _C

    # The setting before the test first: the module reads the variable once, at its first read, so
    # reading it after setenv would take the "1" for the setting to restore and leave the switch on.
    wide_before, cap_before = _C.sm80_bwd_wide(), _C.smem_cap()
    monkeypatch.setenv("PORTATTN_SM80_BWD_WIDE", "1")
    _C.sm80_bwd_wide(True)
    kib = WIDE_BUDGETS[request.param]
    if kib is not None:
        _C.set_smem_cap(kib * 1024)
    yield kib
    _C.sm80_bwd_wide(wide_before)
    _C.set_smem_cap(cap_before)


def _wide_tile(head_dim):
    """The tile the wide switch gives this call's kernel head dim under the current budget."""
    from portattn.backends.cuda import _C

    kernel_dim = next(d for d in (64, 96, 128, 160, 192, 224, 256) if d >= head_dim)
    props = torch.cuda.get_device_properties(0)
    own = getattr(props, "shared_memory_per_block_optin", 0) or 99 * 1024  # every sm80+ part has 99 KiB
    budget = min(own, _C.smem_cap()) if _C.smem_cap() > 0 else own
    tile = _C.bwd_tile(kernel_dim, budget)
    if kernel_dim <= 128 and not tile["wide"]:
        pytest.skip(f"head dim {kernel_dim} under a {budget // 1024} KiB budget runs bwd_kernel (the wide tile needs more)")
    assert tile["wide"] and tile["dsplit"] == 1 and tile["smem_bytes"] <= budget, tile
    return tile


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(1, 1), (17, 113), (113, 17), (1000, 1000), (1, 4097), (300, 1000)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("head_dim", WIDE_HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_wide_backward_grid(wide_budget, dtype, head_dim, seqlens, causal):
    _wide_tile(head_dim)
    q, k, v = grid_inputs(dtype, head_dim, seqlens)
    _run_and_check(q, k, v, window=(-1, 0 if causal else -1), naive_options=dict(causal=causal))


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("gqa", [1, 6], ids=lambda g: f"group{g}")
@pytest.mark.parametrize("seqlens", [(113, 203), (1000, 1000)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("head_dim", [64, 128, 160, 192, 256])
def test_wide_backward_features(wide_budget, head_dim, feature, seqlens, gqa, deterministic):
    _wide_tile(head_dim)
    test_backward_features(torch.bfloat16, head_dim, feature, seqlens, gqa, deterministic)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("gqa", [1, 4], ids=lambda g: f"group{g}")
@pytest.mark.parametrize("lengths", list(VARLEN))
@pytest.mark.parametrize("head_dim", [64, 128, 160, 192, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_wide_backward_varlen(wide_budget, dtype, head_dim, lengths, gqa, causal, deterministic):
    _wide_tile(head_dim)
    test_backward_varlen(dtype, head_dim, lengths, gqa, causal, deterministic)


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("gqa", [1, 3], ids=lambda g: f"group{g}")
@pytest.mark.parametrize("head_dim", [64, 128, 160, 192, 256])
@pytest.mark.parametrize("p", [0.17, 0.5])
def test_wide_backward_dropout_matches_reference_mask(wide_budget, p, head_dim, gqa, varlen):
    _wide_tile(head_dim)
    test_backward_dropout_matches_reference_mask(p, head_dim, gqa, varlen)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("head_dim", [64, 128, 160, 192, 256])
def test_wide_deterministic_is_bitwise_reproducible(wide_budget, case, head_dim):
    _wide_tile(head_dim)
    test_deterministic_is_bitwise_reproducible(case, head_dim)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "det"])
def test_wide_switch_selects_the_kernel(deterministic):
    """Off (PORTATTN_SM80_BWD_WIDE=0): the head-dim halves (dsplit 2); on (the default): the wide
    kernel (dsplit 1). Both meet the error rule on the same call, and in the deterministic mode their
    workspaces differ (the wide kernel's splits count one CTA per KV head, not two)."""
    from portattn.backends.cuda import _C

    head_dim, before = 256, _C.sm80_bwd_wide()
    q = rand(2, 500, 4, head_dim, dtype=torch.bfloat16)
    k = rand(2, 700, 2, head_dim, dtype=torch.bfloat16)
    v = rand(2, 700, 2, head_dim, dtype=torch.bfloat16)
    try:
        for on in (False, True):
            _C.sm80_bwd_wide(on)
            assert _C.bwd_tile(head_dim, 99 * 1024)["dsplit"] == (1 if on else 2)
            _run_and_check(q, k, v, window=(-1, 0), deterministic=deterministic, naive_options=dict(causal=True))
    finally:
        _C.sm80_bwd_wide(before)


# The three budgets above never pick hd192's 64 x 64 x 1 tile (115200 B): an sm90 or sm80 budget fits
# 64 x 64 x 2 (164864 B), a 99 KiB one only 64 x 32 x 1. A cap between the two (PORTATTN_MAX_SMEM_KIB=128)
# runs it, so it is tested here on its own (184: the same kernel with a zero-filled tail; 200 would
# run hd224's kernel, whose 64 x 64 x 1 needs 131584 B and so takes 64 x 32 under this cap).
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(17, 113), (300, 1000)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("head_dim", [192, 184])
def test_wide_backward_under_a_128_kib_cap(head_dim, seqlens, causal, deterministic):
    from portattn.backends.cuda import _C

    wide_before, cap_before = _C.sm80_bwd_wide(), _C.smem_cap()
    try:
        _C.sm80_bwd_wide(True)
        _C.set_smem_cap(128 * 1024)
        own = getattr(torch.cuda.get_device_properties(0), "shared_memory_per_block_optin", 0) or 99 * 1024
        if own < 128 * 1024:
            pytest.skip(f"this GPU's own shared-memory budget ({own} B) is below the 128 KiB cap")
        tile = _wide_tile(head_dim)
        assert (tile["block_n"], tile["block_m"], tile["stages"], tile["warps"]) == (64, 64, 1, 8), tile
        q, k, v = grid_inputs(torch.bfloat16, head_dim, seqlens)
        _run_and_check(q, k, v, window=(-1, 0 if causal else -1), deterministic=deterministic,
                       naive_options=dict(causal=causal))
    finally:
        _C.sm80_bwd_wide(wide_before)
        _C.set_smem_cap(cap_before)
