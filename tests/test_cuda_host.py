"""CPU-side tests of the CUDA sm80+ kernels' host logic: the backward's workspace and tiles
(csrc/bwd_entry.cu, bwd_launch.cuh) and the forward's tile choice (fwd_launch.cuh).

Where nvcc is installed, a restricted build (sm_80, hd 64, bf16) is imported on a
machine without a GPU; the workspace sizing, the per-head-dim shared-memory
budgets reported to the support matrix, the workspace check and the tile queries
run no CUDA call.
"""
from __future__ import annotations

import importlib.util
import math
import os
import shutil
import sysconfig

import pytest

_BUILD_PY = os.path.join(os.path.dirname(__file__), "..", "portattn", "backends", "cuda", "build.py")
_spec = importlib.util.spec_from_file_location("_portattn_cuda_build_for_bwd_tests", _BUILD_PY)
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)

SM86_OPTIN = 99 * 1024  # the smallest opt-in shared memory of any sm80+ part
MIB = 1 << 20


@pytest.fixture(scope="module")
def module(tmp_path_factory):
    if build.find_nvcc() is None:
        pytest.skip("nvcc not installed")
    pytest.importorskip("pybind11")
    if shutil.which("ninja") is None:
        pytest.importorskip("ninja")
    root = tmp_path_factory.mktemp("cuda_bwd_host")
    env = dict(os.environ, PORTATTN_CUDA_ARCHS="80", PORTATTN_HEADDIMS="64", PORTATTN_DTYPES="bf16")
    ext_path = str(root / "pkg" / ("_C" + sysconfig.get_config_var("EXT_SUFFIX")))
    build.build(ext_path, str(root / "temp"), env)
    spec = importlib.util.spec_from_file_location("_C", ext_path)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


def _align(nbytes):
    return (nbytes + 255) // 256 * 256


pytestmark = pytest.mark.slow


def test_every_head_dim_has_a_backward_shape_for_99_kib_parts(module):
    budgets = {hd: module.bwd_smem_bytes(hd) for hd in (32, 64, 96, 128, 160, 192, 224, 256)}
    assert all(0 < b <= SM86_OPTIN for b in budgets.values()), budgets
    assert module.bwd_smem_bytes(40) == -1  # only instantiable head dims have shapes
    # The process may already hold another libportattn_cuda.so (the installed one: same
    # soname, so the loader reuses it), hence compare with what the module reports.
    config = module.build_config()
    assert config["smem_bytes"]["backward"] == {hd: module.bwd_smem_bytes(hd) for hd in config["head_dims"]}


def test_workspace_default_gqa_and_deterministic(module):
    b, h, hk, d, sq, sk = 2, 8, 2, 64, 1000, 777
    rows = b * h * sq
    dq = 2 * _align(rows * 4) + _align(rows * d * 4)  # delta, lse2 + one fp32 dQ
    assert module.bwd_workspace_bytes(b, h, h, d, sq, sk, False) == dq
    dkv = _align(b * sk * hk * d * 4)  # fp32 dK and dV accumulators for the group sums
    assert module.bwd_workspace_bytes(b, h, hk, d, sq, sk, False) == dq + 2 * dkv
    # Deterministic: dK/dV stay in registers (a CTA walks its group), dQ has one slice per split.
    splits = min(math.ceil(256 / (b * hk)), math.ceil(sk / 64))
    assert module.bwd_workspace_bytes(b, h, hk, d, sq, sk, True) == 2 * _align(rows * 4) + _align(splits * rows * d * 4)


def test_sm80_workspace_pads_each_head_to_whole_8_row_blocks(module):
    # The sm80+ kernels' blocked dQ (Note [portattn sm80 blocked dQ]): each (batch, head) keeps its
    # rows of delta, lse2 and dQ padded to a multiple of 8, so every head starts a block; the Hopper
    # layout (ordered_dq) keeps exact rows.
    b, h, d, sq, sk = 2, 3, 64, 5, 300  # 5 rows a head -> 8
    rows, padded = b * h * sq, b * h * 8
    assert module.bwd_workspace_bytes(b, h, h, d, sq, sk, False) == 2 * _align(padded * 4) + _align(padded * d * 4)
    splits = min(math.ceil(256 / (b * h)), math.ceil(sk / 64))
    assert module.bwd_workspace_bytes(b, h, h, d, sq, sk, True) == (
        2 * _align(padded * 4) + _align(splits * padded * d * 4))
    assert module.bwd_workspace_bytes(b, h, h, d, sq, sk, False, ordered_dq=True) == (
        2 * _align(rows * 4) + _align(rows * d * 4))
    # A multiple of 8 is its own padding.
    assert module.bwd_workspace_bytes(b, h, h, d, 16, sk, False) == (
        2 * _align(b * h * 16 * 4) + _align(b * h * 16 * d * 4))


