"""The transformers integration's heads-first decode step reaches the kernels exactly as the
transposing route did.

attention_forward hands transformers' (batch, heads, seq, dim) q, k and v to portattn without
transposing them (`heads_first`, docs/host-overhead.md): validation, dispatch, the split planner and
abi.decode_args read their sizes and strides in (batch, seq, heads, dim) order. These tests run the
GPU path over bench/tools/host_decode.py's stand-in module (the compiled entry points record their
argument tuples) and compare, for a grid of decode-step shapes and cache layouts, what the new route
passes to the stand-in with what the route it replaced passes: the public flash_attn_func /
flash_attn_with_kvcache called with the `.transpose(1, 2)` views, as the integration called them
before. Every field must be equal -- pointers, shapes, strides, scalars -- except the output's
address (each call allocates its own); the returned tensors must agree in shape, strides, storage
offset, dtype and device, and each must be the memory its call's kernel was told to write.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "tools"))
import host_decode  # noqa: E402

pytest.importorskip("transformers")

HEADER = os.path.join(host_decode.ROOT, "portattn", "backends", "common", "binding_args.h")
KEYS = (1, 2, 7, 64, 511, 512, 513, 1023, 1024, 1025, 2047, 2048, 2049)
HEADS = ((16, 4), (8, 8), (32, 8))


@pytest.fixture
def recorded(monkeypatch):
    """The GPU path's Python over the stand-in module; every entry point's argument tuples, by call."""
    host_decode.base.load()
    counts: dict = {}
    host_decode.install(counts, patch=monkeypatch.setattr)
    module = host_decode.base._STANDIN[-1]
    calls = []
    names = {"decode": host_decode._macro_names(HEADER, "PORTATTN_DECODE_ARG_NAMES")}
    for entry in ("fwd", "hopper_fwd"):
        names[entry] = host_decode.base.abi.FwdArgs._fields
    for entry, fields in names.items():
        original = getattr(module, entry)

        def record(*args, entry=entry, fields=fields, original=original):
            assert len(args) == len(fields), (entry, len(args), len(fields))
            calls.append((entry, dict(zip(fields, args))))
            original(*args)

        monkeypatch.setattr(module, entry, record)
    return calls


class _Module(torch.nn.Module):
    def __init__(self, heads, kv_heads):
        super().__init__()
        self.is_causal = True
        self.num_key_value_groups = heads // kv_heads
        self.layer_idx = 0


def _cache(batch, kv_heads, keys, dim, dtype, layout):
    """k or v as transformers hands it over: (batch, kv_heads, keys, dim)."""
    if layout == "cat":  # a DynamicCache layer: torch.cat results, contiguous
        return torch.empty(batch, kv_heads, keys, dim, dtype=dtype)
    if layout == "static":  # a StaticCache buffer cut to its written keys: capacity padding per head
        return torch.empty(batch, kv_heads, keys + 37, dim, dtype=dtype)[:, :, :keys]
    if layout == "tail":  # the last keys of a longer buffer (a sliding layer): an offset view
        return torch.empty(batch + 1, kv_heads, keys + 5, dim, dtype=dtype)[1:, :, 5:]
    raise ValueError(layout)


def _query(batch, heads, seqlen, dim, dtype, layout):
    """q as transformers hands it over: (batch, heads, seqlen, dim)."""
    if layout == "proj":  # q_proj(x).view(b, s, h, d).transpose(1, 2)
        return torch.empty(batch, seqlen, heads, dim, dtype=dtype).transpose(1, 2)
    if layout == "fused":  # a slice of a fused qkv projection: neither it nor its transpose is dense
        return torch.empty(batch, seqlen, 3, heads, dim, dtype=dtype)[:, :, 0].transpose(1, 2)
    if layout == "contiguous":
        return torch.empty(batch, heads, seqlen, dim, dtype=dtype)
    raise ValueError(layout)


def _normalised(call):
    """A recorded call with the output's address replaced by a marker and the split workspace's
    addresses by their offset (each call allocates its own of both)."""
    entry, fields = call
    fields = dict(fields)
    fields["out"] = "<out>"
    if entry == "decode" and fields["o_partial"]:
        fields["lse_partial"] -= fields["o_partial"]
        fields["o_partial"] = "<workspace>"
    return entry, fields


def _layout(t):
    return tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device


def _compare(calls, new, old, expect_entry=None):
    (new_call, old_call), (new_out, old_out) = calls, (new, old)
    assert _normalised(new_call) == _normalised(old_call)
    if expect_entry is not None:
        assert new_call[0] == expect_entry
    assert _layout(new_out) == _layout(old_out)
    for call, out in ((new_call, new_out), (old_call, old_out)):
        # The kernel writes out[b, s, h, :] at out + b*s0 + s*s1 + h*s2: exactly the returned tensor.
        assert call[1]["out"] == out.data_ptr()
        assert tuple(call[1]["out_strides"]) == out.stride()


def _run(recorded, call):
    before = len(recorded)
    out = call()
    assert len(recorded) == before + 1, recorded[before:]
    return out, recorded[-1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cache_layout", ["cat", "static", "tail"])
@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "left_padded"])
def test_heads_first_route_passes_what_the_transposing_route_passed(recorded, dtype, cache_layout, masked):
    import portattn
    from portattn.integrations import transformers as pt_hf

    seen_entries = set()
    with torch.no_grad():
        for batch in (1, 3, 8):
            for heads, kv_heads in HEADS:
                for dim in (64, 128):
                    for keys in KEYS:
                        module = _Module(heads, kv_heads)
                        q = _query(batch, heads, 1, dim, dtype, "proj")
                        k = _cache(batch, kv_heads, keys, dim, dtype, cache_layout)
                        v = _cache(batch, kv_heads, keys, dim, dtype, cache_layout)
                        scale = dim ** -0.5
                        position_ids = torch.full((batch, 1), keys - 1, dtype=torch.long)
                        mask = None
                        if masked and keys > 1:  # (the one key of a 1-key cache is the new token's)
                            user = torch.ones(batch, keys, dtype=torch.long)
                            user[0, : max(1, (keys - 1) // 2)] = 0  # left padding (odd counts included)
                            mask = pt_hf.padding_mask(batch, 1, keys, keys - 1, 0, attention_mask=user)
                            assert mask is not None and mask.dtype == pt_hf.KEY_BOUNDS_DTYPE

                        def new():
                            out, weights = pt_hf.attention_forward(module, q, k, v, mask, dropout=0.0, scaling=scale,
                                                                   position_ids=position_ids, use_cache=True)
                            assert weights is None
                            return out

                        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
                        if mask is not None and mask.dtype == pt_hf.KEY_BOUNDS_DTYPE:
                            start, end = pt_hf._key_bounds(mask, batch)

                            def old():
                                return portattn.flash_attn_with_kvcache(qt, kt, vt, None, None, None, None, end, None,
                                                                        start, None, scale, True, (-1, -1), 0.0)
                        else:
                            def old():
                                return portattn.flash_attn_func(qt, kt, vt, 0.0, scale, True, (-1, -1), 0.0, None,
                                                                False)

                        new_out, new_call = _run(recorded, new)
                        old_out, old_call = _run(recorded, old)
                        _compare((new_call, old_call), new_out, old_out)
                        seen_entries.add(new_call[0])
    # Both the decode kernels and, for few keys without a mask, the forward kernels were reached.
    assert "decode" in seen_entries
    assert masked or seen_entries > {"decode"}, seen_entries


@pytest.mark.parametrize("q_layout", ["proj", "fused", "contiguous"])
@pytest.mark.parametrize("seqlen_q", [1, 4, 16])
def test_query_layouts_and_speculative_chunks(recorded, q_layout, seqlen_q):
    """Queries whose transpose is dense (one allocation, no view) and ones whose is not (the
    output then comes from empty_like of the transpose, as before), one to 16 query rows: with key
    bounds (the cache read in place) and without a mask (decode-shaped dense calls)."""
    import portattn
    from portattn.integrations import transformers as pt_hf

    dtype, keys = torch.bfloat16, 1536
    with torch.no_grad():
        for batch, (heads, kv_heads), dim in ((1, (16, 4), 128), (3, (8, 8), 64), (8, (32, 8), 128)):
            module = _Module(heads, kv_heads)
            q = _query(batch, heads, seqlen_q, dim, dtype, q_layout)
            k = _cache(batch, kv_heads, keys, dim, dtype, "static")
            v = _cache(batch, kv_heads, keys, dim, dtype, "static")
            qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            user = torch.ones(batch, keys, dtype=torch.long)
            user[-1, :3] = 0
            mask = pt_hf.padding_mask(batch, seqlen_q, keys, keys - seqlen_q, 0, attention_mask=user)
            assert mask.dtype == pt_hf.KEY_BOUNDS_DTYPE
            start, end = pt_hf._key_bounds(mask, batch)
            cases = [(mask, lambda: portattn.flash_attn_with_kvcache(qt, kt, vt, None, None, None, None, end, None,
                                                                     start, None, 0.1, True, (-1, -1), 0.0))]
            if seqlen_q * heads // kv_heads <= 64:  # decode-shaped without a mask too
                cases.append((None, lambda: portattn.flash_attn_func(qt, kt, vt, 0.0, 0.1, True, (-1, -1), 0.0,
                                                                     None, False)))
            for attention_mask, old in cases:
                position_ids = torch.arange(keys - seqlen_q, keys).expand(batch, -1)
                new_out, new_call = _run(recorded, lambda: pt_hf.attention_forward(
                    module, q, k, v, attention_mask, dropout=0.0, scaling=0.1, position_ids=position_ids)[0])
                old_out, old_call = _run(recorded, old)
                _compare((new_call, old_call), new_out, old_out, "decode")


def test_the_comparison_sees_a_wrong_stride(recorded, monkeypatch):
    """The test above fails if the heads-first route passed the heads-first strides unswapped."""
    from portattn.backends import abi
    from portattn.integrations import transformers as pt_hf

    import portattn

    monkeypatch.setattr(abi, "seq_first", lambda sizes: tuple(sizes))
    q = _query(2, 16, 1, 128, torch.bfloat16, "proj")
    k = v = _cache(2, 4, 1024, 128, torch.bfloat16, "cat")
    with torch.no_grad():
        new_out, new_call = _run(recorded, lambda: pt_hf.attention_forward(_Module(16, 4), q, k, v, None,
                                                                           scaling=0.1)[0])
        old_out, old_call = _run(recorded, lambda: portattn.flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, 0.1, True))
    with pytest.raises(AssertionError):
        _compare((new_call, old_call), new_out, old_out)


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "left_padded"])
def test_values_match_the_transposing_route_on_the_reference_backend(masked):
    """No stand-in: on the CPU the reference backend serves both routes (the heads-first one makes
    the views where it leaves the decode route); the outputs are equal element for element and
    stride for stride."""
    import portattn
    from portattn.integrations import transformers as pt_hf

    g = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, dim, keys = 3, 8, 2, 64, 600
    for dtype in (torch.bfloat16, torch.float16):
        q = torch.randn(batch, 1, heads, dim, generator=g).to(dtype).transpose(1, 2)
        k = torch.randn(batch, kv_heads, keys + 9, dim, generator=g).to(dtype)[:, :, :keys]
        v = torch.randn(batch, kv_heads, keys + 9, dim, generator=g).to(dtype)[:, :, :keys]
        mask = None
        if masked:
            user = torch.ones(batch, keys, dtype=torch.long)
            user[1, :11] = 0
            mask = pt_hf.padding_mask(batch, 1, keys, keys - 1, 0, attention_mask=user)
        with torch.no_grad():
            new = pt_hf.attention_forward(_Module(heads, kv_heads), q, k, v, mask, scaling=0.125)[0]
            qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if masked:
                start, end = pt_hf._key_bounds(mask, batch)
                old = portattn.flash_attn_with_kvcache(qt, kt, vt, cache_seqlens=end, cache_leftpad=start,
                                                       softmax_scale=0.125, causal=True)
            else:
                old = portattn.flash_attn_func(qt, kt, vt, softmax_scale=0.125, causal=True)
        assert _layout(new) == _layout(old)
        assert torch.equal(new, old)


_BAD = {  # name: (q, k, v) in transformers' layout, each reaching the heads-first route's checks
    "k_v_shapes": ((2, 8, 1, 64), (2, 2, 700, 64), (2, 2, 699, 64)),
    "heads_not_a_multiple": ((2, 6, 1, 64), (2, 4, 700, 64), (2, 4, 700, 64)),
    "key_head_dim": ((2, 8, 1, 64), (2, 2, 700, 32), (2, 2, 700, 64)),
    "batch": ((2, 8, 1, 64), (3, 2, 700, 64), (3, 2, 700, 64)),  # (a kvcache call may use part of a cache)
    "head_dim_too_large": ((2, 8, 1, 320), (2, 2, 700, 320), (2, 2, 700, 320)),
    "dtype": ((2, 8, 1, 64), (2, 2, 700, 64), (2, 2, 700, 64)),
}


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "left_padded"])
@pytest.mark.parametrize("case", sorted(_BAD))
def test_bad_input_raises_what_the_transposing_route_raised(case, masked):
    """The heads-first route's checks read the sizes in flash-attn's order: the same exception type
    and message as the public function given the transposed views."""
    import portattn
    from portattn.integrations import transformers as pt_hf

    q_shape, k_shape, v_shape = _BAD[case]
    q = torch.zeros(q_shape, dtype=torch.bfloat16)
    k = torch.zeros(k_shape, dtype=torch.float16 if case == "dtype" else torch.bfloat16)
    v = torch.zeros(v_shape, dtype=torch.bfloat16)
    batch, keys = q_shape[0], k_shape[2]
    mask = None
    if masked:
        user = torch.ones(batch, keys, dtype=torch.long)
        user[0, :5] = 0
        mask = pt_hf.padding_mask(batch, 1, keys, keys - 1, 0, attention_mask=user)
        assert mask.dtype == pt_hf.KEY_BOUNDS_DTYPE
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def old():
        if masked:
            start, end = pt_hf._key_bounds(mask, batch)
            return portattn.flash_attn_with_kvcache(qt, kt, vt, None, None, None, None, end, None, start, None,
                                                    0.125, True, (-1, -1), 0.0)
        return portattn.flash_attn_func(qt, kt, vt, 0.0, 0.125, True, (-1, -1), 0.0, None, False)

    with torch.no_grad():
        new_outcome = _outcome(lambda: pt_hf.attention_forward(_Module(q_shape[1], k_shape[1]), q, k, v, mask,
                                                               scaling=0.125)[0])
        old_outcome = _outcome(old)
    assert new_outcome == old_outcome
    # (a cache holding more sequences than the batch is no error for flash_attn_with_kvcache)
    assert new_outcome[0] in (TypeError, ValueError) or (case, masked) == ("batch", True), new_outcome


def _outcome(call):
    try:
        out = call()
    except Exception as error:  # noqa: BLE001 - the exception is what is compared
        return type(error), str(error)
    return _layout(out)


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "key_bounds"])
def test_a_traced_decode_step_takes_the_seq_first_views(masked):
    """Under torch.compile(fullgraph=True) transformers' attention call traces (the heads-first route
    reads shapes through an operator.itemgetter, which dynamo refuses: a Gemma 2 static-cache step
    broke on it) and gives the eager call's output."""
    import portattn.integrations.transformers as pt_hf

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.is_causal = True
    q = torch.randn(2, 8, 1, 64, dtype=torch.bfloat16)
    k, v = torch.randn(2, 2, 16, 64, dtype=torch.bfloat16), torch.randn(2, 2, 16, 64, dtype=torch.bfloat16)
    mask = pt_hf.key_bounds(2, 1, 16, 12, 0, torch.tensor([[0] * 4 + [1] * 12, [1] * 16]), "cpu") if masked else None

    def step(q, k, v):
        return pt_hf.attention_forward(module, q, k, v, mask, scaling=0.125, sliding_window=8, softcap=30.0)[0]

    want = step(q, k, v)
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, backend="eager")(q, k, v)
    assert got.shape == (2, 1, 8, 64)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
