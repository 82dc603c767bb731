"""portattn.merge_attention_states on the CPU (its torch path): against ring-flash-attn's own
update_out_and_lse (bit for bit: same fp32 operations), against a float64 oracle of
attention over the union of the keys, empty (infinite-LSE) rows, and argument errors.
The GPU kernels' counterpart is tests/gpu/test_cuda_merge.py."""
import importlib.util
import math

import pytest
import torch

import portattn
from naive import naive_attention
from portattn.merge import merge_attention_states_reference

HAS_RING = importlib.util.find_spec("ring_flash_attn") is not None


def _ring_update():
    from portattn.compat import import_ring_flash_attn

    import_ring_flash_attn(merge="ring")
    from ring_flash_attn.utils import update_out_and_lse

    return update_out_and_lse


def _partials(generator, batch, seqlen, heads, dim, varlen, dtype=torch.bfloat16):
    """(block_out, block_lse) as flash-attn returns them: out (B, S, H, D) / (T, H, D) in
    `dtype`, lse (B, H, S) / (H, T) float32 around the values attention produces."""
    shape = (batch * seqlen, heads, dim) if varlen else (batch, seqlen, heads, dim)
    out = torch.randn(shape, generator=generator).to(dtype)
    lse_shape = (heads, batch * seqlen) if varlen else (batch, heads, seqlen)
    lse = 3 * torch.randn(lse_shape, generator=generator) + 8
    return out, lse


@pytest.mark.skipif(not HAS_RING, reason="ring-flash-attn is not installed (pip install -e '.[test]')")
@pytest.mark.parametrize("varlen", [False, True])
def test_equals_ring_flash_attn_update_out_and_lse_bit_for_bit(varlen):
    ring_update = _ring_update()
    generator = torch.Generator().manual_seed(torch.seed() % 2**31)
    batch, seqlen, heads, dim = (1, 40, 3, 64) if varlen else (2, 24, 4, 128)
    steps = [_partials(generator, batch, seqlen, heads, dim, varlen) for _ in range(4)]
    ring_out, ring_lse = ring_update(None, None, *steps[0])
    ours_out, ours_lse = ring_update(None, None, *steps[0])  # ring's own first step: the accumulator
    ours_out, ours_lse = ours_out.clone(), ours_lse.clone()
    for block_out, block_lse in steps[1:]:
        ring_out, ring_lse = ring_update(ring_out, ring_lse, block_out, block_lse)
        returned = portattn.merge_attention_states(ours_out, ours_lse, block_out, block_lse)
        assert returned[0] is ours_out and returned[1] is ours_lse  # in place
        assert torch.equal(ours_out, ring_out) and torch.equal(ours_lse, ring_lse)
    # zigzag's sliced step: the second half of the tokens merges a half-length block.
    half = seqlen // 2
    block_out, block_lse = _partials(generator, batch, half, heads, dim, varlen)
    slice_ = (slice(half, None),) if varlen else (slice(None), slice(half, None))
    ring_out, ring_lse = ring_update(ring_out, ring_lse, block_out, block_lse, slice_=slice_)
    portattn.merge_attention_states(ours_out[slice_], ours_lse[slice_], block_out, block_lse)
    assert torch.equal(ours_out, ring_out) and torch.equal(ours_lse, ring_lse)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("varlen", [False, True])
def test_merged_partials_are_attention_over_all_keys(varlen, out_dtype):
    """Attention over keys split three ways, merged, equals attention over all of them."""
    generator = torch.Generator().manual_seed(torch.seed() % 2**31)
    seqlen_q, seqlen_k, heads, dim = 19, 53, 3, 32
    q = torch.randn(1, seqlen_q, heads, dim, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(1, seqlen_k, heads, dim, generator=generator, dtype=torch.float64) for _ in range(2))
    full_out, full_lse = naive_attention(q, k, v, causal=False, compute_dtype=torch.float64)
    cuts = [0, 11, 30, seqlen_k]
    out = lse = None
    for start, end in zip(cuts, cuts[1:]):
        part_out, part_lse = naive_attention(q, k[:, start:end], v[:, start:end], causal=False,
                                             compute_dtype=torch.float64)
        part_out, part_lse = part_out.float(), part_lse.float().reshape(1, heads, seqlen_q)
        if varlen:
            part_out, part_lse = part_out[0], part_lse[0]
        if out is None:
            out, lse = part_out.to(out_dtype), part_lse.clone()
        else:
            portattn.merge_attention_states(out, lse, part_out, part_lse)
    expected_out = full_out.reshape(out.shape).float()
    expected_lse = full_lse.reshape(lse.shape).float()
    tolerance = 1e-5 if out_dtype == torch.float32 else 2e-2  # bf16 accumulator: its rounding per merge
    assert (out.float() - expected_out).abs().max() < tolerance
    assert (lse - expected_lse).abs().max() < 1e-5 * expected_lse.abs().max()


