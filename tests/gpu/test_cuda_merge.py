"""portattn.merge_attention_states' CUDA kernel (backends/cuda/csrc/merge_entry.cu): against
ring-flash-attn's own update_out_and_lse on the same GPU and against the torch path
(portattn.merge.merge_attention_states_reference), on both vector widths, every dtype pair,
the LSE layouts, strided views, empty rows, and under CUDA-graph capture."""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch

pytestmark = pytest.mark.gpu

from cuda_gpu_setup import BACKEND  # noqa: E402,F401  (skips without an NVIDIA GPU or the built backend)

import portattn  # noqa: E402
from portattn.merge import _compiled, merge_attention_states_reference  # noqa: E402

if _compiled() is None:
    pytest.skip("this build of the CUDA module has no merge entry", allow_module_level=True)

# Same fp32 operations as torch's kernels; expf / log1pf may differ in the last bit between
# nvcc releases, which moves w (and so out) by about one ulp.
TOL = dict(rtol=4e-6, atol=4e-6)


def _case(batch, seqlen, heads, dim, out_dtype, block_dtype, varlen=False):
    shape = (batch * seqlen, heads, dim) if varlen else (batch, seqlen, heads, dim)
    lse_shape = (heads, batch * seqlen) if varlen else (batch, heads, seqlen)
    out = torch.randn(shape, device="cuda").to(out_dtype)
    block_out = torch.randn(shape, device="cuda").to(block_dtype)
    lse = 3 * torch.randn(lse_shape, device="cuda") + 8
    block_lse = 3 * torch.randn(lse_shape, device="cuda") + 8
    return out, lse, block_out, block_lse


def _both(out, lse, block_out, block_lse):
    """(kernel's out, lse), (torch path's out, lse) from copies of the same inputs."""
    kernel = [out.clone(), lse.clone()]
    torch_path = [out.clone(), lse.clone()]
    portattn.merge_attention_states(kernel[0], kernel[1], block_out, block_lse)
    merge_attention_states_reference(torch_path[0], torch_path[1], block_out, block_lse)
    return kernel, torch_path


@pytest.mark.parametrize("dim", [128, 64, 96, 256, 40, 20])  # 40, 20: not multiples of 8 -> one element per access
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.float16, torch.float16)])
@pytest.mark.parametrize("varlen", [False, True])
def test_kernel_matches_the_torch_path(varlen, dtypes, dim):
    kernel, torch_path = _both(*_case(2, 77, 5, dim, *dtypes, varlen=varlen))
    if dtypes[0] == torch.float32:
        torch.testing.assert_close(kernel[0], torch_path[0], **TOL)
    else:  # one rounding of the merged value to 16 bits: at most one unit apart
        torch.testing.assert_close(kernel[0].float(), torch_path[0].float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(kernel[1], torch_path[1], **TOL)


@pytest.mark.skipif(importlib.util.find_spec("ring_flash_attn") is None, reason="ring-flash-attn is not installed")
@pytest.mark.parametrize("sliced", [False, True])
def test_kernel_matches_ring_flash_attn_update_out_and_lse(sliced):
    """Several steps of ring attention's accumulation, the zigzag half-slice step included."""
    from portattn.compat import import_ring_flash_attn

    import_ring_flash_attn(merge="ring")
    from ring_flash_attn.utils import update_out_and_lse

    batch, seqlen, heads, dim = 1, 1024, 16, 128
    steps = [_case(batch, seqlen, heads, dim, torch.bfloat16, torch.bfloat16)[2:] for _ in range(4)]
    ring = update_out_and_lse(None, None, *steps[0])
    ours = [t.clone() for t in update_out_and_lse(None, None, *steps[0])]
    half = seqlen // 2
    for block_out, block_lse in steps[1:]:
        if sliced:  # zigzag: the later half of the tokens, a half-length block
            block_out, block_lse = block_out[:, :half].contiguous(), block_lse[..., :half].contiguous()
            slice_ = (slice(None), slice(half, None))
            ring = update_out_and_lse(*ring, block_out, block_lse, slice_=slice_)
            portattn.merge_attention_states(ours[0][slice_], ours[1][slice_], block_out, block_lse)
        else:
            ring = update_out_and_lse(*ring, block_out, block_lse)
            portattn.merge_attention_states(*ours, block_out, block_lse)
    torch.testing.assert_close(ours[0], ring[0], **TOL)
    torch.testing.assert_close(ours[1], ring[1], **TOL)


def test_strided_views_and_unaligned_pointers():
    out, lse, block_out, block_lse = _case(1, 64, 4, 64, torch.float32, torch.bfloat16)
    # A head-sliced view (row stride 8 x 64: still 16-byte rows) and a view one element off
    # alignment (the one-element path).
    wide = torch.randn(1, 64, 8, 64, device="cuda")
    shifted = torch.randn(1 * 64 * 4 * 64 + 1, device="cuda")[1:].view(1, 64, 4, 64)
    for target in (wide[:, :, 2:6], shifted):
        target.copy_(out)
        reference = [out.clone(), lse.clone()]
        merge_attention_states_reference(*reference, block_out, block_lse)
        got_lse = lse.clone()
        portattn.merge_attention_states(target, got_lse, block_out, block_lse)
        torch.testing.assert_close(target, reference[0], **TOL)
        torch.testing.assert_close(got_lse, reference[1], **TOL)


def test_empty_rows_give_no_nan():
    out, lse, block_out, block_lse = _case(1, 8, 2, 128, torch.float32, torch.bfloat16)
    lse[0, :, 1:3] = -math.inf
    block_lse[0, :, 0] = -math.inf
    block_lse[0, :, 2] = -math.inf
    block_lse[0, :, 3] = math.inf  # flash-attn 2's empty row
    kernel, torch_path = _both(out, lse, block_out, block_lse)
    assert not kernel[0].isnan().any() and not kernel[1].isnan().any()
    assert torch.equal(kernel[0], torch_path[0]) and torch.equal(kernel[1], torch_path[1])
    assert torch.equal(kernel[0][0, 1], block_out[0, 1].float())
    assert torch.equal(kernel[0][0, 0], out[0, 0]) and (kernel[1][0, :, 2] == -math.inf).all()


def test_replays_under_cuda_graph_capture():
    out, lse, block_out, block_lse = _case(2, 300, 4, 128, torch.float32, torch.bfloat16)
    static = [out.clone(), lse.clone(), block_out.clone(), block_lse.clone()]
    portattn.merge_attention_states(*[t.clone() for t in static])  # loads the kernel before capture
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        portattn.merge_attention_states(*static)
    for _ in range(2):
        fresh = _case(2, 300, 4, 128, torch.float32, torch.bfloat16)
        for target, value in zip(static, fresh):
            target.copy_(value)
        graph.replay()
        eager = [fresh[0].clone(), fresh[1].clone()]
        portattn.merge_attention_states(*eager, fresh[2], fresh[3])
        assert torch.equal(static[0], eager[0]) and torch.equal(static[1], eager[1])
