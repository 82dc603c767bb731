"""Issue 39 on the GPU: out-of-range cache metadata read on the device is contained, not clamped
into another sequence's rows (Note [portattn decode errors] in backends/common/params.h).

For each bad value: the bad sequence's output rows are 0 and its LSE -inf, nothing is appended
for it, no cache element outside the good sequences' appended rows changes, the good sequences
match the float64 oracle (tests/error_rule.py), and portattn.check_errors() raises a ValueError
naming the argument and the batch entry (then is clear). Runs on the decode kernels (bf16) and
on the reference backend's GPU path (float32 falls back there). compute-sanitizer memcheck runs
the same cases (tests/gpu/sanitize_cuda.py, containment_cases).
"""
from __future__ import annotations

import warnings

import pytest
import torch

from error_rule import assert_output
from naive import naive_attention

pytestmark = pytest.mark.gpu

from cuda_gpu_setup import cuda_backend  # noqa: E402  (skips without a GPU)

import portattn  # noqa: E402

if not hasattr(cuda_backend._C, "decode"):
    pytest.skip("this CUDA build has no decode kernels", allow_module_level=True)

# name -> (layout, argument, batch entry, mutation of the metadata dict)
CASES = {
    "seqlens_negative": ("contiguous", "cache_seqlens", 1, lambda m: m["cache_seqlens"].__setitem__(1, -1)),
    "seqlens_past_capacity": ("contiguous", "cache_seqlens", 0, lambda m: m["cache_seqlens"].__setitem__(0, 2**31 - 1)),
    "leftpad_negative": ("contiguous", "cache_leftpad", 1, lambda m: m["cache_leftpad"].__setitem__(1, -2)),
    "leftpad_past_end": ("contiguous", "cache_leftpad", 2, lambda m: m["cache_leftpad"].__setitem__(2, 10**6)),
    "batch_idx_negative": ("batch_idx", "cache_batch_idx", 1, lambda m: m["cache_batch_idx"].__setitem__(1, -1)),
    "batch_idx_past_end": ("batch_idx", "cache_batch_idx", 1, lambda m: m["cache_batch_idx"].__setitem__(1, 5)),
    "page_negative": ("paged", "block_table", 1, lambda m: m["block_table"].__setitem__((1, 1), -1)),
    "page_past_pool": ("paged", "block_table", 2, lambda m: m["block_table"].__setitem__((2, 0), 10**6)),
}
BATCH, HEADS, HEADS_K, DIM, CAPACITY, PAGE = 3, 4, 2, 64, 64, 16


def containment_cases():
    return list(CASES)


