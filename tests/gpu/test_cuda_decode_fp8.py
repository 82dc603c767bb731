"""The decode kernels over FP8 (e4m3) caches (Note [portattn fp8 kv cache] in common/params.h).

Oracle: float64 naive attention on the dequantised cache (e4m3 value * descale[b, hk]). Error
rule (tests/error_rule.py): the output within 2x PyTorch's error computing the same attention in
q's dtype from the dequantised cache rounded to that dtype; the LSE within 2e-3 of the oracle's.
Outputs come from allocator memory poisoned with NaN; unused pages and rows past each sequence's
end hold e4m3 NaN bytes, which must never be read.

Every kernel case runs on the FP8 paths (PORTATTN_DECODE_FP8_PATH: "regs", the register fragments and
the default; "regs_deep", the same with a 5-stage ring; "smem", the conversion pass; Notes [portattn fp8
register fragments] and [portattn fp8 deep pipeline] in docs/decode.md), switched in-process with
`_C.decode_fp8_path` (the fixture `fp8_path`). The layout grid (test_fp8_decode_layouts_and_splits)
runs in full on the two register paths and on bf16 queries with 0 and 3 splits on "smem", whose
kernel no change of the register paths touches (FULL_GRID_PATHS). Each path's split plans are its
own (the plan key holds the path; the planner asks the launched kernel's occupancy). The variable
itself is checked in a fresh process per value (test_fp8_path_env_is_read_at_the_first_call).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from error_rule import assert_output
from naive import naive_attention

pytestmark = pytest.mark.gpu

from cuda_gpu_setup import cuda_backend  # noqa: E402  (skips without a GPU)

import portattn  # noqa: E402
from portattn import decode, kvcache  # noqa: E402
from portattn.kvcache import apply_rotary  # noqa: E402

if not hasattr(cuda_backend._C, "decode"):
    pytest.skip("this CUDA build has no decode kernels", allow_module_level=True)

FP8 = torch.float8_e4m3fn
NAN_BYTE = 0x7F  # e4m3fn's NaN
FP8_PATHS = ["regs", "regs_deep", "smem"]
FULL_GRID_PATHS = ("regs", "regs_deep")


@pytest.fixture(params=FP8_PATHS)
def fp8_path(request):
    """Runs the test with the FP8 decode path `request.param`, then restores the one in effect."""
    if not hasattr(cuda_backend._C, "decode_fp8_path"):
        pytest.skip("this CUDA build predates PORTATTN_DECODE_FP8_PATH (no _C.decode_fp8_path)")
    before = cuda_backend._C.decode_fp8_path()
    cuda_backend._C.decode_fp8_path(request.param)
    try:
        yield request.param
    finally:
        cuda_backend._C.decode_fp8_path(before if before != "invalid" else "regs")


def poison_allocator(nbytes: int) -> None:
    junk = torch.full((nbytes // 2,), float("nan"), dtype=torch.float16, device="cuda")
    del junk


@pytest.fixture
def in_place_only(monkeypatch):
    """Fails the test if the call fell back to gathering the cache."""
    def refuse(*args, **kwargs):
        raise AssertionError("the call gathered the cache instead of running the decode kernels")
    monkeypatch.setattr(kvcache, "_gather_and_attend", refuse)


def e4m3(shape, scale=1.0):
    """Random e4m3 values across the format's range, subnormals included."""
    x = torch.randn(*shape, device="cuda") * scale
    x.view(-1)[::53] = 2.0 ** -8  # a subnormal
    x.view(-1)[::101] = -448.0
    return x.clamp(-448, 448).to(FP8)


