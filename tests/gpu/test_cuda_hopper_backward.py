"""GPU tests of the sm_90a backward kernel (csrc/hopper_bwd_*), called directly and through dispatch.

`_C.hopper_bwd` exists when the build's archs include sm_90; it takes `_C.bwd`'s
arguments and workspace. Everything here skips with the reason otherwise, and on
any GPU but sm_90.

Error rule: tests/error_rule.py, per gradient (within 3x PyTorch's own low-precision error of the
float64 oracle), through tests/gpu/test_cuda_backward.py's `_check_grads`. Gradients are NaN-poisoned before every launch; inputs are fresh random normals; the forward
is the Hopper one (`_C.hopper_fwd`), so its LSE (windows, softcap) is what the backward reads.

Backward modes (`mode`): "atomic" and "bulk" are the default (non-deterministic) mode with dQ
added per element or through shared memory and bulk reductions (PORTATTN_HOPPER_BWD_DQ, switched
in-process with `_C.hopper_bwd_dq_mode`); "det" is the deterministic mode (always per element).

`python tests/gpu/test_cuda_hopper_backward.py` (or pytest -s) also prints the
backward's time against the sm80+ backward and forward+backward against SDPA.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

from cuda_gpu_setup import BACKEND, HOPPER_DTYPES, HOPPER_HEAD_DIMS, rand, skip_unless_hopper  # noqa: E402  (skips without a GPU or without the CUDA backend)

from portattn.backends.cuda import _C, CudaSm90Backend, variants  # noqa: E402
from test_cuda_backward import _backward, _check_grads, _forward, _options  # noqa: E402
from test_cuda_hopper_forward import _median_ms  # noqa: E402

skip_unless_hopper("hopper_bwd")

HOPPER = CudaSm90Backend()
DTYPES = HOPPER_DTYPES  # capability/specs/cuda_sm90.py, through tests/gpu/grids.py
HEAD_DIMS = HOPPER_HEAD_DIMS
# Non-multiples of the 128-key / 64-query blocks, seqlen_q != seqlen_k both ways.
SEQLENS = [(1, 1), (77, 77), (128, 128), (300, 300), (1000, 1000), (77, 300), (1000, 300)]


def _inputs(dtype, head_dim, seqlens, gqa):
    seqlen_q, seqlen_k = seqlens
    batch, heads = 2, 4
    return (rand(batch, seqlen_q, heads, head_dim, dtype=dtype),
            rand(batch, seqlen_k, heads // gqa, head_dim, dtype=dtype),
            rand(batch, seqlen_k, heads // gqa, head_dim, dtype=dtype))


# det: deterministic with per-element ordered adds; det_bulk: deterministic with ordered
# bulk adds (the default; Note [portattn hopper ordered dQ]).
MODES = ["atomic", "bulk", "det", "det_bulk"]


@contextlib.contextmanager
def _dq_path(mode):
    """Runs the block with mode's dQ path; yields whether the call is deterministic."""
    before = _C.hopper_bwd_dq_mode()
    _C.hopper_bwd_dq_mode("bulk" if mode in ("bulk", "det_bulk") else "atomic")
    try:
        yield mode.startswith("det")
    finally:
        _C.hopper_bwd_dq_mode(before if before != "invalid" else "auto")


def _hopper_grads(q, k, v, deterministic, window=(-1, -1), softcap=0.0):
    # The Hopper forward's LSE feeds the Hopper backward: the contract between the two is tested.
    options = _options(q, window=window, softcap=softcap)
    out, lse = _forward(HOPPER, q, k, v, options)
    dout = torch.randn_like(out)
    grads = _backward(HOPPER, dout, q, k, v, out, lse, options, deterministic)
    return grads, dout, (out, lse, options)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("gqa", [1, 4], ids=lambda g: f"group{g}")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_hopper_backward_grid(dtype, head_dim, seqlens, causal, gqa, mode):
    q, k, v = _inputs(dtype, head_dim, seqlens, gqa)
    with _dq_path(mode) as deterministic:
        grads, dout, _ = _hopper_grads(q, k, v, deterministic, window=(-1, 0 if causal else -1))
    _check_grads(grads, q, k, v, dout, dict(causal=causal))