def make_case(name, dtype):
    layout, argument, bad_b, mutate = CASES[name]
    device = "cuda"
    meta = {"cache_seqlens": torch.tensor([5, 20, 40], dtype=torch.int32, device=device),
            "cache_leftpad": torch.tensor([0, 3, 1], dtype=torch.int32, device=device)}
    if layout == "paged":
        per = CAPACITY // PAGE
        pages = BATCH * per + 2
        k_cache = torch.randn(pages, PAGE, HEADS_K, DIM, device=device, dtype=dtype)
        meta["block_table"] = torch.randperm(pages, device=device)[: BATCH * per].reshape(BATCH, per).to(torch.int32)
    elif layout == "batch_idx":
        k_cache = torch.randn(BATCH, CAPACITY, HEADS_K, DIM, device=device, dtype=dtype)
        meta["cache_batch_idx"] = torch.tensor([2, 0, 1], dtype=torch.int32, device=device)
    else:
        k_cache = torch.randn(BATCH, CAPACITY, HEADS_K, DIM, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    good_meta = {key: value.clone() for key, value in meta.items()}
    mutate(meta)
    return layout, argument, bad_b, meta, good_meta, k_cache, v_cache


def rows_of(layout, meta, k_cache, b, positions):
    """(entry or page, row) index tensors of sequence b's cache positions."""
    positions = torch.as_tensor(positions, device="cuda")
    if layout == "paged":
        return meta["block_table"][b].long()[positions // PAGE], positions % PAGE
    entry = b if layout != "batch_idx" else int(meta["cache_batch_idx"][b])
    return torch.full_like(positions, entry), positions


def run_case(name, dtype, splits=2, oracle=True):
    """Runs one case; returns a list of failure strings (empty: contained as documented).

    oracle=False skips the comparison of the good sequences with the naive attention: under
    compute-sanitizer initcheck, the bf16 oracle's matmul (cuBLAS kernels the tool does not
    instrument) reads as uninitialised memory to the elementwise op after it."""
    layout, argument, bad_b, meta, good_meta, k_cache, v_cache = make_case(name, dtype)
    try:  # start clean: drop what earlier calls of this process recorded
        portattn.check_errors()
    except ValueError:
        pass
    q = torch.randn(BATCH, 1, HEADS, DIM, device="cuda", dtype=dtype)
    k_new = torch.randn(BATCH, 1, HEADS_K, DIM, device="cuda", dtype=dtype)
    v_new = torch.randn_like(k_new)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    out, lse = portattn.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, num_splits=splits,
                                                return_softmax_lse=True, **meta)
    torch.cuda.synchronize()
    failures = []
    if not (out[bad_b] == 0).all() or not torch.isinf(lse[bad_b]).all():
        failures.append(f"{name}: the contained sequence's rows are not 0 / -inf")
    # Exactly the good sequences' appended rows changed.
    expected_k, expected_v = before_k.clone(), before_v.clone()
    for b in range(BATCH):
        if b == bad_b:
            continue
        n = int(good_meta["cache_seqlens"][b])
        index = rows_of(layout, good_meta, k_cache, b, [n])
        expected_k[index] = k_new[b]
        expected_v[index] = v_new[b]
    # The bad sequence may have appended into its own row when that row's own metadata is
    # valid (docs/decode.md); anything else changed is a write outside its rows.
    own = None
    n_bad = int(good_meta["cache_seqlens"][bad_b])
    if argument in ("cache_leftpad", "block_table") and 0 <= n_bad < CAPACITY:
        index = rows_of(layout, meta if argument == "cache_leftpad" else good_meta, k_cache, bad_b, [n_bad])
        if argument == "cache_leftpad" or int(meta["block_table"][bad_b, n_bad // PAGE]) == int(
                good_meta["block_table"][bad_b, n_bad // PAGE]):
            own = index
    allowed = [(expected_k, expected_v)]
    if own is not None:
        with_own_k, with_own_v = expected_k.clone(), expected_v.clone()
        with_own_k[own] = k_new[bad_b]
        with_own_v[own] = v_new[bad_b]
        allowed.append((with_own_k, with_own_v))
    if not any(torch.equal(k_cache, ek) and torch.equal(v_cache, ev) for ek, ev in allowed):
        failures.append(f"{name}: cache elements other than the good sequences' appended rows changed")
    for b in range(BATCH if oracle else 0):
        if b == bad_b:
            continue
        n, start = int(good_meta["cache_seqlens"][b]) + 1, int(good_meta["cache_leftpad"][b])
        index = rows_of(layout, good_meta, k_cache, b, torch.arange(start, n))
        keys, values = k_cache[index][None], v_cache[index][None]
        ref, _ = naive_attention(q[b : b + 1], keys, values, compute_dtype=torch.float64)
        low, _ = naive_attention(q[b : b + 1], keys, values, compute_dtype=dtype)
        try:
            assert_output(out[b : b + 1], ref, low)
        except AssertionError as error:
            failures.append(f"{name}: sequence {b}: {error}")
    try:
        portattn.check_errors()
        failures.append(f"{name}: check_errors() did not raise")
    except ValueError as error:
        if f"{argument}[{bad_b}]" not in str(error):
            failures.append(f"{name}: check_errors() named the wrong entry: {error}")
    portattn.check_errors()  # cleared: must not raise again
    return failures


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["decode_kernels", "reference"])
@pytest.mark.parametrize("name", containment_cases())
def test_out_of_range_metadata_is_contained(name, dtype, splits):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # float32: the reference backend's fallback notice
        failures = run_case(name, dtype, splits)
    assert not failures, failures


def test_contained_decode_is_capturable():
    """The containment needs no host read: a captured step with a bad page replays contained."""
    layout, argument, bad_b, meta, good_meta, k_cache, v_cache = make_case("page_negative", torch.bfloat16)
    q = torch.randn(BATCH, 1, HEADS, DIM, device="cuda", dtype=torch.bfloat16)

    def step():
        return portattn.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=2, **meta)

    step()  # warm-up outside the capture (allocates the error buffer)
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=rf"block_table\[{bad_b}\]"):
        portattn.check_errors()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    assert (out[bad_b] == 0).all()
    with pytest.raises(ValueError, match=rf"block_table\[{bad_b}\]"):
        portattn.check_errors()