class Fp8Cache:
    """A logical e4m3 cache (batch, capacity, Hk, D) with descales, laid out contiguous or paged."""

    def __init__(self, batch, capacity, heads_k, dim, layout, page=16, descales=True):
        self.logical_k = e4m3((batch, capacity, heads_k, dim), 0.5)
        self.logical_v = e4m3((batch, capacity, heads_k, dim), 2.0)
        self.k_descale = (torch.rand(batch, heads_k, device="cuda") * 0.4 + 0.05) if descales else None
        self.v_descale = (torch.rand(batch, heads_k, device="cuda") * 2 + 0.25) if descales else None
        self.layout, self.block_table = layout, None
        if layout == "contiguous":
            self.k, self.v = self.logical_k.clone(), self.logical_v.clone()
        else:
            per_seq = capacity // page
            pages = batch * per_seq + 5
            self.k = torch.full((pages, page, heads_k, dim), NAN_BYTE, dtype=torch.uint8, device="cuda").view(FP8)
            self.v = self.k.clone()
            order = torch.randperm(pages, device="cuda")[: batch * per_seq]
            self.block_table = order.reshape(batch, per_seq).to(torch.int32)
            self.rows = (self.block_table.long()[:, :, None] * page + torch.arange(page, device="cuda")).flatten()
            # Indexed as bytes (the same bits; index_put needs no float8 kernel).
            self.k.view(torch.uint8).view(-1, heads_k, dim)[self.rows] = self.logical_k.view(torch.uint8).reshape(-1, heads_k, dim)
            self.v.view(torch.uint8).view(-1, heads_k, dim)[self.rows] = self.logical_v.view(torch.uint8).reshape(-1, heads_k, dim)

    def nan_tail(self, ends):
        """Rows past each sequence's end hold e4m3 NaN (a leak would show)."""
        for b, end in enumerate(ends):
            if self.layout == "contiguous":
                self.k[b, end:].view(torch.uint8).fill_(NAN_BYTE)
                self.v[b, end:].view(torch.uint8).fill_(NAN_BYTE)
            else:
                page = self.k.shape[1]
                for pos in range(end, self.logical_k.shape[1]):
                    self.k[self.block_table[b, pos // page], pos % page].view(torch.uint8).fill_(NAN_BYTE)
                    self.v[self.block_table[b, pos // page], pos % page].view(torch.uint8).fill_(NAN_BYTE)

    def read_back(self):
        """The logical cache as the kernels now see it (after appends)."""
        if self.layout == "contiguous":
            return self.k, self.v
        heads_k, dim = self.k.shape[2], self.k.shape[3]
        shape = self.logical_k.shape
        k, v = self.k.view(torch.uint8), self.v.view(torch.uint8)
        return (k.view(-1, heads_k, dim)[self.rows].view(shape).view(FP8), v.view(-1, heads_k, dim)[self.rows].view(shape).view(FP8))

    def dequantised(self, keys, values):
        k, v = keys.double(), values.double()
        if self.k_descale is not None:
            k = k * self.k_descale.double()[:, None, :, None]
            v = v * self.v_descale.double()[:, None, :, None]
        return k, v


def expected(q, keys, values, seqlens, compute_dtype=torch.float64):
    """Per-sequence attention over dequantised (float64) caches of seqlens[b] live rows."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        n = int(seqlens[b])
        qb = q[b : b + 1]
        kb, vb = keys[b : b + 1, :n], values[b : b + 1, :n]
        if compute_dtype != torch.float64:
            kb, vb = kb.to(compute_dtype), vb.to(compute_dtype)
        o, lse = naive_attention(qb, kb, vb, compute_dtype=compute_dtype)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def check(out, lse, ref, ref_lse, low):
    assert_output(out, ref, low)
    if lse is not None:
        empty = torch.isinf(ref_lse)
        assert torch.equal(torch.isinf(lse), empty), "lse = -inf on a different set of rows"
        if (~empty).any():
            assert (lse.double() - ref_lse)[~empty].abs().max().item() < 2e-3
        assert (out[empty.transpose(1, 2)] == 0).all(), "rows without keys must be 0"


def _grid_cases():
    """(path, dtype, dim, heads, layout, splits): the full grid on FULL_GRID_PATHS, bf16 queries with
    0 and 3 splits on the others."""
    for path in FP8_PATHS:
        for dtype in (torch.bfloat16, torch.float16):
            for dim in (64, 128, 256, 112):
                for heads in ((32, 8), (8, 8), (6, 1)):
                    for layout in ("contiguous", "paged16", "paged64", "paged256"):
                        for splits in (0, 1, 3, 1000):
                            if path in FULL_GRID_PATHS or (dtype == torch.bfloat16 and splits in (0, 3)):
                                yield pytest.param(path, dtype, dim, heads, layout, splits,
                                                   id=f"{path}-{str(dtype)[6:]}-{dim}-{heads[0]}x{heads[1]}-"
                                                      f"{layout}-{splits}")


@pytest.mark.parametrize("fp8_path, dtype, dim, heads, layout, splits", _grid_cases(), indirect=["fp8_path"])
def test_fp8_decode_layouts_and_splits(dtype, dim, heads, layout, splits, in_place_only, fp8_path):
    batch, capacity = 4, 768
    page = int(layout[5:]) if layout.startswith("paged") else 16
    cache = Fp8Cache(batch, capacity, heads[1], dim, "contiguous" if layout == "contiguous" else "paged", page)
    seqlens = torch.tensor([0, 1, 700, 333], dtype=torch.int32, device="cuda")
    cache.nan_tail(seqlens.tolist())
    q = torch.randn(batch, 1, heads[0], dim, device="cuda", dtype=dtype)
    poison_allocator(64 << 20)
    out, lse = portattn.flash_attn_with_kvcache(
        q, cache.k, cache.v, cache_seqlens=seqlens, block_table=cache.block_table, num_splits=splits,
        return_softmax_lse=True, k_descale=cache.k_descale, v_descale=cache.v_descale)
    keys, values = cache.dequantised(cache.logical_k, cache.logical_v)
    ref, ref_lse = expected(q, keys, values, seqlens)
    low, _ = expected(q, keys, values, seqlens, compute_dtype=dtype)
    check(out, lse, ref, ref_lse, low)


@pytest.mark.parametrize("descales", ["per_head", "expanded", "none"])
@pytest.mark.parametrize("softcap", [0.0, 8.0])
def test_fp8_descale_forms_and_softcap(descales, softcap, in_place_only, fp8_path):
    batch, heads, dim, capacity = 3, (16, 2), 128, 2048
    cache = Fp8Cache(batch, capacity, heads[1], dim, "paged", 16, descales=descales == "per_head")
    if descales == "expanded":
        cache.k_descale = torch.tensor(0.125, device="cuda").expand(batch, heads[1])
        cache.v_descale = torch.tensor(3.0, device="cuda").expand(batch, heads[1])
    seqlens = torch.tensor([2048, 5, 1500], dtype=torch.int32, device="cuda")
    q = torch.randn(batch, 1, heads[0], dim, device="cuda", dtype=torch.bfloat16)
    poison_allocator(64 << 20)
    out = portattn.flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=seqlens, block_table=cache.block_table,
                                           softcap=softcap, k_descale=cache.k_descale, v_descale=cache.v_descale)
    keys, values = cache.dequantised(cache.logical_k, cache.logical_v)
    ref = torch.cat([naive_attention(q[b : b + 1], keys[b : b + 1, : int(seqlens[b])], values[b : b + 1, : int(seqlens[b])],
                                     softcap=softcap)[0] for b in range(batch)])
    low = torch.cat([naive_attention(q[b : b + 1], keys[b : b + 1, : int(seqlens[b])].bfloat16(),
                                     values[b : b + 1, : int(seqlens[b])].bfloat16(), softcap=softcap,
                                     compute_dtype=torch.bfloat16)[0] for b in range(batch)])
    assert_output(out, ref, low)


@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("new", [1, 4])
@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_append_quantises_like_the_reference(dtype, layout, new, rotary, in_place_only, fp8_path):
    """The kernel's append writes the bytes the reference path writes (RNE, saturating), then attends."""
    batch, heads, dim, capacity = 3, (32, 8), 128, 512
    cache = Fp8Cache(batch, capacity, heads[1], dim, "contiguous" if layout == "contiguous" else "paged", 16)
    seqlens = torch.tensor([0, 200, 500], dtype=torch.int32, device="cuda")
    q = torch.randn(batch, new, heads[0], dim, device="cuda", dtype=dtype)
    k_new = torch.randn(batch, new, heads[1], dim, device="cuda", dtype=dtype) * 0.3
    v_new = torch.randn_like(k_new) * 4
    k_new[0, 0, 0, :4] = torch.tensor([1e4, -1e4, 0.0, 2.0 ** -12], dtype=dtype)  # saturate / underflow
    rot = None
    if rotary:
        angles = torch.rand(capacity + 8, 32, device="cuda") * 6
        rot = (angles.cos().to(dtype), angles.sin().to(dtype))
    reference_k, reference_v = cache.read_back()
    reference_k, reference_v = reference_k.clone(), reference_v.clone()
    poison_allocator(64 << 20)
    out = portattn.flash_attn_with_kvcache(
        q, cache.k, cache.v, k=k_new, v=v_new, rotary_cos=None if rot is None else rot[0],
        rotary_sin=None if rot is None else rot[1], cache_seqlens=seqlens, block_table=cache.block_table,
        causal=True, k_descale=cache.k_descale, v_descale=cache.v_descale)
    got_k, got_v = cache.read_back()
    positions = seqlens.long()[:, None] + torch.arange(new, device="cuda")
    rotated = k_new if rot is None else apply_rotary(k_new, rot[0], rot[1], positions, True)
    want_k = kvcache.quantize_fp8(rotated, cache.k_descale)
    want_v = kvcache.quantize_fp8(v_new, cache.v_descale)
    for b in range(batch):
        n = int(seqlens[b])
        reference_k.view(torch.uint8)[b, n : n + new] = want_k[b].view(torch.uint8)
        reference_v.view(torch.uint8)[b, n : n + new] = want_v[b].view(torch.uint8)
    assert torch.equal(got_k.view(torch.uint8), reference_k.view(torch.uint8)), "appended keys differ from the reference's bytes"
    assert torch.equal(got_v.view(torch.uint8), reference_v.view(torch.uint8)), "appended values differ from the reference's bytes"
    keys, values = cache.dequantised(got_k, got_v)
    total = seqlens + new
    ref_parts, low_parts = [], []
    for b in range(batch):
        qb = q[b : b + 1]
        if rot is not None:
            qpos = int(seqlens[b]) + torch.arange(new, device="cuda")[None]
            qb = apply_rotary(qb, rot[0], rot[1], qpos, True)
        n = int(total[b])
        ref_parts.append(naive_attention(qb, keys[b : b + 1, :n], values[b : b + 1, :n], causal=True)[0])
        low_parts.append(naive_attention(qb, keys[b : b + 1, :n].to(dtype), values[b : b + 1, :n].to(dtype), causal=True,
                                         compute_dtype=dtype)[0])
    assert_output(out, torch.cat(ref_parts), torch.cat(low_parts))


def test_fp8_cuda_graph_replay_with_changing_lengths(fp8_path):
    """One captured step (FP8 append + paged decode), replayed with new tokens, lengths and descales
    written in place between replays."""
    dtype, dim, heads, batch, capacity, page = torch.bfloat16, 128, (32, 8), 3, 1024, 16
    cache = Fp8Cache(batch, capacity, heads[1], dim, "paged", page)
    q = torch.randn(batch, 1, heads[0], dim, device="cuda", dtype=dtype)
    k_new = torch.randn(batch, 1, heads[1], dim, device="cuda", dtype=dtype)
    v_new = torch.randn_like(k_new)
    seqlens = torch.tensor([5, 300, 0], dtype=torch.int32, device="cuda")

    def step():
        return portattn.flash_attn_with_kvcache(q, cache.k, cache.v, k=k_new, v=v_new, cache_seqlens=seqlens,
                                                block_table=cache.block_table, causal=True,
                                                k_descale=cache.k_descale, v_descale=cache.v_descale)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside the graph (dispatch decisions, smem opt-in)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for lengths in ([6, 301, 1], [100, 1000, 17], [0, 0, 1023]):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        k_new.copy_(torch.randn_like(k_new))
        v_new.copy_(torch.randn_like(v_new))
        cache.k_descale.copy_(torch.rand_like(cache.k_descale) * 0.3 + 0.05)
        cache.v_descale.copy_(torch.rand_like(cache.v_descale) + 0.5)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        keys, values = cache.dequantised(*cache.read_back())
        total = torch.tensor(lengths) + 1
        ref = torch.cat([naive_attention(q[b : b + 1], keys[b : b + 1, : int(total[b])], values[b : b + 1, : int(total[b])],
                                         causal=True)[0] for b in range(batch)])
        low = torch.cat([naive_attention(q[b : b + 1], keys[b : b + 1, : int(total[b])].to(dtype),
                                         values[b : b + 1, : int(total[b])].to(dtype), causal=True,
                                         compute_dtype=dtype)[0] for b in range(batch)])
        assert_output(out, ref, low)


def test_fp8_head_dim_not_a_multiple_of_16_runs_on_the_reference_path():
    batch, heads, dim = 2, (8, 2), 72
    cache = Fp8Cache(batch, 256, heads[1], dim, "contiguous")
    q = torch.randn(batch, 1, heads[0], dim, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.tensor([256, 7], dtype=torch.int32, device="cuda")
    out = portattn.flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=seqlens,
                                           k_descale=cache.k_descale, v_descale=cache.v_descale)
    keys, values = cache.dequantised(cache.logical_k, cache.logical_v)
    ref, _ = expected(q, keys, values, seqlens)
    low, _ = expected(q, keys, values, seqlens, compute_dtype=torch.bfloat16)
    assert_output(out, ref, low)


@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("window", [(-1, -1), (100, 0)])
def test_fp8_paths_agree_on_windows_and_alibi(dim, window, in_place_only):
    """Local windows and ALiBi on every path (the key order of the scores is the 16-bit path's on both),
    each against the oracle; a 16-token paged cache with GQA and splits."""
    if not hasattr(cuda_backend._C, "decode_fp8_path"):
        pytest.skip("this CUDA build predates PORTATTN_DECODE_FP8_PATH (no _C.decode_fp8_path)")
    batch, heads, capacity, new = 3, (16, 4), 1024, 3
    cache = Fp8Cache(batch, capacity, heads[1], dim, "paged", 16)
    seqlens = torch.tensor([1024, 77, 600], dtype=torch.int32, device="cuda")
    q = torch.randn(batch, new, heads[0], dim, device="cuda", dtype=torch.float16)
    slopes = torch.rand(batch, heads[0], device="cuda") * 0.05
    before = cuda_backend._C.decode_fp8_path()
    try:
        outs = {}
        for path in FP8_PATHS:
            cuda_backend._C.decode_fp8_path(path)
            poison_allocator(64 << 20)
            outs[path] = portattn.flash_attn_with_kvcache(
                q, cache.k, cache.v, cache_seqlens=seqlens, block_table=cache.block_table, causal=True,
                window_size=window, alibi_slopes=slopes, num_splits=3, k_descale=cache.k_descale,
                v_descale=cache.v_descale)
    finally:
        cuda_backend._C.decode_fp8_path(before if before != "invalid" else "regs")
    keys, values = cache.dequantised(cache.logical_k, cache.logical_v)
    ref_parts, low_parts = [], []
    for b in range(batch):
        n = int(seqlens[b])
        kb, vb = keys[b : b + 1, :n], values[b : b + 1, :n]
        options = dict(causal=True, window=window, alibi_slopes=slopes[b : b + 1])
        ref_parts.append(naive_attention(q[b : b + 1], kb, vb, **options)[0])
        low_parts.append(naive_attention(q[b : b + 1], kb.half(), vb.half(), compute_dtype=torch.float16, **options)[0])
    for path in FP8_PATHS:
        assert_output(outs[path], torch.cat(ref_parts), torch.cat(low_parts))


@pytest.mark.parametrize("value, expected", [("regs", "regs"), ("regs_deep", "regs_deep"), ("smem", "smem"),
                                             ("", "regs"), ("bogus", "invalid")])
def test_fp8_path_env_is_read_at_the_first_call(value, expected):
    """A fresh process per value: the variable is read once. An invalid value fails every FP8 decode call
    with a message naming the variable; the setter repairs it."""
    code = (
        "import torch, portattn\n"
        "from portattn.backends.cuda import _C\n"
        "print('path', _C.decode_fp8_path())\n"
        "q = torch.randn(1, 1, 8, 128, device='cuda', dtype=torch.bfloat16)\n"
        "k = (torch.randn(1, 64, 2, 128, device='cuda') * 0.1).to(torch.float8_e4m3fn)\n"
        "call = lambda: portattn.flash_attn_with_kvcache(q, k, k, cache_seqlens=torch.tensor([64], dtype=torch.int32, "
        "device='cuda'), k_descale=torch.ones(1, 2, device='cuda'), v_descale=torch.ones(1, 2, device='cuda'))\n"
        "from portattn import kvcache\n"
        "def refuse(*args, **kwargs):\n    raise AssertionError('gathered')\n"
        "kvcache._gather_and_attend = refuse\n"
        "try:\n    call(); torch.cuda.synchronize(); print('ran')\n"
        "except Exception as error:\n    print('error', error)\n"
        "_C.decode_fp8_path('smem'); call(); torch.cuda.synchronize(); print('after set', _C.decode_fp8_path())\n"
    )
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    env = dict(os.environ, PORTATTN_DECODE_FP8_PATH=value)
    result = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"path {expected}" in result.stdout
    if expected == "invalid":
        assert "PORTATTN_DECODE_FP8_PATH" in result.stdout and "'bogus'" in result.stdout
    else:
        assert "ran" in result.stdout
    assert "after set smem" in result.stdout


def test_fp8_planner_sees_each_paths_kernel(fp8_path):
    """The occupancy query answers for the kernel the path launches: regs and regs_deep have no
    converted stage (48 / 80 KiB at hd 128), smem 80 KiB; resident CTAs come from the occupancy
    calculator (shared memory and registers) and match the device's shared-memory limit."""
    C = cuda_backend._C
    if not hasattr(C, "decode_occupancy"):
        pytest.skip("this CUDA build has no _C.decode_occupancy")
    tile = C.decode_occupancy(128, 1, 1, False)
    expect = {"regs": (48, 3), "regs_deep": (80, 5), "smem": (80, 3)}[fp8_path]
    assert (tile["smem_bytes"] // 1024, tile["stages"]) == expect, tile
    assert 0 < tile["registers"] <= 255 and tile["ctas_per_sm"] >= 1, tile
    props = torch.cuda.get_device_properties(0)
    per_sm = props.shared_memory_per_multiprocessor
    assert tile["ctas_per_sm"] <= per_sm // (tile["smem_bytes"] + 1024), tile
    assert tile["ctas_per_sm"] <= 65536 // (tile["threads"] * tile["registers"]), tile
    extras = C.decode_occupancy(128, 1, 1, True)
    assert extras["smem_bytes"] == tile["smem_bytes"] and extras["ctas_per_sm"] <= tile["ctas_per_sm"]


def test_fp8_regs_deep_falls_back_to_regs_under_a_small_budget(in_place_only):
    """PORTATTN_MAX_SMEM_KIB below regs_deep's 80 KiB: the 3-stage register kernel (48 KiB) runs, and
    the planner is told so."""
    C = cuda_backend._C
    if not hasattr(C, "decode_occupancy") or not hasattr(C, "set_smem_cap"):
        pytest.skip("this CUDA build has no _C.decode_occupancy or _C.set_smem_cap")
    before_path, before_cap = C.decode_fp8_path(), C.smem_cap()
    batch, heads, dim = 2, (8, 2), 128
    cache = Fp8Cache(batch, 512, heads[1], dim, "paged", 16)
    seqlens = torch.tensor([512, 100], dtype=torch.int32, device="cuda")
    q = torch.randn(batch, 1, heads[0], dim, device="cuda", dtype=torch.bfloat16)
    try:
        C.decode_fp8_path("regs_deep")
        C.set_smem_cap(64 * 1024)
        decode.forget_plans()
        assert C.decode_occupancy(128, 1, 1, False)["smem_bytes"] == 48 * 1024
        out = portattn.flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=seqlens, block_table=cache.block_table,
                                               num_splits=3, k_descale=cache.k_descale, v_descale=cache.v_descale)
    finally:
        C.set_smem_cap(before_cap)
        decode.forget_plans()
        C.decode_fp8_path(before_path if before_path != "invalid" else "regs")
    keys, values = cache.dequantised(cache.logical_k, cache.logical_v)
    ref, _ = expected(q, keys, values, seqlens)
    low, _ = expected(q, keys, values, seqlens, compute_dtype=torch.bfloat16)
    assert_output(out, ref, low)


@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
@pytest.mark.parametrize("new", [0, 2])
def test_fp8_query_on_the_decode_kernels(layout, new, in_place_only):
    """An e4m3 query with q_descale (FlashAttention-3's): read in place by the decode kernels,
    against the float64 oracle on q * q_descale and the dequantised cache; the appended rows are
    quantised with k_descale / v_descale (the query's scale is not folded into them)."""
    batch, heads, dim, capacity = 3, (16, 4), 128, 1024
    cache = Fp8Cache(batch, capacity, heads[1], dim, layout)
    seqlens = torch.tensor([1000, 1, 517], dtype=torch.int32, device="cuda")
    cache.nan_tail((seqlens + new).tolist())
    q8 = e4m3((batch, max(new, 1), heads[0], dim), 8.0)
    q_descale = torch.rand(batch, heads[1], device="cuda") * 0.02 + 0.01  # amax / 448 of a query of |q| <= 13
    per_head = q_descale.repeat_interleave(heads[0] // heads[1], dim=1)[:, None, :, None]
    # With an append, the documented query is e4m3 * q_descale rounded to bfloat16 (fold_fp8_query);
    # without one it is exact.
    q_real = (q8.float() * per_head).bfloat16().double() if new else q8.double() * per_head.double()
    k_new = torch.randn(batch, new, heads[1], dim, device="cuda", dtype=torch.bfloat16) if new else None
    v_new = torch.randn(batch, new, heads[1], dim, device="cuda", dtype=torch.bfloat16) if new else None
    poison_allocator(64 << 20)
    out, lse = portattn.flash_attn_with_kvcache(
        q8, cache.k, cache.v, k=k_new, v=v_new, cache_seqlens=seqlens, block_table=cache.block_table, causal=True,
        return_softmax_lse=True, k_descale=cache.k_descale, v_descale=cache.v_descale, q_descale=q_descale)
    assert out.dtype == torch.bfloat16
    keys8, values8 = cache.read_back()
    if new:
        for b in range(batch):
            n = int(seqlens[b])
            want = kvcache.quantize_fp8(k_new[b : b + 1], cache.k_descale[b : b + 1])[0]
            assert torch.equal(keys8[b, n : n + new].view(torch.uint8), want.view(torch.uint8))
    keys, values = cache.dequantised(keys8, values8)
    for b in range(batch):
        n = int(seqlens[b]) + new
        ref, ref_lse = naive_attention(q_real[b : b + 1], keys[b : b + 1, :n], values[b : b + 1, :n], causal=True)
        low, _ = naive_attention(q_real[b : b + 1].bfloat16(), keys[b : b + 1, :n].bfloat16(),
                                 values[b : b + 1, :n].bfloat16(), causal=True, compute_dtype=torch.bfloat16)
        check(out[b : b + 1], lse[b : b + 1], ref, ref_lse, low)