def test_hopper_layout_orders_dq_instead_of_slicing_it(module):
    # bwd_workspace_bytes(..., ordered_dq=True): the Hopper backward's layout (Note [portattn hopper
    # ordered dQ]). The default mode is the same as bwd()'s; the deterministic mode keeps one fp32 dQ
    # plus one int32 count per 64-query block of each head, where bwd() keeps one dQ per split.
    b, h, hk, d, sq, sk = 2, 8, 2, 64, 1000, 777
    rows = b * h * sq
    for gqa_heads in (h, hk):
        assert (module.bwd_workspace_bytes(b, h, gqa_heads, d, sq, sk, False, ordered_dq=True)
                == module.bwd_workspace_bytes(b, h, gqa_heads, d, sq, sk, False))
    counts = b * h * math.ceil(sq / 64)
    ordered = 2 * _align(rows * 4) + _align(counts * 4) + _align(rows * d * 4)
    assert module.bwd_workspace_bytes(b, h, hk, d, sq, sk, True, ordered_dq=True) == ordered
    assert ordered < module.bwd_workspace_bytes(b, h, hk, d, sq, sk, True)  # no per-split slices
    # Ordered calls chunk like the default mode (128 MiB of dQ per chunk), not like the slices (4 GiB).
    rows32k = 8 * 32768
    assert module.bwd_workspace_bytes(1, 16, 16, 128, 32768, 32768, True, ordered_dq=True) == (
        2 * _align(rows32k * 4) + _align(8 * 512 * 4) + _align(rows32k * 128 * 4))


def test_hopper_layout_pads_accumulator_rows_to_its_kernel_head_dim(module):
    # hd96 runs on the hd128 Hopper backward kernel (Note [portattn hopper padded head dims]), which
    # adds whole 128-float rows into the fp32 dQ (and GQA dK/dV) accumulators: the Hopper layout
    # sizes them with that pitch (hopper_bwd_acc_head_dim), the sm80+ layout with the call's.
    b, h, hk, sq, sk = 2, 8, 2, 1000, 777
    rows = b * h * sq
    for deterministic in (False, True):
        counts = b * h * math.ceil(sq / 64) if deterministic else 0
        dkv = 0 if deterministic else 2 * _align(b * sk * hk * 128 * 4)
        padded = 2 * _align(rows * 4) + _align(counts * 4) + _align(rows * 128 * 4) + dkv
        assert module.bwd_workspace_bytes(b, h, hk, 96, sq, sk, deterministic, ordered_dq=True) == padded
        assert module.bwd_workspace_bytes(b, h, hk, 128, sq, sk, deterministic, ordered_dq=True) == padded
    assert module.bwd_workspace_bytes(b, h, h, 96, sq, sk, False) == 2 * _align(rows * 4) + _align(rows * 96 * 4)
    # hd192 and hd256 on their own kernels (Note [portattn hopper hd192 backward]): rows of their width.
    for head_dim in (192, 256):
        assert module.bwd_workspace_bytes(b, h, h, head_dim, sq, sk, False, ordered_dq=True) == (
            2 * _align(rows * 4) + _align(rows * head_dim * 4))


def test_large_calls_are_chunked_by_kv_heads(module):
    def one_chunk(heads, seqlen, d=128):
        rows = heads * seqlen
        return 2 * _align(rows * 4) + _align(rows * d * 4)

    # B=1, H=16, S=32k, hd 128: one fp32 dQ would be 256 MiB; two chunks of 8 heads keep 128 MiB.
    assert module.bwd_workspace_bytes(1, 16, 16, 128, 32768, 32768, False) == one_chunk(8, 32768)
    # The 16k-token benchmark grid stays in one launch (a half would be under 128 MiB).
    assert module.bwd_workspace_bytes(1, 16, 16, 128, 16384, 16384, False) == one_chunk(16, 16384)
    assert one_chunk(8, 32768) < 132 * MIB  # 128 MiB of fp32 dQ plus two 1 MiB row arrays (delta, lse2)


def test_deterministic_calls_keep_whole_launches_up_to_4_gib_of_dq_slices(module):
    def layout(heads, seqlen, splits, d=128):
        rows = heads * seqlen
        return 2 * _align(rows * 4) + _align(splits * rows * d * 4)

    # 16 KV heads -> 16 splits (256 target CTAs); 2 GiB of slices stays one launch of 256 CTAs.
    assert module.bwd_workspace_bytes(1, 16, 16, 128, 16384, 16384, True) == layout(16, 16384, 16)
    # At 64k tokens the slices would be 8 GiB: halved into chunks of 8 KV heads (4 GiB).
    assert module.bwd_workspace_bytes(1, 16, 16, 128, 65536, 65536, True) == layout(8, 65536, 16)