@pytest.mark.parametrize("merge", [portattn.merge_attention_states, merge_attention_states_reference])
def test_empty_rows_contribute_nothing_and_give_no_nan(merge):
    generator = torch.Generator().manual_seed(torch.seed() % 2**31)
    out = torch.randn(1, 4, 2, 16, generator=generator)
    block_out = torch.randn(1, 4, 2, 16, generator=generator).to(torch.bfloat16)
    lse = torch.randn(1, 2, 4, generator=generator)
    block_lse = torch.randn(1, 2, 4, generator=generator)
    inf = math.inf
    # token 0: block empty; 1: accumulator empty; 2: both empty; 3: flash-attn 2's +inf block.
    lse[0, :, 1] = -inf
    lse[0, :, 2] = -inf
    block_lse[0, :, 0] = -inf
    block_lse[0, :, 2] = -inf
    block_lse[0, :, 3] = inf
    before_out, before_lse = out.clone(), lse.clone()
    merge(out, lse, block_out, block_lse)
    assert not out.isnan().any() and not lse.isnan().any()
    for token in (0, 2, 3):
        assert torch.equal(out[0, token], before_out[0, token])
    assert torch.equal(out[0, 1], block_out[0, 1].float())
    assert torch.equal(lse[0, :, 0], before_lse[0, :, 0]) and torch.equal(lse[0, :, 3], before_lse[0, :, 3])
    assert torch.equal(lse[0, :, 1], block_lse[0, :, 1])
    assert (lse[0, :, 2] == -inf).all()


def test_token_major_lse_layouts():
    """(B, S, H, 1) accumulators and (B, H, S) blocks in any combination give one result."""
    generator = torch.Generator().manual_seed(torch.seed() % 2**31)
    out = torch.randn(2, 6, 3, 8, generator=generator)
    block_out = torch.randn(2, 6, 3, 8, generator=generator)
    lse, block_lse = (torch.randn(2, 3, 6, generator=generator) for _ in range(2))
    expected_out, expected_lse = out.clone(), lse.clone()
    portattn.merge_attention_states(expected_out, expected_lse, block_out, block_lse)
    token_major = lse.transpose(1, 2).contiguous().unsqueeze(-1)  # (B, S, H, 1), its own strides
    got_out = out.clone()
    portattn.merge_attention_states(got_out, token_major, block_out, block_lse.transpose(1, 2)[..., None])
    assert torch.equal(got_out, expected_out)
    assert torch.equal(token_major[..., 0].transpose(1, 2), expected_lse)


def test_bad_arguments_name_the_argument():
    out, block_out = torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8)
    lse, block_lse = torch.zeros(1, 2, 4), torch.zeros(1, 2, 4)
    merge = portattn.merge_attention_states
    with pytest.raises(TypeError, match="lse must be float32"):
        merge(out, lse.double(), block_out, block_lse)
    with pytest.raises(TypeError, match="block_out must be float16, bfloat16 or float32"):
        merge(out, lse, block_out.double(), block_lse)
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        merge(None, lse, block_out, block_lse)
    with pytest.raises(ValueError, match="block_out has shape"):
        merge(out, lse, block_out[:, :3], block_lse)
    with pytest.raises(ValueError, match="block_lse has shape"):
        merge(out, lse, block_out, torch.zeros(1, 4, 2))
    with pytest.raises(ValueError, match="contiguous in their last"):
        merge(out, lse, torch.zeros(1, 4, 2, 16)[..., ::2], block_lse)