# Both ways the accumulators are cleared (Note [portattn backward zeroing]; the sm80+ path's
# test_backward_accumulators_start_at_zero says which shape takes which), on the Hopper kernels.
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seqlens", [(256, 256), (1, 4096)], ids=["preprocess_zeroes", "memset_zeroes"])
def test_hopper_backward_accumulators_start_at_zero(seqlens, mode):
    head_dim = 128 if 128 in HEAD_DIMS else HEAD_DIMS[-1]
    q, k, v = _inputs(torch.bfloat16, head_dim, seqlens, 4)
    with _dq_path(mode) as deterministic:
        grads, dout, _ = _hopper_grads(q, k, v, deterministic)
    _check_grads(grads, q, k, v, dout, {})


# 64 query steps per key block: the pipelined hand-off of dQ (Note [portattn hopper backward
# pipeline]) and, without a mask at hd64, the consumers' turns at the whole dQ tile (Note [portattn
# hopper dQ by step], its two dS^T barrier ids) run for many steps, with GQA's head walk in the
# deterministic mode; the grid above stops at 16 steps.
@pytest.mark.parametrize("mode", ["bulk", "det_bulk", "atomic"])
@pytest.mark.parametrize("causal", [False, True])
def test_hopper_backward_long_sequences(causal, mode):
    if 64 not in HEAD_DIMS:
        pytest.skip("this build has no hd64 Hopper backward")
    q, k, v = _inputs(torch.bfloat16, 64, (4096, 4096), 4)
    with _dq_path(mode) as deterministic:
        grads, dout, _ = _hopper_grads(q, k, v, deterministic, window=(-1, 0 if causal else -1))
    _check_grads(grads, q, k, v, dout, dict(causal=causal))