def test_too_small_workspace_is_a_clear_error(module):
    b, s, h, d = 1, 128, 2, 64
    strides = (s * h * d, h * d, d, 1)
    from portattn.backends.abi import FwdArgs

    fwd_args = FwdArgs(q=256, k=256, v=256, out=256, lse=256, q_strides=strides, k_strides=strides,
                       v_strides=strides, out_strides=strides, lse_batch_stride=h * s, lse_head_stride=s,
                       dtype=1, batch=b, nheads=h, nheads_k=h, headdim=d, seqlen_q=s, seqlen_k=s,
                       cu_seqlens_q=0, cu_seqlens_k=0, seqused_k=0, softmax_scale=0.125, softcap=0.0,
                       window_left=-1, window_right=-1, alibi_slopes=0, alibi_batch_stride=0, dropout_p=0.0,
                       philox_seed=0, philox_offset=0, stream=0, total_q=0, total_k=0, philox_state=0,
                       sm_margin=0)
    with pytest.raises(RuntimeError, match="workspace smaller"):
        module.bwd(256, strides, 256, strides, 256, strides, 256, strides, 0, 0, False, *fwd_args)


# ---- PORTATTN_SM80_BWD_WIDE: the main kernel's tile per head dim and budget --------------------
# bwd_tile(head_dim, budget, wide) answers what run_bwd picks (with_first_fitting over BwdConfigsFor,
# or BwdWideConfigsFor with the switch on); bwd_entry.cu instantiates every head dim's configs
# whatever the build's kernels, so the hd64 module answers for all of them.
KIB = 1024
BUDGETS = {"sm90": 227 * KIB, "sm80": 163 * KIB, "sm86": 99 * KIB}
# (block N, block M, Q/dO stages, warps) with the switch off: bwd_kernel (head-dim halves above 128).
HALVES = {
    32: {"sm90": (128, 64, 2, 8), "sm80": (128, 64, 2, 8), "sm86": (128, 64, 2, 8)},
    64: {"sm90": (128, 64, 2, 8), "sm80": (128, 64, 2, 8), "sm86": (128, 64, 2, 8)},
    96: {"sm90": (128, 64, 2, 8), "sm80": (128, 64, 2, 8), "sm86": (128, 64, 1, 8)},
    128: {"sm90": (128, 64, 2, 8), "sm80": (128, 64, 2, 8), "sm86": (64, 64, 1, 4)},
    160: {"sm90": (64, 64, 1, 4), "sm80": (64, 64, 1, 4), "sm86": (64, 64, 1, 4)},
    192: {"sm90": (64, 32, 1, 4), "sm80": (64, 32, 1, 4), "sm86": (64, 32, 1, 4)},
    224: {"sm90": (64, 32, 1, 4), "sm80": (64, 32, 1, 4), "sm86": (64, 32, 1, 4)},
    256: {"sm90": (64, 32, 1, 4), "sm80": (64, 32, 1, 4), "sm86": (48, 32, 1, 3)},
}
# With the switch on (Note [portattn sm80 wide backward]): the whole head dim in one CTA, where one
# of its tiles fits (None: bwd_kernel's tile, as with the switch off).
WIDE = {
    32: {"sm90": None, "sm80": None, "sm86": None},
    64: {"sm90": (128, 128, 2, 8), "sm80": (128, 128, 2, 8), "sm86": (128, 64, 2, 8)},
    96: {"sm90": (128, 64, 2, 8), "sm80": (128, 64, 2, 8), "sm86": None},
    128: {"sm90": (128, 64, 2, 8), "sm80": (128, 64, 2, 8), "sm86": None},
    160: {"sm90": (64, 64, 2, 8), "sm80": (64, 64, 2, 8), "sm86": (64, 64, 1, 8)},
    192: {"sm90": (64, 64, 2, 8), "sm80": (64, 64, 2, 8), "sm86": (64, 32, 1, 8)},
    224: {"sm90": (64, 64, 2, 8), "sm80": (64, 64, 1, 8), "sm86": (64, 32, 1, 8)},
    256: {"sm90": (64, 64, 2, 8), "sm80": (64, 64, 1, 8), "sm86": (48, 32, 1, 6)},
}


