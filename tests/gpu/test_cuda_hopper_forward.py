"""GPU tests of the sm_90a forward kernel (csrc/hopper_fwd_*.cu), called directly and through dispatch.

The kernel exists in `_C` when the build's archs include sm_90 (then `_C.hopper_fwd`
takes `_C.fwd`'s arguments) and dispatch serves it as the "cuda-sm90" backend.
Everything here skips with the reason otherwise, and on any GPU but sm_90.

Error rule: tests/error_rule.py (outputs within 2x PyTorch's own low-precision error of the
float64 oracle, tests/naive.py; the LSE against the float32 naive LSE's error), as for the
sm80+ kernels. Outputs are NaN-poisoned before every launch and the inputs are fresh random
normals.

`python tests/gpu/test_cuda_hopper_forward.py` (or pytest -s) also prints TFLOP/s
against SDPA's cuDNN kernel at 16k tokens per batch.
"""
from __future__ import annotations

import math
import re
import statistics

import pytest
import torch

from error_rule import GRAD_FACTOR, assert_lse, assert_output, assert_within
from naive import naive_attention

pytestmark = pytest.mark.gpu

from cuda_gpu_setup import HOPPER_DTYPES, HOPPER_FWD_HEAD_DIMS, rand, skip_unless_hopper  # noqa: E402  (skips without a GPU or without the CUDA backend)

from portattn.backends.abi import fwd_args  # noqa: E402
from portattn.backends.cuda import _C, variants  # noqa: E402

skip_unless_hopper("hopper_fwd")

# A tuning build (PORTATTN_NVCC_FLAGS=-DPORTATTN_HOPPER_TUNING) reports, per head dim, what
# PORTATTN_HOPPER_FWD_SCHEDULE accepts (csrc/hopper_fwd_schedule.h). Each "+<bits>" there is the
# default choices with <bits> added (every mask, softcap, varlen, both dtypes: what a change of
# kDefaultAddedBits in hopper_fwd_launch.cuh would launch), and every test below with a head_dim
# parameter runs again with it at the head dims that admit it (ids "added<bits>", e.g. added64:
# three consumer warpgroups, 192-row tiles, at hd64). Other builds report none: one run each.
TUNING = _C.build_config()["hopper"].get("fwd_tuning", {})
ADDITIONS = sorted({value for values in TUNING.values() for value in values if isinstance(value, str)})


@pytest.fixture(autouse=True, params=["defaults"] + ADDITIONS,
                ids=lambda p: p if p == "defaults" else "added" + p[1:])
def forward_schedule(request, monkeypatch):
    if request.param != "defaults":
        callspec = getattr(request.node, "callspec", None)
        head_dim = callspec.params.get("head_dim") if callspec is not None else None
        if request.param not in TUNING.get(head_dim, []):
            pytest.skip(f"PORTATTN_HOPPER_FWD_SCHEDULE={request.param} adds nothing at head dim {head_dim}")
        monkeypatch.setenv("PORTATTN_HOPPER_FWD_SCHEDULE", request.param)
    return request.param

DTYPES = HOPPER_DTYPES  # capability/specs/cuda_sm90.py, through tests/gpu/grids.py
# The forward's: hd192 and hd256 on their own kernels (Notes [portattn hopper hd192] and [portattn
# hopper hd256]), and hd96, served padded by the hd128 kernel (Note [portattn hopper padded head
# dims]), so every test with a head_dim parameter covers the padded serving (tails, windows,
# softcap, GQA, varlen, schedules).
HEAD_DIMS = HOPPER_FWD_HEAD_DIMS
PADDED_HEAD_DIMS = sorted(variants.HOPPER_FWD_PADDED)  # 96
SEQLENS = [(1, 1), (17, 113), (113, 17), (128, 128), (1000, 1000), (1, 4097), (4097, 1000), (2048, 2048)]


def _options(scale, causal, window=(-1, -1), softcap=0.0):
    left, right = (-1, 0) if causal else window
    return dict(softmax_scale=scale, window_left=left, window_right=right, softcap=softcap,
                alibi_slopes=None, dropout_p=0.0, rng_seed=0, rng_offset=0)


def hopper_forward(q, k, v, *, causal, out=None, lse=None, scale=None, window=(-1, -1), softcap=0.0, sm_margin=0):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.full_like(q, float("nan")) if out is None else out
    if lse is None:
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device=q.device)
    o = _options(scale, causal, window, softcap)
    _C.hopper_fwd(*fwd_args(q, k, v, out, lse, None, None, 0, 0, o["softmax_scale"], o["window_left"],
                            o["window_right"], o["softcap"], o["alibi_slopes"], o["dropout_p"],
                            o["rng_seed"], o["rng_offset"], sm_margin=sm_margin))
    return out, lse


def _check(out, lse, q, k, v, causal, window=(-1, -1), softcap=0.0):
    mask = dict(causal=causal, window=window, softcap=softcap)
    ref, ref_lse = naive_attention(q, k, v, compute_dtype=torch.float64, **mask)
    low, _ = naive_attention(q, k, v, compute_dtype=q.dtype, **mask)
    _, low_lse = naive_attention(q.float(), k.float(), v.float(), compute_dtype=torch.float32, **mask)
    assert_output(out, ref, low)
    assert_lse(lse, ref_lse, low_lse)