# (window_left, window_right) as the Hopper forward's tests: sliding windows both sides, left only,
# right only, causal with a left bound, and one key per query; seqlen_q > seqlen_k leaves the first
# rows without any visible key (lse = -inf: their P must be 0, not NaN).
WINDOWS = [(64, 0), (100, 37), (-1, 50), (300, -1), (0, 0)]
WINDOW_SEQLENS = [(1000, 1000), (300, 777), (777, 300)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("gqa", [1, 4], ids=lambda g: f"group{g}")
@pytest.mark.parametrize("softcap", [0.0, 30.0], ids=lambda c: f"softcap{c:g}")
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("seqlens", WINDOW_SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_hopper_backward_windows_and_softcap(head_dim, seqlens, window, softcap, gqa, mode):
    q, k, v = _inputs(torch.bfloat16, head_dim, seqlens, gqa)
    with _dq_path(mode) as deterministic:
        grads, dout, _ = _hopper_grads(q, k, v, deterministic, window=window, softcap=softcap)
    _check_grads(grads, q, k, v, dout, dict(window=window, softcap=softcap))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (100, 37)], ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_hopper_backward_softcap_fp16(head_dim, window, mode):
    # A small cap (5) puts most scores on tanh's flat part, where (1 - tanh^2) matters most.
    q, k, v = _inputs(torch.float16, head_dim, (777, 513), 2)
    with _dq_path(mode) as deterministic:
        grads, dout, _ = _hopper_grads(q, k, v, deterministic, window=window, softcap=5.0)
    _check_grads(grads, q, k, v, dout, dict(window=window, softcap=5.0))


# Packed sequences (cu_seqlens), as the Hopper forward's varlen tests: empty sequences on either
# side, single rows, lengths across the 64-query / 128-key block edges, seqlen_q != seqlen_k per
# sequence, and many sequences (more key blocks than SMs). The kernels load whole blocks by TMA,
# so a tile's rows past its sequence's end are the next sequence's: a dQ row or dK/dV row of the
# neighbour written, or its keys/queries not masked, shows up as a wrong gradient there.
VARLEN_LENGTHS = {
    "mixed": ([0, 1, 17, 130, 257, 1000, 64], [5, 0, 300, 129, 257, 900, 1]),
    "many": ([128] * 40 + [77], [128] * 40 + [300]),
}
VARLEN_OPTIONS = {
    "full": dict(),
    "causal": dict(window=(-1, 0)),
    "window": dict(window=(100, 37)),
    "softcap": dict(window=(-1, 0), softcap=30.0),
}


def _varlen_inputs(lengths, head_dim, gqa, dtype=torch.bfloat16):
    lens_q, lens_k = VARLEN_LENGTHS[lengths]
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(torch.int32)
    heads = 4
    q = rand(sum(lens_q), heads, head_dim, dtype=dtype)
    k, v = (rand(sum(lens_k), heads // gqa, head_dim, dtype=dtype) for _ in range(2))
    return q, k, v, dict(cu_q=cu_q, cu_k=cu_k, max_q=max(lens_q), max_k=max(lens_k))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("options", list(VARLEN_OPTIONS))
@pytest.mark.parametrize("gqa", [1, 4], ids=lambda g: f"group{g}")
@pytest.mark.parametrize("lengths", list(VARLEN_LENGTHS))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_hopper_backward_varlen(head_dim, lengths, gqa, options, mode):
    q, k, v, packed = _varlen_inputs(lengths, head_dim, gqa)
    feature = VARLEN_OPTIONS[options]
    opts = _options(q, **feature, **packed)
    with _dq_path(mode) as deterministic:
        out, lse = _forward(HOPPER, q, k, v, opts)
        dout = torch.randn_like(out)
        grads = _backward(HOPPER, dout, q, k, v, out, lse, opts, deterministic)
    _check_grads(grads, q, k, v, dout, dict(window=feature.get("window", (-1, -1)),
                                             softcap=feature.get("softcap", 0.0),
                                             cu_seqlens_q=packed["cu_q"], cu_seqlens_k=packed["cu_k"]))


@pytest.mark.parametrize("mode", ["det", "det_bulk"])
def test_hopper_backward_varlen_deterministic_is_bitwise_reproducible(mode):
    q, k, v, packed = _varlen_inputs("mixed", HEAD_DIMS[-1], 2)
    opts = _options(q, window=(-1, 0), **packed)
    with _dq_path(mode):
        out, lse = _forward(HOPPER, q, k, v, opts)
        dout = torch.randn_like(out)
        first = _backward(HOPPER, dout, q, k, v, out, lse, opts, True)
        repeats = [_backward(HOPPER, dout, q, k, v, out, lse, opts, True) for _ in range(3)]
    for again in repeats:
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"deterministic varlen {name} differs between runs"


@pytest.mark.parametrize("mode", ["det", "det_bulk"])
@pytest.mark.parametrize("window, softcap", [((-1, 0), 0.0), ((100, 37), 30.0)], ids=["causal", "window_softcap"])
@pytest.mark.parametrize("gqa", [1, 4], ids=lambda g: f"group{g}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_hopper_deterministic_is_bitwise_reproducible(head_dim, gqa, window, softcap, mode):
    q, k, v = _inputs(torch.bfloat16, head_dim, (1000, 1000), gqa)
    with _dq_path(mode):
        first, dout, (out, lse, options) = _hopper_grads(q, k, v, True, window=window, softcap=softcap)
        repeats = [_backward(HOPPER, dout, q, k, v, out, lse, options, True) for _ in range(3)]
    for again in repeats:
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"deterministic {name} differs between runs"


# Issue 11: compute-sanitizer racecheck reports WAR hazards on the backward's LSE/delta ring
# (archive:2026-11-24-794d271/racecheck_hopper_bwd.log: consumer lanes read
# s_lse/s_delta of a stage, producer warp 1 rewrites that stage kStages query blocks later).
# The two are ordered by the stage's mbarriers, which racecheck does not model: each consumer
# warp's lanes __syncwarp, lane 0 arrives on bar_empty (mbarrier.arrive: release, CTA scope),
# warp 1 waits on it (mbarrier.try_wait: acquire) before its st.shared; the reverse direction
# (writes before the reads) goes through bar_full the same way. This test is the hardware side
# of that argument: every 64-row query block gets LSE and delta far from its neighbours' (query
# rows and dout rows scaled per block), and each CTA cycles its stage ring at least 6 times,
# so a consumer reading a slot too early (the previous block's values) or too late (the next
# block's) would be off by factors of e^(LSE difference), hundreds of times the error rule.
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_hopper_lse_delta_ring_is_ordered_by_its_mbarriers(head_dim, mode):
    block, stages = 64, (4 if head_dim <= 64 else 2)  # HopperBwdTraits: kBlockM, kStages
    seqlen = block * stages * 6
    row_scale = torch.tensor([0.25, 3.0, 1.0, 2.0, 0.5, 4.0], device="cuda")
    per_row = row_scale[(torch.arange(seqlen, device="cuda") // block) % len(row_scale)]
    for _ in range(3):  # fresh inputs each time
        q, k, v = _inputs(torch.bfloat16, head_dim, (seqlen, seqlen), 2)
        q = (q.float() * per_row[None, :, None, None]).to(q.dtype)
        options = _options(q)
        with _dq_path(mode) as deterministic:
            out, lse = _forward(HOPPER, q, k, v, options)
            dout = torch.randn_like(out) * per_row.flip(0)[None, :, None, None].to(out.dtype)
            grads = _backward(HOPPER, dout, q, k, v, out, lse, options, deterministic)
        spread = lse.float().view(-1, seqlen // block, block).mean(-1)
        assert (spread.max(-1).values - spread.min(-1).values).min() > 1.0, "blocks' LSEs not spread apart"
        _check_grads(grads, q, k, v, dout, {})


@pytest.mark.parametrize("mode", ["atomic", "bulk"])
def test_hopper_backward_in_head_chunks_matches_the_sm80_backward(mode):
    # 32k tokens, 16 query / 8 KV heads: the fp32 dQ scratch passes 128 MiB, so the launch runs in
    # two chunks of KV heads (bwd_workspace_layout). Too long for the float64 oracle: compared with
    # the sm80+ backward on the same inputs, within a few bf16 ulps of the largest gradient (a wrong
    # chunk offset gives whole heads of garbage or NaN, far outside that).
    batch, seqlen, heads, heads_k, head_dim = 1, 32768, 16, 8, 128
    unchunked = 4 * batch * seqlen * head_dim * (heads + 2 * heads_k)  # fp32 dQ + the GQA dK/dV sums
    workspace = _C.bwd_workspace_bytes(batch, heads, heads_k, head_dim, seqlen, seqlen, False)
    assert workspace < 0.6 * unchunked, "this shape is meant to run in head chunks"
    q = rand(batch, seqlen, heads, head_dim, dtype=torch.bfloat16)
    k, v = (rand(batch, seqlen, heads_k, head_dim, dtype=torch.bfloat16) for _ in range(2))
    options = _options(q, window=(-1, 0))
    out, lse = _forward(BACKEND, q, k, v, options)
    dout = torch.randn_like(out)
    with _dq_path(mode):
        ours = _backward(HOPPER, dout, q, k, v, out, lse, options)
    sm80 = _backward(BACKEND, dout, q, k, v, out, lse, options)
    for name, a, b in zip(("dq", "dk", "dv"), ours, sm80):
        assert not a.isnan().any(), f"{name} has NaN"
        scale = b.float().abs().max().item()
        assert (a.float() - b.float()).abs().max().item() <= 4 * 2**-8 * scale, f"{name} differs from sm80+"


@pytest.mark.parametrize("mode", ["atomic", "bulk"])
def test_hopper_backward_strided_views(mode):
    # q/k/v as views of one packed (B, S, H + 2 Hk, D) tensor, GQA 2; gradients into strided views.
    batch, seqlen, heads, heads_k, head_dim = 2, 300, 4, 2, 128
    packed = rand(batch, seqlen, heads + 2 * heads_k, head_dim, dtype=torch.bfloat16)
    q, k, v = packed.split([heads, heads_k, heads_k], dim=2)
    with _dq_path(mode):
        grads, dout, _ = _hopper_grads(q, k, v, False, window=(-1, 0))
    _check_grads(grads, q, k, v, dout, dict(causal=True))


def _in_wider(x, width, fill):
    """x as the first x.shape[-1] columns of a `width`-column tensor whose other columns hold `fill`."""
    wide = torch.full((*x.shape[:-1], width), fill, dtype=x.dtype, device=x.device)
    wide[..., :x.shape[-1]] = x
    return wide[..., :x.shape[-1]]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("gqa", [1, 2], ids=lambda g: f"group{g}")
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("head_dim", sorted(variants.HOPPER_BWD_PADDED))
def test_hopper_backward_padded_head_dims_read_and_write_only_their_columns(head_dim, varlen, gqa, mode):
    # hd96 runs padded on the hd128 kernel (Note [portattn hopper padded head dims], backward part).
    # Every operand is the first head_dim columns of a kernel-wide buffer: NaN past them in q, k,
    # v, dout (the loads must zero-fill there, not read the buffer), and a sentinel in dq, dk, dv
    # that must survive (the dK/dV TMA stores clip at head_dim, the direct stores of varlen partial
    # blocks skip those columns, the convert kernels write head_dim). GQA in the default mode adds
    # dK/dV through the kernel-wide fp32 accumulator rows; varlen puts key blocks past their
    # sequence's end.
    if head_dim not in _C.build_config()["hopper"]["head_dims"]:
        pytest.skip(f"this build does not serve head dim {head_dim} on the Hopper path (PORTATTN_HEADDIMS)")
    sentinel, width = 7.0, variants.HOPPER_BWD_PADDED[head_dim]
    if varlen:
        q, k, v, packed = _varlen_inputs("mixed", head_dim, gqa)
    else:
        (q, k, v), packed = _inputs(torch.bfloat16, head_dim, (300, 1000), gqa), {}
    q, k, v = (_in_wider(x, width, float("nan")) for x in (q, k, v))
    opts = _options(q, window=(-1, 0), **packed)
    with _dq_path(mode) as deterministic:
        out, lse = _forward(HOPPER, q, k, v, opts)
        dout = _in_wider(torch.randn_like(out), width, float("nan"))
        grads = [_in_wider(torch.full_like(x, float("nan")), width, sentinel) for x in (q, k, v)]
        HOPPER.backward(dout, q, k, v, out, lse, *grads, deterministic=deterministic, **opts)
        torch.cuda.synchronize()
    for name, grad in zip(("dq", "dk", "dv"), grads):
        assert bool((grad._base[..., head_dim:] == sentinel).all()), f"{name}: columns past {head_dim} written"
    naive = dict(causal=True)
    if varlen:
        naive.update(cu_seqlens_q=packed["cu_q"], cu_seqlens_k=packed["cu_k"])
    _check_grads(grads, q, k, v, dout, naive)


@pytest.mark.parametrize("value, expected", [("bulk", "bulk"), ("atomic", "atomic"), ("", "auto"), ("auto", "auto"),
                                             ("bogus", "invalid")])
def test_hopper_bwd_dq_env_is_read_at_the_first_call(value, expected):
    # A fresh process per value: the variable is read once. An invalid value fails every Hopper
    # backward with a message naming the variable; the setter repairs it.
    code = (
        "import torch, sys; sys.path.insert(0, 'tests/gpu'); sys.path.insert(0, 'tests')\n"
        "from portattn.backends.cuda import _C\n"
        "from test_cuda_hopper_backward import _inputs, _hopper_grads\n"
        "print('mode', _C.hopper_bwd_dq_mode())\n"
        "q, k, v = _inputs(torch.bfloat16, 64, (77, 77), 1)\n"
        "try:\n    _hopper_grads(q, k, v, False)\n    print('ran')\n"
        "except RuntimeError as error:\n    print('error', error)\n"
        "_C.hopper_bwd_dq_mode('bulk'); _hopper_grads(q, k, v, False); print('after set', _C.hopper_bwd_dq_mode())\n"
    )
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    env = dict(os.environ, PORTATTN_HOPPER_BWD_DQ=value)
    result = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"mode {expected}" in result.stdout
    if expected == "invalid":
        assert "PORTATTN_HOPPER_BWD_DQ" in result.stdout and "'bogus'" in result.stdout
    else:
        assert "ran" in result.stdout
    assert "after set bulk" in result.stdout


def test_hopper_backward_refuses_what_it_does_not_serve():
    q = rand(1, 64, 2, 64, dtype=torch.bfloat16)
    options = _options(q, dropout_p=0.1)
    out, lse = _forward(BACKEND, q, q, q, options)
    with pytest.raises(RuntimeError, match="dropout"):
        _backward(HOPPER, torch.randn_like(out), q, q, q, out, lse, options)


def test_dispatch_serves_training_calls_on_the_hopper_path():
    import portattn

    q, k, v = (rand(2, 300, 4, 128, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    assert portattn.explain(q, k, v, causal=True).chosen == "cuda-sm90"
    # hd96 trains on the Hopper path too (padded on the hd128 kernels; a build restricted by
    # PORTATTN_HEADDIMS may lack it, and then dispatch rightly looks elsewhere).
    if 96 in _C.build_config()["hopper"]["head_dims"]:
        q96, k96, v96 = (rand(2, 300, 4, 96, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
        assert portattn.explain(q96, k96, v96, causal=True).chosen == "cuda-sm90"
    assert portattn.explain(q, k, v, causal=True, deterministic=True).chosen == "cuda-sm90"
    assert portattn.explain(q, k, v, window_size=(64, 0), softcap=30.0).chosen == "cuda-sm90"
    assert portattn.explain(q, k, v, dropout_p=0.1).chosen == "cuda"  # declared: sm80+ path only
    # Varlen training (HF's padding-free packing) stays on the Hopper path for both passes.
    lens = [300, 17, 513]
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    packed = [rand(sum(lens), 4, 128, dtype=torch.bfloat16).requires_grad_() for _ in range(3)]
    assert portattn.explain(*packed, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=513, max_seqlen_k=513,
                            causal=True).chosen == "cuda-sm90"
    out = portattn.flash_attn_varlen_func(*packed, cu, cu, 513, 513, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    _check_grads([x.grad for x in packed], *(x.detach() for x in packed), dout,
                 dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu))
    out = portattn.flash_attn_func(q, k, v, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    _check_grads((q.grad, k.grad, v.grad), q.detach(), k.detach(), v.detach(), dout, dict(causal=True))


# ---- timing ------------------------------------------------------------------------------

def timing_table():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import portattn

    rows = ["| hd | seqlen | causal | bwd hopper TFLOP/s | hopper deterministic | bwd sm80+ TFLOP/s | "
            "fwd+bwd ours ms | SDPA flash ms | SDPA cuDNN ms |", "|---|---|---|---|---|---|---|---|---|"]
    for head_dim, heads in ((64, 32), (128, 16)):
        for seqlen in (4096, 16384):
            batch = 16384 // seqlen
            q, k, v = (rand(batch, seqlen, heads, head_dim, dtype=torch.bfloat16) for _ in range(3))
            for causal in (False, True):
                options = _options(q, window=(-1, 0 if causal else -1))
                out, lse = _forward(BACKEND, q, k, v, options)
                dout = torch.randn_like(out)
                grads = [torch.empty_like(x) for x in (q, k, v)]
                flops = 2.5 * 4 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
                timed = {}
                for name, backend, det in (("hopper", HOPPER, False), ("det", HOPPER, True),
                                           ("sm80", BACKEND, False)):
                    timed[name] = _median_ms(lambda: backend.backward(
                        dout, q, k, v, out, lse, *grads, deterministic=det, **options))
                leaves = [x.detach().requires_grad_() for x in (q, k, v)]
                timed["ours"] = _median_ms(lambda: portattn.flash_attn_func(
                    *leaves, causal=causal).backward(dout))
                qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
                dt = dout.transpose(1, 2)

                def sdpa_step():
                    torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).backward(dt)

                for name, kind in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                    try:
                        with sdpa_kernel(kind):
                            timed[name] = f"{_median_ms(sdpa_step):.2f}"
                    except RuntimeError as error:  # that SDPA backend is unavailable in this torch
                        timed[name] = f"n/a ({str(error)[:30]})"
                rows.append(f"| {head_dim} | {seqlen} | {causal} | {flops / timed['hopper'] / 1e9:.0f} | "
                            f"{flops / timed['det'] / 1e9:.0f} | {flops / timed['sm80'] / 1e9:.0f} | "
                            f"{timed['ours']:.2f} | {timed['flash']} | {timed['cudnn']} |")
    return "\n".join(rows)


def test_hopper_backward_timing_printout():
    # A printout, not a gate: correctness is checked above.
    table = timing_table()
    print("\n" + table)
    assert table.count("\n") == 9, "a timing row is missing"


if __name__ == "__main__":
    print(timing_table())