def _shape(tile):
    return (tile["block_n"], tile["block_m"], tile["stages"], tile["warps"])


@pytest.mark.parametrize("part", list(BUDGETS))
@pytest.mark.parametrize("head_dim", list(HALVES))
def test_bwd_tile_per_budget_with_the_wide_switch_off_and_on(module, head_dim, part):
    budget = BUDGETS[part]
    off = module.bwd_tile(head_dim, budget, False)
    assert _shape(off) == HALVES[head_dim][part] and not off["wide"]
    assert off["dsplit"] == (2 if head_dim > 128 else 1)
    on = module.bwd_tile(head_dim, budget, True)
    if WIDE[head_dim][part] is None:
        assert on == off
    else:
        assert _shape(on) == WIDE[head_dim][part] and on["wide"] and on["dsplit"] == 1
    for tile in (off, on):
        assert 0 < tile["smem_bytes"] <= budget, (head_dim, part, tile)


# Every wide candidate, fastest first, with the kernels' own kSmemBytes.
WIDE_CANDIDATES = {
    64: [((128, 128, 2, 8), 165888), ((128, 64, 2, 8), 99328)],
    96: [((128, 64, 2, 8), 132096)],
    128: [((128, 64, 2, 8), 164864)],
    160: [((64, 64, 2, 8), 140288), ((64, 64, 1, 8), 98816)],
    192: [((64, 64, 2, 8), 164864), ((64, 64, 1, 8), 115200), ((64, 32, 1, 8), 82176)],
    224: [((64, 64, 2, 8), 189440), ((64, 64, 1, 8), 131584), ((64, 32, 1, 8), 94464)],
    256: [((64, 64, 2, 8), 214016), ((64, 64, 1, 8), 147968), ((48, 32, 1, 6), 88320)],
}


@pytest.mark.parametrize("head_dim", list(WIDE_CANDIDATES))
def test_wide_candidates_run_where_they_fit_and_the_halves_below(module, head_dim):
    # Walking the budget down from 227 KiB visits each candidate once, fastest first, each only where
    # its shared memory fits; below the smallest bwd_kernel runs (the halves above 128, there only
    # under a PORTATTN_MAX_SMEM_KIB cap), whose smallest tile is what the support matrix was told
    # (bwd_smem_bytes).
    seen = []
    for budget in range(227 * KIB, 64 * KIB, -128):
        tile = module.bwd_tile(head_dim, budget, True)
        if not tile["wide"]:
            assert tile["dsplit"] == (2 if head_dim > 128 else 1) and budget < WIDE_CANDIDATES[head_dim][-1][1]
            assert tile == module.bwd_tile(head_dim, budget, False)
            continue
        assert tile["smem_bytes"] <= budget
        if not seen or seen[-1] != (_shape(tile), tile["smem_bytes"]):
            seen.append((_shape(tile), tile["smem_bytes"]))
    assert seen == WIDE_CANDIDATES[head_dim]
    assert (seen[-1][1] <= 99 * KIB) == (head_dim not in (96, 128))  # 99 KiB parts keep bwd_kernel at 96/128
    assert module.bwd_smem_bytes(head_dim) <= seen[-1][1]


# Calls with softcap, ALiBi or dropout skip the plain-only candidates (BwdWideConfig::kPlainOnly):
# at hd64 the 128 x 128 tile, whose extras kernel is not built.
@pytest.mark.parametrize("part", list(BUDGETS))
@pytest.mark.parametrize("head_dim", list(HALVES))
def test_extras_calls_skip_the_plain_only_tiles(module, head_dim, part):
    budget = BUDGETS[part]
    for wide in (False, True):
        plain = module.bwd_tile(head_dim, budget, wide)
        extras = module.bwd_tile(head_dim, budget, wide, extras=True)
        if wide and head_dim == 64 and part != "sm86":
            assert _shape(plain) == (128, 128, 2, 8) and _shape(extras) == (128, 64, 2, 8) and extras["wide"]
        else:
            assert extras == plain


def test_wide_switch_reads_and_sets(module):
    before = module.sm80_bwd_wide()
    try:
        assert module.sm80_bwd_wide(True) is True and module.sm80_bwd_wide() is True
        assert module.bwd_tile(256, 227 * KIB)["wide"]  # wide=None: the current setting
        assert module.sm80_bwd_wide(False) is False
        assert not module.bwd_tile(256, 227 * KIB)["wide"]
    finally:
        module.sm80_bwd_wide(before)
    with pytest.raises(ValueError):
        module.bwd_tile(40, 227 * KIB)


