"""The split-KV decode kernels (csrc/decode_*) through the public API, against the float64 oracle.

Error rule: tests/error_rule.py (outputs within 2x PyTorch's own low-precision error of the
float64 oracle; the LSE here within an absolute 2e-3 of the oracle's). Outputs are drawn from allocator
memory poisoned with NaN first, so an element the kernels never write shows up.
"""
from __future__ import annotations

import math

import pytest
import torch

from error_rule import assert_output
from naive import naive_attention

pytestmark = pytest.mark.gpu

from cuda_gpu_setup import BACKEND, cuda_backend  # noqa: E402  (skips without a GPU)

import portattn  # noqa: E402
from portattn import dispatch, kvcache  # noqa: E402
from portattn.kvcache import apply_rotary  # noqa: E402

if not hasattr(cuda_backend._C, "decode"):
    pytest.skip("this CUDA build has no decode kernels", allow_module_level=True)


def poison_allocator(nbytes: int) -> None:
    """Hand the caching allocator blocks full of NaN, so the next allocations start dirty."""
    junk = torch.full((nbytes // 2,), float("nan"), dtype=torch.float16, device="cuda")
    del junk


class Cache:
    """A logical cache (batch, capacity, Hk, D) and its physical layout for one test case."""

    def __init__(self, batch, capacity, heads_k, dim, dtype, layout, page=16):
        self.logical_k = torch.randn(batch, capacity, heads_k, dim, device="cuda", dtype=dtype)
        self.logical_v = torch.randn(batch, capacity, heads_k, dim, device="cuda", dtype=dtype)
        self.layout, self.batch, self.capacity = layout, batch, capacity
        self.batch_idx = self.block_table = None
        if layout == "contiguous":
            self.k, self.v = self.logical_k.clone(), self.logical_v.clone()
        elif layout == "batch_idx":  # the sequences sit in a larger cache, in another order
            extra = 3
            self.k = torch.randn(batch + extra, capacity, heads_k, dim, device="cuda", dtype=dtype)
            self.v = torch.randn_like(self.k)
            self.batch_idx = torch.randperm(batch + extra, device="cuda")[:batch].to(torch.int32)
            self.k[self.batch_idx.long()] = self.logical_k
            self.v[self.batch_idx.long()] = self.logical_v
        else:  # paged, pages shuffled, plus unused pages full of NaN (never read)
            assert capacity % page == 0
            per_seq = capacity // page
            pages = batch * per_seq + 5
            self.k = torch.full((pages, page, heads_k, dim), float("nan"), device="cuda", dtype=dtype)
            self.v = torch.full_like(self.k, float("nan"))
            order = torch.randperm(pages, device="cuda")[: batch * per_seq]
            self.block_table = order.reshape(batch, per_seq).to(torch.int32)
            rows = (self.block_table.long()[:, :, None] * page + torch.arange(page, device="cuda")).flatten()
            self.k.view(-1, heads_k, dim)[rows] = self.logical_k.reshape(-1, heads_k, dim)
            self.v.view(-1, heads_k, dim)[rows] = self.logical_v.reshape(-1, heads_k, dim)

    def nan_tail(self, ends):
        """Logical rows past each sequence's end hold NaN (a 0 * NaN leak would show)."""
        for b, end in enumerate(ends):
            if self.layout == "paged":
                page = self.k.shape[1]
                for pos in range(end, self.capacity):
                    self.k[self.block_table[b, pos // page], pos % page] = float("nan")
                    self.v[self.block_table[b, pos // page], pos % page] = float("nan")
            else:
                row = b if self.batch_idx is None else int(self.batch_idx[b])
                self.k[row, end:] = float("nan")
                self.v[row, end:] = float("nan")


def expected(q, cache, seqlens, leftpad, k_new, v_new, *, causal=False, window=(-1, -1), softcap=0.0,
             alibi=None, rotary=None, interleaved=True, compute_dtype=torch.float64):
    """Per-sequence oracle on the logical cache, flash-attn 2 semantics."""
    outs, lses = [], []
    seqlen_q = q.shape[1]
    new = 0 if k_new is None else k_new.shape[1]
    for b in range(q.shape[0]):
        n, start = int(seqlens[b]), int(leftpad[b]) if leftpad is not None else 0
        qb = q[b : b + 1]
        keys, values = cache.logical_k[b : b + 1, start:n], cache.logical_v[b : b + 1, start:n]
        if k_new is not None:
            kb = k_new[b : b + 1]
            if rotary is not None:
                kb = apply_rotary(kb, rotary[0], rotary[1], (n + torch.arange(new, device="cuda")).unsqueeze(0), interleaved)
            keys = torch.cat([keys, kb], dim=1)
            values = torch.cat([values, v_new[b : b + 1]], dim=1)
        if rotary is not None:
            per_token = causal or window != (-1, -1)
            offsets = torch.arange(seqlen_q, device="cuda") if per_token else torch.zeros(seqlen_q, dtype=torch.long, device="cuda")
            qb = apply_rotary(qb, rotary[0], rotary[1], (n + offsets).unsqueeze(0), interleaved)
        slopes = None if alibi is None else alibi
        o, l = naive_attention(qb, keys, values, causal=causal, window=window, softcap=softcap,
                               alibi_slopes=slopes, compute_dtype=compute_dtype)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses)


def check(out, lse, ref, ref_lse, low):
    assert_output(out, ref, low)
    if lse is not None:
        empty = torch.isinf(ref_lse)
        assert torch.equal(torch.isinf(lse), empty), "lse = -inf on a different set of rows"
        if (~empty).any():
            assert (lse.double() - ref_lse)[~empty].abs().max().item() < 2e-3
        rows = empty.t() if empty.dim() == 2 else empty.transpose(1, 2)  # varlen (H, total) or (B, H, Sq)
        assert (out[rows] == 0).all(), "rows without keys must be 0"


@pytest.fixture
def in_place_only(monkeypatch):
    """Fails the test if the call fell back to gathering the cache."""
    def refuse(*args, **kwargs):
        raise AssertionError("the call gathered the cache instead of running the decode kernels")
    monkeypatch.setattr(kvcache, "_gather_and_attend", refuse)


LAYOUTS = ["contiguous", "batch_idx", "paged16", "paged64", "paged256"]


@pytest.mark.parametrize("splits", [0, 1, 2, 7, 1000])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("heads", [(8, 2), (4, 4), (6, 1)], ids=lambda h: f"{h[0]}x{h[1]}")
@pytest.mark.parametrize("dim", [64, 128, 256, 80])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_layouts_and_splits(dtype, dim, heads, layout, splits, in_place_only):
    batch, capacity = 4, 768
    page = int(layout[5:]) if layout.startswith("paged") else 16
    cache = Cache(batch, capacity, heads[1], dim, dtype, "paged" if layout.startswith("paged") else layout, page)
    seqlens = torch.tensor([0, 1, 700, 333], dtype=torch.int32, device="cuda")
    cache.nan_tail(seqlens.tolist())
    q = torch.randn(batch, 1, heads[0], dim, device="cuda", dtype=dtype)
    poison_allocator(64 << 20)
    out, lse = portattn.flash_attn_with_kvcache(
        q, cache.k, cache.v, cache_seqlens=seqlens, cache_batch_idx=cache.batch_idx,
        block_table=cache.block_table, num_splits=splits, return_softmax_lse=True)
    ref, ref_lse = expected(q, cache, seqlens, None, None, None)
    low, _ = expected(q, cache, seqlens, None, None, None, compute_dtype=dtype)
    check(out, lse, ref, ref_lse, low)


@pytest.mark.parametrize("rotary", [None, "interleaved", "neox"])
@pytest.mark.parametrize("new", [1, 5])
@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
@pytest.mark.parametrize("leftpad", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_append_rotary_leftpad(rotary, new, layout, leftpad, causal, in_place_only):
    dtype, dim, heads, batch, capacity = torch.bfloat16, 128, (8, 2), 3, 512
    cache = Cache(batch, capacity, heads[1], dim, dtype, "paged" if layout == "paged16" else layout, 16)
    seqlens = torch.tensor([0, 200, 450], dtype=torch.int32, device="cuda")
    pad = torch.tensor([0, 37, 449], dtype=torch.int32, device="cuda") if leftpad else None
    q = torch.randn(batch, new, heads[0], dim, device="cuda", dtype=dtype)
    k_new = torch.randn(batch, new, heads[1], dim, device="cuda", dtype=dtype)
    v_new = torch.randn_like(k_new)
    rot = None
    if rotary:
        angles = torch.rand(capacity + 8, 32, device="cuda") * 6
        rot = (angles.cos().to(dtype), angles.sin().to(dtype))
    ref, ref_lse = expected(q, cache, seqlens, pad, k_new, v_new, causal=causal, rotary=rot,
                            interleaved=rotary == "interleaved")
    low, _ = expected(q, cache, seqlens, pad, k_new, v_new, causal=causal, rotary=rot,
                      interleaved=rotary == "interleaved", compute_dtype=dtype)
    poison_allocator(64 << 20)
    out, lse = portattn.flash_attn_with_kvcache(
        q, cache.k, cache.v, k=k_new, v=v_new, rotary_cos=None if rot is None else rot[0],
        rotary_sin=None if rot is None else rot[1], cache_seqlens=seqlens, cache_leftpad=pad,
        block_table=cache.block_table, causal=causal, rotary_interleaved=rotary == "interleaved",
        return_softmax_lse=True)
    check(out, lse, ref, ref_lse, low)
    # The new values landed in the cache at cache_seqlens (keys rotated).
    b = 1
    if layout == "contiguous":
        assert torch.equal(cache.v[b, 200 : 200 + new], v_new[b])


@pytest.mark.parametrize("feature", ["window", "softcap", "alibi", "causal_window"])
@pytest.mark.parametrize("seqlen_q", [1, 4])
def test_decode_features(feature, seqlen_q, in_place_only):
    dtype, dim, heads, batch, capacity = torch.float16, 128, (8, 2), 3, 1024
    cache = Cache(batch, capacity, heads[1], dim, dtype, "paged", 64)
    seqlens = torch.tensor([1000, 64, 513], dtype=torch.int32, device="cuda")
    q = torch.randn(batch, seqlen_q, heads[0], dim, device="cuda", dtype=dtype)
    options = dict(window=(-1, -1), softcap=0.0, alibi=None, causal=False)
    if feature == "window":
        options["window"] = (100, 3)
    elif feature == "causal_window":
        options.update(causal=True, window=(257, 0))
    elif feature == "softcap":
        options["softcap"] = 5.0
    else:
        options["alibi"] = torch.rand(heads[0], device="cuda", dtype=torch.float32)
    ref, ref_lse = expected(q, cache, seqlens, None, None, None, **options)
    low, _ = expected(q, cache, seqlens, None, None, None, compute_dtype=dtype, **options)
    poison_allocator(64 << 20)
    out, lse = portattn.flash_attn_with_kvcache(
        q, cache.k, cache.v, cache_seqlens=seqlens, block_table=cache.block_table,
        causal=options["causal"], window_size=options["window"], softcap=options["softcap"],
        alibi_slopes=options["alibi"], num_splits=3, return_softmax_lse=True)
    check(out, lse, ref, ref_lse, low)


@pytest.mark.parametrize("seqlen_q", [1, 3, 16])
@pytest.mark.parametrize("heads", [(32, 8), (16, 16)], ids=lambda h: f"{h[0]}x{h[1]}")
@pytest.mark.parametrize("causal", [False, True])
def test_short_query_dense_runs_on_decode_kernels(seqlen_q, heads, causal, monkeypatch):
    dtype, dim, seqlen_k = torch.bfloat16, 128, 4096
    q = torch.randn(2, seqlen_q, heads[0], dim, device="cuda", dtype=dtype)
    k = torch.randn(2, seqlen_k, heads[1], dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    calls = []
    real = type(BACKEND).decode

    def counting(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(BACKEND), "decode", counting)
    rows = seqlen_q * heads[0] // heads[1]
    poison_allocator(64 << 20)
    out, lse, _ = portattn.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert bool(calls) == (rows <= 64), "dispatch did not follow decode.prefers_decode"
    ref, ref_lse = naive_attention(q, k, v, causal=causal)
    low, _ = naive_attention(q, k, v, causal=causal, compute_dtype=dtype)
    check(out, lse, ref, ref_lse, low)


@pytest.mark.parametrize("paged", [False, True])
def test_short_query_varlen(paged):
    dtype, dim, heads = torch.bfloat16, 64, (8, 2)
    lengths_q, lengths_k = [1, 2, 0, 1], [700, 1, 0, 2000]
    cu_q = torch.tensor([0, 1, 3, 3, 4], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 700, 701, 701, 2701], dtype=torch.int32, device="cuda")
    q = torch.randn(4, heads[0], dim, device="cuda", dtype=dtype)
    k = torch.randn(2701, heads[1], dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    ref, ref_lse = naive_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    low, _ = naive_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, compute_dtype=dtype)
    if paged:
        page, width = 16, 2048 // 16 + 1
        k_cache = torch.full((4 * width + 3, page, heads[1], dim), float("nan"), device="cuda", dtype=dtype)
        v_cache = torch.full_like(k_cache, float("nan"))
        table = torch.randperm(4 * width, device="cuda").reshape(4, width).to(torch.int32)
        for b in range(4):
            n = lengths_k[b]
            rows = (table[b].long()[:, None] * page + torch.arange(page, device="cuda")).flatten()[:n]
            k_cache.view(-1, heads[1], dim)[rows] = k[cu_k[b] : cu_k[b] + n]
            v_cache.view(-1, heads[1], dim)[rows] = v[cu_k[b] : cu_k[b] + n]
        out, lse, _ = portattn.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 2, 2000,
                                                      return_attn_probs=True, block_table=table)
    else:
        out, lse, _ = portattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 2, 2000, return_attn_probs=True)
    check(out, lse, ref, ref_lse, low)


def test_cuda_graph_decode_steps_replay_with_changing_lengths():
    """One captured step (append with rotary + paged decode), replayed with new tokens,
    lengths and block tables written in place between replays."""
    dtype, dim, heads, batch, capacity, page = torch.bfloat16, 128, (8, 2), 3, 1024, 16
    cache = Cache(batch, capacity, heads[1], dim, dtype, "paged", page)
    angles = torch.rand(capacity, 32, device="cuda") * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q = torch.randn(batch, 1, heads[0], dim, device="cuda", dtype=dtype)
    k_new = torch.randn(batch, 1, heads[1], dim, device="cuda", dtype=dtype)
    v_new = torch.randn_like(k_new)
    seqlens = torch.tensor([5, 300, 0], dtype=torch.int32, device="cuda")

    def step():
        return portattn.flash_attn_with_kvcache(
            q, cache.k, cache.v, k=k_new, v=v_new, rotary_cos=cos, rotary_sin=sin,
            cache_seqlens=seqlens, block_table=cache.block_table, causal=True)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside the graph (dispatch decisions, smem opt-in)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for lengths in ([6, 301, 1], [100, 1000, 17], [0, 0, 1023]):
        # The logical cache before this step: the oracle sees it without the new token.
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        k_new.copy_(torch.randn_like(k_new))
        v_new.copy_(torch.randn_like(v_new))
        perm = torch.randperm(cache.block_table.shape[0] * cache.block_table.shape[1] + 5, device="cuda")
        # Re-home the pages: move data so the logical cache is unchanged under the new table.
        new_table = perm[: cache.block_table.numel()].reshape(cache.block_table.shape).to(torch.int32)
        old_rows = (cache.block_table.long()[:, :, None] * page + torch.arange(page, device="cuda")).flatten()
        new_rows = (new_table.long()[:, :, None] * page + torch.arange(page, device="cuda")).flatten()
        flat_k, flat_v = cache.k.view(-1, heads[1], dim), cache.v.view(-1, heads[1], dim)
        moved_k, moved_v = flat_k[old_rows].clone(), flat_v[old_rows].clone()
        flat_k[new_rows] = moved_k
        flat_v[new_rows] = moved_v
        cache.block_table.copy_(new_table)
        cache.logical_k = moved_k.view_as(cache.logical_k)
        cache.logical_v = moved_v.view_as(cache.logical_v)
        ref, _ = expected(q, cache, seqlens, None, k_new, v_new, causal=True, rotary=(cos, sin))
        low, _ = expected(q, cache, seqlens, None, k_new, v_new, causal=True, rotary=(cos, sin), compute_dtype=dtype)
        graph.replay()
        torch.cuda.synchronize()
        check(out, None, ref, None, low)


@pytest.mark.parametrize("bad", ["seqlens_past_capacity", "negative_seqlens", "pages_out_of_range",
                                 "batch_idx_out_of_range", "leftpad_past_end"])
def test_adversarial_values_stay_in_bounds(bad):
    """Whatever the per-sequence tensors hold, the kernels read and write only inside the tensors
    (compute-sanitizer memcheck runs this test too) and return finite values."""
    dtype, dim, heads, batch, capacity = torch.bfloat16, 64, (4, 2), 2, 256
    layout = "batch_idx" if bad == "batch_idx_out_of_range" else ("paged" if bad == "pages_out_of_range" else "contiguous")
    cache = Cache(batch, capacity, heads[1], dim, dtype, layout, 16)
    seqlens = torch.tensor([100, 200], dtype=torch.int32, device="cuda")
    pad = None
    if bad == "seqlens_past_capacity":
        seqlens = torch.tensor([capacity + 1000, 2**30], dtype=torch.int32, device="cuda")
    elif bad == "negative_seqlens":
        seqlens = torch.tensor([-5, -(2**30)], dtype=torch.int32, device="cuda")
    elif bad == "pages_out_of_range":
        cache.block_table[0, 0] = 10**6
        cache.block_table[1, 1] = -7
    elif bad == "batch_idx_out_of_range":
        cache.batch_idx = torch.tensor([-3, 10**6], dtype=torch.int32, device="cuda")
    else:
        pad = torch.tensor([5000, -4], dtype=torch.int32, device="cuda")
    q = torch.randn(batch, 1, heads[0], dim, device="cuda", dtype=dtype)
    k_new = torch.randn(batch, 1, heads[1], dim, device="cuda", dtype=dtype)
    out = portattn.flash_attn_with_kvcache(
        q, cache.k, cache.v, k=k_new, v=torch.randn_like(k_new), cache_seqlens=seqlens, cache_leftpad=pad,
        cache_batch_idx=cache.batch_idx, block_table=cache.block_table, num_splits=2)
    torch.cuda.synchronize()
    assert out.shape == q.shape
    # Contained, not clamped (Note [portattn decode errors]): finite (zero rows) and recorded.
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match="out of range"):
        portattn.check_errors()