def _random_call_checked(shape, head_dim, dtype, causal):
    """The kernel on fresh random q, k, v of shape (batch, seqlen_q, seqlen_k, heads, heads_k), checked."""
    batch, seqlen_q, seqlen_k, heads, heads_k = shape
    q = rand(batch, seqlen_q, heads, head_dim, dtype=dtype)
    k = rand(batch, seqlen_k, heads_k, head_dim, dtype=dtype)
    v = rand(batch, seqlen_k, heads_k, head_dim, dtype=dtype)
    out, lse = hopper_forward(q, k, v, causal=causal)
    torch.cuda.synchronize()
    _check(out, lse, q, k, v, causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_hopper_forward_grid(dtype, head_dim, seqlens, causal):
    seqlen_q, seqlen_k = seqlens
    batch, heads = (2, 3) if seqlen_q * seqlen_k < 2**20 else (1, 2)
    _random_call_checked((batch, seqlen_q, seqlen_k, heads, heads), head_dim, dtype, causal)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_hopper_forward_gqa_and_strided_views(head_dim):
    # q/k/v as views of one packed (B, S, 3 * H, D) tensor: row strides != H * D;
    # GQA with 2 query heads per key head.
    batch, seqlen, heads, heads_k = 2, 300, 4, 2
    packed = rand(batch, seqlen, heads + 2 * heads_k, head_dim, dtype=torch.bfloat16)
    q, k, v = packed.split([heads, heads_k, heads_k], dim=2)
    for causal in (False, True):
        out, lse = hopper_forward(q, k, v, causal=causal)
        torch.cuda.synchronize()
        _check(out, lse, q, k, v, causal)


# (window_left, window_right): sliding windows both sides, left only, right only,
# and causal with a left bound; with and without softcap (Gemma-2's 30 / 50).
WINDOWS = [(64, 0), (100, 37), (-1, 50), (300, -1), (0, 0)]


def _three_head_inputs(seqlens, head_dim):
    """Fresh bf16 q, k, v: batch 2, 3 heads, (seqlen_q, seqlen_k) = seqlens."""
    seqlen_q, seqlen_k = seqlens
    return (rand(2, seqlen_q, 3, head_dim, dtype=torch.bfloat16),
            rand(2, seqlen_k, 3, head_dim, dtype=torch.bfloat16),
            rand(2, seqlen_k, 3, head_dim, dtype=torch.bfloat16))


@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("seqlens", [(1000, 1000), (300, 777), (777, 300)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_hopper_forward_windows_and_softcap(head_dim, seqlens, window, softcap):
    q, k, v = _three_head_inputs(seqlens, head_dim)
    out, lse = hopper_forward(q, k, v, causal=False, window=window, softcap=softcap)
    torch.cuda.synchronize()
    _check(out, lse, q, k, v, False, window, softcap)


# Packed sequences (cu_seqlens): empty ones, single rows, lengths across block edges,
# seqlen_q != seqlen_k per sequence, more sequences than one CTA wave of tiles.
VARLEN_LENGTHS = [
    ([0, 1, 17, 130, 257, 1000], [5, 0, 300, 129, 257, 900]),
    ([128] * 40 + [77], [128] * 40 + [300]),
    # Longest sequence past 1024 keys: the no-mask launch runs one CTA per tile (kVarlenSchedule).
    ([1500, 0, 3, 700, 1100], [1300, 7, 2000, 5, 1025]),
]


@pytest.mark.parametrize("options", [dict(), dict(causal=True), dict(window=(100, 37)), dict(softcap=30.0)],
                         ids=["full", "causal", "window", "softcap"])
@pytest.mark.parametrize("lengths", VARLEN_LENGTHS, ids=["mixed", "many", "long"])
@pytest.mark.parametrize("heads_k", [4, 1])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_hopper_forward_varlen(head_dim, heads_k, lengths, options):
    lens_q, lens_k = lengths
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(torch.int32)
    q = rand(sum(lens_q), 4, head_dim, dtype=torch.bfloat16)
    k = rand(sum(lens_k), heads_k, head_dim, dtype=torch.bfloat16)
    v = rand(sum(lens_k), heads_k, head_dim, dtype=torch.bfloat16)
    causal = options.get("causal", False)
    window, softcap = options.get("window", (-1, -1)), options.get("softcap", 0.0)
    scale = 1.0 / math.sqrt(head_dim)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((4, q.shape[0]), float("nan"), device="cuda")
    o = _options(scale, causal, window, softcap)
    _C.hopper_fwd(*fwd_args(q, k, v, out, lse, cu_q, cu_k, max(lens_q), max(lens_k), o["softmax_scale"],
                            o["window_left"], o["window_right"], o["softcap"], None, 0.0, 0, 0))
    torch.cuda.synchronize()
    mask = dict(causal=causal, window=window, softcap=softcap, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    ref, ref_lse = naive_attention(q.double(), k.double(), v.double(), **mask)
    low, _ = naive_attention(q, k, v, compute_dtype=torch.bfloat16, **mask)
    assert_output(out, ref, low)
    assert not lse.isnan().any(), "lse has NaN (unwritten or bad math)"
    # The LSE here is held to an absolute 1e-3, not error_rule.assert_lse (as first verified on the GPU).
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty), "lse = -inf on a different set of rows"
    assert (lse.double() - ref_lse)[~empty].abs().max().item() <= 1e-3


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("softcap", [0.0, 50.0])
def test_hopper_forward_softcap_fp16(causal, softcap):
    q, k, v = (rand(2, 513, 4, 128, dtype=torch.float16) for _ in range(3))
    out, lse = hopper_forward(q, k, v, causal=causal, softcap=softcap)
    torch.cuda.synchronize()
    _check(out, lse, q, k, v, causal, softcap=softcap)


# 7 query blocks x 20 heads x 3 batches = 420 tiles: more than one per SM, so the
# persistent schedule walks several (Q refills, K/V ring phases carried across
# tiles); seqlen_q > seqlen_k makes the first causal tiles empty (no key visible).
# 5 x 45 x 3 = 675 tiles: an odd count of query blocks and of (head, batch) pairs, so
# the paired walk (Note [portattn hopper paired tiles]) pairs two heads' middle
# blocks and ends in a pair with one tile. 2100 and 4500 keys: the long causal
# calls' paired walk (128- and 192-row tiles; 176-key blocks at hd128 from 4097).
# Many short sequences, past kPairedMaxTilesPerCta tiles a CTA (paired_walk_for_many_short,
# hopper_fwd_launch.cuh): 128 x 24 x 300 rows (three query blocks) walks the group order at hd128
# and up and the paired order at hd64; 128 x 24 x 256 rows (two) the paired order everywhere.
@pytest.mark.parametrize("shape", [(3, 777, 513, 20), (3, 640, 640, 45), (2, 2100, 2100, 20), (1, 4500, 4500, 9),
                                   (128, 300, 300, 24), (128, 256, 256, 24)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_hopper_forward_many_tiles_per_cta(head_dim, causal, shape):
    batch, seqlen_q, seqlen_k, heads = shape
    q = rand(batch, seqlen_q, heads, head_dim, dtype=torch.bfloat16)
    k = rand(batch, seqlen_k, heads, head_dim, dtype=torch.bfloat16)
    v = rand(batch, seqlen_k, heads, head_dim, dtype=torch.bfloat16)
    out, lse = hopper_forward(q, k, v, causal=causal)
    torch.cuda.synchronize()
    _check(out, lse, q, k, v, causal)


# sm_margin (FlashAttention-3's; PortattnFwdParams.sm_margin): a persistent launch of max(1, SMs -
# sm_margin) CTAs walks the same tiles, each computed as before, so out and lse keep their bits, on
# NaN-poisoned outputs. 131 leaves one CTA on a 132-SM H100 or H200, walking every tile. Shapes: one
# and several tiles a CTA, the paired causal walk (short and 2100 keys), 176-key blocks (2100 keys,
# no mask). (Many short sequences are not among them: hd64 without a mask at 300 keys runs the sm80+
# kernel, which has no persistent grid.)
@pytest.mark.parametrize("shape", [(3, 777, 513, 20), (2, 2100, 2100, 20)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_hopper_forward_sm_margin_keeps_the_output_bits(head_dim, causal, shape):
    batch, seqlen_q, seqlen_k, heads = shape
    q = rand(batch, seqlen_q, heads, head_dim, dtype=torch.bfloat16)
    k = rand(batch, seqlen_k, heads, head_dim, dtype=torch.bfloat16)
    v = rand(batch, seqlen_k, heads, head_dim, dtype=torch.bfloat16)
    results = []
    kernels = _kernels_of(lambda: results.append(hopper_forward(q, k, v, causal=causal)))
    # The schedule is the kernel's last template argument; kSchedPersistent is bit 4 (hopper_fwd_schedule.h).
    schedules = [int(m.group(1)) for m in map(re.compile(r"hopper_fwd_kernel<.*, (\d+)>").search, kernels) if m]
    assert schedules and all(bits & 4 for bits in schedules), kernels
    out, lse = results[0]
    _check(out, lse, q, k, v, causal)
    for sm_margin in (8, 131):
        out_margin, lse_margin = hopper_forward(q, k, v, causal=causal, sm_margin=sm_margin)
        torch.cuda.synchronize()
        assert torch.equal(out_margin, out), sm_margin
        assert torch.equal(lse_margin, lse), sm_margin


def test_sm_margin_reaches_the_hopper_forward_through_the_public_api():
    import portattn

    q, k, v = (rand(2, 1000, 8, 128, dtype=torch.bfloat16) for _ in range(3))
    want = portattn.flash_attn_func(q, k, v)
    for sm_margin in (8, 131):
        assert torch.equal(portattn.flash_attn_func(q, k, v, sm_margin=sm_margin), want)


# hd64 calls without a mask whose keys fit one block run ping-pong with the cross-tile phase
# (single_block_added_bits, hopper_fwd_launch.cuh: schedule 135): several tiles a CTA, so tiles
# chain through the fused phase; a partial block (65 keys), GQA, and rows past one query tile.
# The launched kernel's schedule is read from its name.
@pytest.mark.parametrize("shape", [(64, 100, 100, 16, 16), (8, 1000, 128, 16, 4), (40, 200, 65, 7, 7)],
                         ids=lambda s: "x".join(map(str, s)))
def test_hopper_forward_single_block_calls_chain_tiles(shape):
    batch, seqlen_q, seqlen_k, heads, heads_k = shape
    q = rand(batch, seqlen_q, heads, 64, dtype=torch.bfloat16)
    k = rand(batch, seqlen_k, heads_k, 64, dtype=torch.bfloat16)
    v = rand(batch, seqlen_k, heads_k, 64, dtype=torch.bfloat16)
    results = []
    kernels = _kernels_of(lambda: results.append(hopper_forward(q, k, v, causal=False)))
    out, lse = results[0]
    _check(out, lse, q, k, v, False)
    if TUNING:
        return  # (a tuning build's kernel list differs; the schedule is asserted on default builds)
    assert any("portattn::hopper::hopper_fwd_kernel<64" in name and ", 135>" in name for name in kernels), kernels


# Causal calls whose key offset (seqlen_k - seqlen_q) is a multiple of the 128-key block, so a
# tile's first key block starts at its first row's diagonal, and their unaligned neighbours: equal
# lengths (one and several blocks, a partial last tile), offsets of +128, +640 and -128 (rows with no
# key), +129 and +100, several tiles a CTA (the cross-tile phase and the paired walk), GQA; the
# short causal schedule up to 1024 keys and the long one past it. A regression test of the
# diagonal's placement (a half-diagonal key block, docs/tried-and-rejected.md, would depend on it).
@pytest.mark.parametrize("shape", [(2, 128, 128, 3, 3), (2, 512, 512, 3, 3), (2, 300, 300, 3, 1),
                                   (2, 300, 428, 3, 3), (2, 428, 300, 3, 3), (2, 100, 740, 3, 3),
                                   (16, 512, 512, 16, 4), (2, 2000, 2000, 4, 4), (1, 3000, 3128, 3, 3),
                                   (2, 300, 429, 3, 3), (2, 2000, 2100, 3, 3)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_hopper_forward_causal_key_offsets(head_dim, dtype, shape):
    _random_call_checked(shape, head_dim, dtype, causal=True)


# Note [portattn hopper lazy rescale] (csrc/hopper_fwd_kernel.cuh): rows whose maximum grows from one
# key block to the next by about `growth` (log2 units of the scaled score; the noise moves it by ~10%),
# next to rows in the same warps whose maximum never grows (odd rows). 1.0 and 2.0: rows keep a stale
# maximum for several blocks, then move; 6.0: they move every second block (12 past the stale one);
# 10.0: every block. So the stale-maximum path, the move and warps that mix both all run. The kernel
# visits key blocks from the last down, so the scores grow toward the first keys. Every head dim (the
# bound is in the hd128 128-key kernels; the others must stay exact on the same inputs); 2100 keys:
# 17 blocks (three consumers at hd64). The largest score stays at most ~42 log2 units (~30 in natural
# units) above the smallest block's: at 150-700 a plain tensor-core GEMM of the same inputs misses the
# LSE rule as our kernels do, from the fp32 accumulation of the products
# (archive:2026-11-26-a55d02d-probe/lse_probe.txt).
@pytest.mark.parametrize("case", [((1000, 1000), 1.0), ((1000, 1000), 3.0), ((1000, 1000), 6.0),
                                  ((500, 500), 10.0), ((300, 2100), 1.0), ((300, 2100), 2.0)],
                         ids=lambda c: f"{c[0][0]}x{c[0][1]}-g{c[1]:g}")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_hopper_forward_growing_row_maxima(head_dim, dtype, causal, case):
    (seqlen_q, seqlen_k), growth = case
    scale = 1.0 / math.sqrt(head_dim)
    direction = torch.nn.functional.normalize(torch.randn(head_dim, device="cuda"), dim=0)
    rows = torch.arange(seqlen_q, device="cuda")
    magnitude = 4.0 * (rows % 2 == 0)  # even rows see the ramp, odd rows only noise
    blocks_from_end = ((seqlen_k - 1 - torch.arange(seqlen_k, device="cuda")) // 128).float()
    # q_i . k_j * scale * log2(e) = growth * blocks_from_end[j] for the even rows (plus noise).
    ramp = growth * blocks_from_end / (4.0 * scale * math.log2(math.e))
    q = (0.3 * torch.randn(2, seqlen_q, 3, head_dim, device="cuda")
         + magnitude[None, :, None, None] * direction).to(dtype)
    k = (0.3 * torch.randn(2, seqlen_k, 3, head_dim, device="cuda")
         + ramp[None, :, None, None] * direction).to(dtype)
    v = rand(2, seqlen_k, 3, head_dim, dtype=dtype)
    out, lse = hopper_forward(q, k, v, causal=causal, scale=scale)
    torch.cuda.synchronize()
    _check(out, lse, q, k, v, causal)


# The paired walk under softcap (short causal calls keep it; at hd256 and hd64's three consumers softcap
# runs the serial loop, schedule_for): odd query-block and head counts, more tiles than SMs.
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_hopper_forward_paired_walk_with_softcap(head_dim):
    q, k, v = (rand(3, 640, 45, head_dim, dtype=torch.bfloat16) for _ in range(3))
    out, lse = hopper_forward(q, k, v, causal=True, softcap=30.0)
    torch.cuda.synchronize()
    _check(out, lse, q, k, v, True, softcap=30.0)


# Query tiles are 128 rows, or 192 with three consumer warpgroups (hd64, kSchedThreeConsumers):
# lengths one short of, at and one past a tile, the diagonal crossing key blocks at other
# offsets, the first causal tiles empty (seqlen_q > seqlen_k), a window with softcap.
@pytest.mark.parametrize("mask", ["none", "causal", "window_softcap"])
@pytest.mark.parametrize("seqlens", [(191, 191), (192, 320), (193, 100), (385, 1000), (1000, 385)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_hopper_forward_tile_edges(head_dim, seqlens, mask):
    q, k, v = _three_head_inputs(seqlens, head_dim)
    causal = mask == "causal"
    window, softcap = ((150, 20), 30.0) if mask == "window_softcap" else ((-1, -1), 0.0)
    out, lse = hopper_forward(q, k, v, causal=causal, window=window, softcap=softcap)
    torch.cuda.synchronize()
    _check(out, lse, q, k, v, causal, window, softcap)


# Note [portattn hopper short calls on narrow tiles] (hopper_fwd_entry.cu): dense hd64 calls of at
# most 512 rows and keys whose 64-padded area is at most 3/4 of the 128-padded one run the sm80+
# kernel's narrow tiles. Which kernel ran is read from the profiler's kernel names; routed calls
# are also bit for bit the sm80+ entry's output (the same kernel). Both against the oracle.
SHORT_ROUTED = [((1, 1), "none"), ((50, 50), "causal"), ((64, 64), "none"), ((17, 113), "causal"),
                ((130, 190), "none"), ((300, 300), "causal"), ((320, 257), "none")]
SHORT_NOT_ROUTED = [((100, 100), "none"), ((321, 321), "causal"), ((600, 50), "none"),
                    ((50, 50), "window"), ((50, 50), "softcap")]


def _kernels_of(call) -> list:
    """Names of the CUDA kernels `call` launches."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return [event.name for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("case", SHORT_ROUTED + SHORT_NOT_ROUTED,
                         ids=lambda c: f"{c[0][0]}x{c[0][1]}-{c[1]}")
def test_hopper_forward_short_calls_on_narrow_tiles(case):
    (seqlen_q, seqlen_k), mask = case
    q = rand(3, seqlen_q, 4, 64, dtype=torch.bfloat16)
    k = rand(3, seqlen_k, 2, 64, dtype=torch.bfloat16)
    v = rand(3, seqlen_k, 2, 64, dtype=torch.bfloat16)
    options = dict(causal=mask == "causal", window=(20, 5) if mask == "window" else (-1, -1),
                   softcap=30.0 if mask == "softcap" else 0.0)
    results = []
    kernels = _kernels_of(lambda: results.append(hopper_forward(q, k, v, **options)))
    out, lse = results[0]
    _check(out, lse, q, k, v, **options)
    routed = case in SHORT_ROUTED
    wanted = "portattn::cuda::fwd_kernel<64" if routed else "portattn::hopper::hopper_fwd_kernel<64"
    assert any(wanted in name for name in kernels), f"expected {wanted}; launched {kernels}"
    if routed:
        o = _options(1.0 / math.sqrt(64), **options)
        sm80_out, sm80_lse = torch.full_like(q, float("nan")), torch.full_like(lse, float("nan"))
        _C.fwd(*fwd_args(q, k, v, sm80_out, sm80_lse, None, None, 0, 0, o["softmax_scale"], o["window_left"],
                         o["window_right"], o["softcap"], o["alibi_slopes"], o["dropout_p"], o["rng_seed"],
                         o["rng_offset"]))
        torch.cuda.synchronize()
        assert torch.equal(out, sm80_out) and torch.equal(lse, sm80_lse)


def test_hopper_forward_short_call_with_a_huge_row_stride_stays_on_hopper():
    # A routed shape whose q rows are 2^24 elements apart: the sm80+ loaders' 32-bit offsets refuse it
    # (fwd_entry.cu), so the Hopper entry keeps it instead of handing it over (and failing).
    big = rand(2, 50, (1 << 24) // 64, 64, dtype=torch.bfloat16)
    q = big[:, :, :4]
    k, v = rand(2, 50, 2, 64, dtype=torch.bfloat16), rand(2, 50, 2, 64, dtype=torch.bfloat16)
    assert q.stride(1) == 1 << 24
    results = []
    kernels = _kernels_of(lambda: results.append(hopper_forward(q, k, v, causal=True)))
    out, lse = results[0]
    assert any("portattn::hopper::hopper_fwd_kernel<64" in name for name in kernels), kernels
    _check(out, lse, q.contiguous(), k, v, causal=True)
    del big


# At head dims 96-128 only dense calls of at most 64 rows and keys are handed to the narrow tiles.
@pytest.mark.parametrize("case", [((50, 50), "none", True), ((64, 33), "causal", True), ((100, 100), "none", False),
                                  ((130, 190), "none", False), ((50, 50), "window", False)],
                         ids=lambda c: f"{c[0][0]}x{c[0][1]}-{c[1]}")
@pytest.mark.parametrize("head_dim", [96, 128])
def test_hopper_forward_short_calls_on_narrow_tiles_wide_heads(head_dim, case):
    (seqlen_q, seqlen_k), mask, routed = case
    q = rand(3, seqlen_q, 4, head_dim, dtype=torch.bfloat16)
    k = rand(3, seqlen_k, 2, head_dim, dtype=torch.bfloat16)
    v = rand(3, seqlen_k, 2, head_dim, dtype=torch.bfloat16)
    options = dict(causal=mask == "causal", window=(20, 5) if mask == "window" else (-1, -1))
    results = []
    kernels = _kernels_of(lambda: results.append(hopper_forward(q, k, v, **options)))
    out, lse = results[0]
    _check(out, lse, q, k, v, **options)
    kernel = variants.HOPPER_FWD_PADDED.get(head_dim, head_dim)
    wanted = f"portattn::cuda::fwd_kernel<{head_dim}" if routed else f"portattn::hopper::hopper_fwd_kernel<{kernel}"
    assert any(wanted in name for name in kernels), f"expected {wanted}; launched {kernels}"


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("longest", [295, 250], ids=["routed", "not_routed"])
@pytest.mark.parametrize("causal", [False, True])
def test_hopper_forward_short_varlen_calls_on_narrow_tiles(causal, longest, head_dim):
    # Varlen calls are judged by their longest sequences: 295 pads to 320 (narrow) against 384, 250 alike.
    # At head dim 128 varlen calls stay on the Hopper kernel.
    lens = [1, 50, longest, 130, 64, 0, 33]
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    q, k, v = (rand(sum(lens), 4, head_dim, dtype=torch.bfloat16) for _ in range(3))
    out = torch.full_like(q, float("nan"))
    lse = torch.full((4, sum(lens)), float("nan"), device="cuda")
    o = _options(1.0 / math.sqrt(head_dim), causal)

    def call():
        _C.hopper_fwd(*fwd_args(q, k, v, out, lse, cu, cu, longest, longest, o["softmax_scale"], o["window_left"],
                                o["window_right"], o["softcap"], o["alibi_slopes"], o["dropout_p"], o["rng_seed"],
                                o["rng_offset"]))
    kernels = _kernels_of(call)
    routed = longest == 295 and head_dim == 64
    wanted = (f"portattn::cuda::fwd_kernel<{head_dim}" if routed
              else f"portattn::hopper::hopper_fwd_kernel<{head_dim}")
    assert any(wanted in name for name in kernels), f"expected {wanted}; launched {kernels}"
    mask = dict(causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu)
    ref, ref_lse = naive_attention(q.double(), k.double(), v.double(), **mask)
    low, _ = naive_attention(q, k, v, compute_dtype=torch.bfloat16, **mask)
    assert_output(out, ref, low)
    # As test_hopper_forward_varlen: every row written, -inf exactly where no key is visible.
    empty = torch.isinf(ref_lse)
    assert not lse.isnan().any() and torch.equal(torch.isinf(lse), empty)
    assert (lse.double() - ref_lse)[~empty].abs().max().item() <= 1e-3


@pytest.mark.skipif(not TUNING, reason="not a tuning build (-DPORTATTN_HOPPER_TUNING)")
@pytest.mark.parametrize("value, detail", [("+12345", "names no schedule"), ("12345", "names no schedule"),
                                           ("5", "no-mask and causal calls without softcap only")])
def test_tuning_build_refuses_what_it_did_not_build(monkeypatch, value, detail):
    # The schedule variable is read on every call: a value it does not know fails the call
    # instead of running the defaults, so the added-schedule runs above cannot pass vacuously.
    monkeypatch.setenv("PORTATTN_HOPPER_FWD_SCHEDULE", value)
    # 200 rows: a call the entry keeps on the Hopper kernels (64 rows would go to the narrow
    # sm80+ tiles, Note [portattn hopper short calls on narrow tiles], which read no schedule).
    q = rand(1, 200, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=detail):
        hopper_forward(q, q, q, causal=False, softcap=5.0 if value == "5" else 0.0)


# Every kernel run_default (hopper_fwd_launch.cuh) can launch: mask x softcap x the short /
# long causal split at seqlen_k 1024 x the 176-key blocks of hd128 calls from 4097 keys, 2048 without
# a mask (Note [portattn hopper 176-key blocks]; 4500 keys end in a ragged block, as does SEQLENS'
# 2048 x 2048 in the grid above) x the paired persistent causal
# walk up to 8192 keys and one CTA per tile past it (8200). At hd256 softcap and windows
# take the serial loop (schedule_for), the rest the pipelined ones, so each of its schedules runs here.
@pytest.mark.parametrize("seqlens", [(777, 1000), (1100, 1500), (1500, 4500), (300, 8200)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_hopper_forward_every_launched_schedule(head_dim, mask, softcap, seqlens):
    q, k, v = _three_head_inputs(seqlens, head_dim)
    causal, window = mask == "causal", ((200, 77) if mask == "window" else (-1, -1))
    out, lse = hopper_forward(q, k, v, causal=causal, window=window, softcap=softcap)
    torch.cuda.synchronize()
    _check(out, lse, q, k, v, causal, window, softcap)


def test_hopper_forward_refuses_what_it_does_not_serve():
    q = rand(1, 64, 2, 64, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    lse = torch.empty(1, 2, 64, device="cuda")
    args = list(fwd_args(q, q, q, out, lse, None, None, 0, 0, 0.125, -1, -1, 0.0, None, 0.1, 0, 0))
    with pytest.raises(RuntimeError, match="dropout is served by the sm80"):
        _C.hopper_fwd(*args)
    for head_dim in (32, 160):  # 160: a multiple of 32 between served head dims, still refused
        qd = rand(1, 64, 2, head_dim, dtype=torch.bfloat16)
        with pytest.raises(RuntimeError, match=f"head_dim {head_dim}"):
            hopper_forward(qd, qd, qd, causal=False)


# ---- timing against SDPA (cuDNN) ------------------------------------------------------

def _median_ms(fn, reps=20):
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def timing_table():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = ["| hd | seqlen | causal | hopper TFLOP/s | cuDNN TFLOP/s | ratio |", "|---|---|---|---|---|---|"]
    for head_dim, heads in ((64, 32), (128, 16)):
        for seqlen in (1024, 4096, 16384):
            batch = 16384 // seqlen
            q, k, v = (rand(batch, seqlen, heads, head_dim, dtype=torch.bfloat16) for _ in range(3))
            out = torch.empty_like(q)
            lse = torch.empty(batch, heads, seqlen, device="cuda")
            for causal in (False, True):
                flops = 4 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
                ours = _median_ms(lambda: hopper_forward(q, k, v, causal=causal, out=out, lse=lse))
                qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
                try:
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        ref = _median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                            qt, kt, vt, is_causal=causal))
                    cudnn = f"{flops / ref / 1e9:.0f}"
                    ratio = f"{ref / ours:.2f}"
                except RuntimeError as error:  # cuDNN attention unavailable in this torch
                    cudnn, ratio = f"n/a ({str(error)[:40]})", "-"
                rows.append(f"| {head_dim} | {seqlen} | {causal} | {flops / ours / 1e9:.0f} | {cudnn} | {ratio} |")
    return "\n".join(rows)


def test_dispatch_routes_eligible_calls_to_the_hopper_path_and_the_rest_to_sm80():
    import portattn

    q, k, v = (rand(2, 300, 4, 128, dtype=torch.bfloat16) for _ in range(3))
    assert portattn.explain(q, k, v, causal=True).chosen == "cuda-sm90"
    assert portattn.explain(q, k, v, softcap=5.0, window_size=(64, 0)).chosen == "cuda-sm90"
    packed = q.reshape(-1, 4, 128)
    cu = torch.tensor([0, 300, 600], device="cuda", dtype=torch.int32)
    assert portattn.explain(packed, packed, packed, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=300,
                            max_seqlen_k=300).chosen == "cuda-sm90"
    assert portattn.explain(q, k, v, dropout_p=0.1).chosen == "cuda"  # declared: sm80+ path only
    assert portattn.explain(q[..., :80], k[..., :80], v[..., :80]).chosen == "cuda"  # head dim 80
    q.requires_grad_()
    # Training calls too: the backward is the Hopper one (tests/gpu/test_cuda_hopper_backward.py).
    assert portattn.explain(q, k, v, causal=True).chosen == "cuda-sm90"
    # Windows and softcap too: the Hopper backward serves them (capability/specs/cuda_sm90.py).
    assert portattn.explain(q, k, v, softcap=5.0).chosen == "cuda-sm90"
    _check_causal_training_call(q, k, v)


def _check_causal_training_call(q, k, v):
    """flash_attn_func(causal=True) and its backward through the public API (q requires grad):
    the output and dq within the error rule of the float64 oracle."""
    import portattn

    out = portattn.flash_attn_func(q, k, v, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref_q = q.detach().double().requires_grad_()
    ref_out = naive_attention(ref_q, k.double(), v.double(), causal=True)[0]
    ref_out.backward(dout.double())
    low_q = q.detach().clone().requires_grad_()
    low_out = naive_attention(low_q, k, v, causal=True, compute_dtype=torch.bfloat16)[0]
    low_out.backward(dout)
    assert_output(out, ref_out, low_out)
    assert_within("dq", q.grad, ref_q.grad, low_q.grad, GRAD_FACTOR)


@pytest.mark.parametrize("head_dim", [192, 256])
def test_dispatch_serves_hd192_hd256_forward_and_training_on_hopper(monkeypatch, head_dim):
    import portattn

    if head_dim not in _C.build_config()["hopper"]["head_dims"]:
        pytest.skip(f"this build has no hd{head_dim} Hopper kernels (restricted build, PORTATTN_HEADDIMS)")
    passes = _record_passes(monkeypatch)
    q, k, v = (rand(2, 300, 4, head_dim, dtype=torch.bfloat16) for _ in range(3))
    assert portattn.explain(q, k, v, causal=True).chosen == "cuda-sm90"
    assert portattn.explain(q, k, v, softcap=5.0, window_size=(64, 0)).chosen == "cuda-sm90"
    # Each head dim's forward on its own kernel (Notes [portattn hopper hd192], [portattn hopper hd256]).
    results = []
    kernels = _kernels_of(lambda: results.append(portattn.flash_attn_func(q, k, v, causal=True)))
    assert any(f"portattn::hopper::hopper_fwd_kernel<{head_dim}," in name for name in kernels), kernels
    out = results[0]
    ref = naive_attention(q.double(), k.double(), v.double(), causal=True)[0]
    low = naive_attention(q, k, v, causal=True, compute_dtype=torch.bfloat16)[0]
    assert_output(out, ref, low)
    # A training call runs both passes here: the backward's hd256 kernel splits the head dim over
    # two CTAs (Note [portattn hopper split head dim] in csrc/hopper_bwd_kernel.cuh); hd192's runs
    # its two parts, columns 0-127 and 128-191 (Note [portattn hopper hd192 backward]), in one launch
    # (the kernel's last template argument -1, kBothParts: this causal call without softcap) or in
    # two (0, then 1).
    q.requires_grad_()
    assert portattn.explain(q, k, v, causal=True).chosen == "cuda-sm90"
    passes.clear()
    kernels = _kernels_of(lambda: _check_causal_training_call(q, k, v))
    assert passes == [("forward", "cuda-sm90"), ("backward", "cuda-sm90")]
    parts = sorted(m.group(1) for m in (re.search(rf"hopper_bwd_kernel<{head_dim}, [^>]*, (-?\d+)>\(", n) for n in kernels)
                   if m is not None)
    assert parts in ([["-1"], ["0", "1"]] if head_dim == 192 else [["0"]]), kernels


# ---- padded head dims (96 on the hd128 kernel) ------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(17, 113), (113, 17), (300, 777)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("head_dim", PADDED_HEAD_DIMS)
def test_hopper_forward_padded_head_dims_read_and_write_only_their_columns(head_dim, seqlens, causal):
    # q, k, v and out as the first head_dim columns of rows as wide as the serving kernel's head
    # dim: the columns past head_dim hold NaN. The tensor maps must not read them (TMA zero-fills
    # past the call's head dim) and the store loop must not write them.
    kernel = variants.HOPPER_FWD_PADDED[head_dim]
    seqlen_q, seqlen_k = seqlens

    def wide(seqlen, heads):
        tensor = torch.full((2, seqlen, heads, kernel), float("nan"), device="cuda", dtype=torch.bfloat16)
        tensor[..., :head_dim] = rand(2, seqlen, heads, head_dim, dtype=torch.bfloat16)
        return tensor

    q_wide, k_wide, v_wide, out_wide = wide(seqlen_q, 4), wide(seqlen_k, 2), wide(seqlen_k, 2), wide(seqlen_q, 4)
    out_wide[..., :head_dim] = float("nan")
    q, k, v, out = (t[..., :head_dim] for t in (q_wide, k_wide, v_wide, out_wide))
    out, lse = hopper_forward(q, k, v, causal=causal, out=out)
    torch.cuda.synchronize()
    assert out_wide[..., head_dim:].isnan().all(), "the kernel wrote columns past the head dim"
    _check(out, lse, q, k, v, causal)


def _record_passes(monkeypatch):
    """[(pass, backend name)] of every forward / backward a dispatched call runs from now on."""
    from portattn import dispatch

    passes = []
    for slot in dispatch.DISPATCHER.slots:
        if slot.backend is None:
            continue
        for method in ("forward", "backward"):
            def recorded(*args, _run=getattr(slot.backend, method), _entry=(method, slot.name), **kwargs):
                passes.append(_entry)
                return _run(*args, **kwargs)

            monkeypatch.setattr(slot.backend, method, recorded)
    return passes


@pytest.mark.parametrize("head_dim", PADDED_HEAD_DIMS)
def test_dispatch_serves_padded_head_dims_on_hopper_where_a_pass_has_them(monkeypatch, head_dim):
    # 96: both passes on cuda-sm90 (the hd128 forward and backward kernels, padded). A padded
    # head dim whose backward has no Hopper kernel (none today: variants.HOPPER_BWD_PADDED) would
    # train with the forward on cuda-sm90 and the backward on the sm80+ path.
    import portattn

    hopper_backward = head_dim in variants.HOPPER_BWD_PADDED
    passes = _record_passes(monkeypatch)
    q, k, v = (rand(2, 300, 4, head_dim, dtype=torch.bfloat16) for _ in range(3))
    assert portattn.explain(q, k, v, causal=True).chosen == "cuda-sm90"
    assert portattn.explain(q, k, v, softcap=5.0, window_size=(64, 0)).chosen == "cuda-sm90"
    out = portattn.flash_attn_func(q, k, v, causal=True)
    assert passes == [("forward", "cuda-sm90")]
    ref = naive_attention(q.double(), k.double(), v.double(), causal=True)[0]
    low = naive_attention(q, k, v, causal=True, compute_dtype=torch.bfloat16)[0]
    assert_output(out, ref, low)
    # A training call: explain() judges it with its backward (capability/specs/cuda_sm90.py,
    # forward_only_head_dims).
    q.requires_grad_()
    explanation = portattn.explain(q, k, v, causal=True)
    if hopper_backward:
        assert explanation.chosen == "cuda-sm90"
    else:
        assert explanation.chosen == "cuda"
        assert any(f"head_dim {head_dim} is forward-only on cuda-sm90" in r for r in explanation.reasons["cuda-sm90"])
    passes.clear()
    _check_causal_training_call(q, k, v)
    # The forward of a training call is dispatched with the forward's features only (ops.run_forward
    # passes no backward bit), so it runs on the Hopper forward either way, as hd256's training
    # forward does; both paths' out and LSE are interchangeable (CudaSm90Backend). If dispatch ever
    # routes a training call's forward by its backward, 192 becomes [("forward", "cuda"), ("backward", "cuda")].
    assert passes == [("forward", "cuda-sm90"), ("backward", "cuda-sm90" if hopper_backward else "cuda")]


def test_hopper_forward_timing_printout():
    # A printout, not a gate: the kernel's correctness is checked above.
    table = timing_table()
    print("\n" + table)
    assert table.count("\n") == 13, "a timing row is missing"


if __name__ == "__main__":
    print(timing_table())