def test_wide_deterministic_splits_count_one_cta_per_kv_head(module):
    # det_splits (bwd_entry.cu): min(ceil(256 / (B * Hk * halves)), ceil(Sk / 64)); the wide kernel
    # has no head-dim halves, so its deterministic workspace holds twice the dQ slices of the halves'.
    b, h, hk, d, sq, sk = 1, 8, 2, 256, 100, 16000  # 250 key blocks of 64: splits 64 (halves), 128 (wide)
    rows = b * h * 104  # each head's 100 rows padded to whole 8-row blocks (the blocked dQ)
    before = module.sm80_bwd_wide()
    try:
        for on, halves in ((False, 2), (True, 1)):
            module.sm80_bwd_wide(on)
            splits = min(math.ceil(256 / (b * hk * halves)), math.ceil(sk / 64))
            assert module.bwd_workspace_bytes(b, h, hk, d, sq, sk, True) == (
                2 * _align(rows * 4) + _align(splits * rows * d * 4))
            # The default mode's workspace does not depend on the switch.
            assert module.bwd_workspace_bytes(b, h, hk, d, sq, sk, False) == (
                2 * _align(rows * 4) + _align(rows * d * 4) + 2 * _align(b * sk * hk * d * 4))
    finally:
        module.sm80_bwd_wide(before)


# ---- the forward's tile per call and budget (fwd_runs_narrow, fwd_launch.cuh) -------------------
# fwd_tile(head_dim, seqlen_q, seqlen_k, budget, masked, extras) answers what launch_fwd_shape runs.
WIDE_FWD = {hd: (128, 128 if hd <= 64 else 64, 4 if hd <= 128 else 8) for hd in (32, 64, 96, 128, 160, 192, 224, 256)}
NARROW_FWD = (64, 64, 4)


def _fwd(module, head_dim, seqlen, part, masked=False, extras=False):
    tile = module.fwd_tile(head_dim, seqlen, seqlen, BUDGETS[part], masked=masked, extras=extras)
    assert tile["narrow"] == ((tile["block_m"], tile["block_n"], tile["warps"]) == NARROW_FWD), tile
    assert tile["smem_bytes"] == (tile["block_m"] + 2 * tile["block_n"]) * head_dim * 2, tile
    return "narrow" if tile["narrow"] else "wide"


@pytest.mark.parametrize("part", list(BUDGETS))
def test_forward_up_to_128_takes_the_narrow_tile_for_short_calls_only(module, part):
    # Note [portattn sm80 narrow tiles]: the budget never matters at these head dims.
    for hd in (32, 64, 96, 128):
        assert _fwd(module, hd, 50, part) == "narrow"
        assert _fwd(module, hd, 4096, part) == "wide"
        assert _fwd(module, hd, 4096, part, masked=True) == "wide"
        tile = module.fwd_tile(hd, 4096, 4096, BUDGETS[part])
        assert (tile["block_m"], tile["block_n"], tile["warps"]) == WIDE_FWD[hd]
    assert _fwd(module, 64, 512, part, masked=True) == "narrow"
    assert _fwd(module, 128, 512, part, masked=True) == "wide"  # above kNarrowMaxSeqlenWide


# Note [portattn sm80 narrow tiles above 128]: where two narrow CTAs fit an SM (sm90 every head
# dim, sm80 160 and 192), narrow at 192/224, and at 160/256 up to 1k or masked up to 8k; calls with
# extras keep the wide tile; below the wide tile's budget (224/256 on sm86) narrow whatever the call.
@pytest.mark.parametrize("head_dim", [160, 192, 224, 256])
def test_forward_above_128_runs_two_narrow_ctas_where_they_fit_and_pay(module, head_dim):
    two_fit = {"sm90": True, "sm80": head_dim <= 192, "sm86": False}
    always = head_dim in (192, 224)
    for part in BUDGETS:
        budget_narrow = part == "sm86" and head_dim > 192  # the wide tile does not fit 99 KiB
        for seqlen, masked, pays in ((512, False, True), (1024, False, True), (4096, True, True),
                                     (8192, True, True), (4096, False, always), (16384, True, always),
                                     (16384, False, always)):
            expect = budget_narrow or (two_fit[part] and pays)
            assert _fwd(module, head_dim, seqlen, part, masked) == ("narrow" if expect else "wide"), \
                (part, seqlen, masked)
            assert _fwd(module, head_dim, seqlen, part, masked, extras=True) == ("narrow" if budget_narrow else "wide")


def test_fwd_tile_refuses_head_dims_without_a_tile(module):
    with pytest.raises(ValueError, match="no forward tile for head dim 40"):
        module.fwd_tile(40, 128, 128, 227 * KIB)
