"""The sm80+ kernels under a shared-memory budget (Note [portattn smem budget] in
backends/cuda/csrc/smem_budget.h; PORTATTN_MAX_SMEM_KIB).

Run this file (and the forward/backward suites) three times on an H100 to cover the tile
configurations of three kinds of part: unrestricted, with PORTATTN_MAX_SMEM_KIB=163 (A100)
and with PORTATTN_MAX_SMEM_KIB=99 (RTX 3090/4090, L4, A10: the 64 x 64 forward tile at head
dims 224/256 and the smallest backward tiles). The grid tests run at the process's budget;
the budget tests set the module's cap themselves, so they check the 99 KiB tiles and the
refusal past the budget in every run. Error rule: tests/error_rule.py against the float64
oracle, outputs and gradients NaN-poisoned.
"""
from __future__ import annotations

import math

import pytest
import torch

from error_rule import GRAD_FACTOR, assert_lse, assert_output, assert_within
from naive import naive_attention

pytestmark = pytest.mark.gpu

from cuda_gpu_setup import BACKEND, poison_free_memory, rand  # noqa: E402  (skips without a GPU)

from portattn import decode  # noqa: E402
from portattn.backends.cuda import _C  # noqa: E402
from portattn.backends.reference import philox_keep_mask  # noqa: E402
from portattn.capability import smem_cap  # noqa: E402

KIB = 1024
HEAD_DIMS = [32, 64, 96, 128, 160, 192, 224, 256]


def _options(q, causal, dropout_p=0.0, seed=0, offset=0):
    return dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
                softmax_scale=1.0 / math.sqrt(q.shape[-1]), window_left=-1, window_right=0 if causal else -1,
                softcap=0.0, alibi_slopes=None, dropout_p=dropout_p, rng_seed=seed, rng_offset=offset)


def _forward(q, k, v, options):
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device=q.device)
    BACKEND.forward(q, k, v, out, lse, **options)
    torch.cuda.synchronize()
    return out, lse


def _backward(dout, q, k, v, out, lse, options):
    dq, dk, dv = (torch.full_like(x, float("nan")) for x in (q, k, v))
    poison_free_memory()  # the workspace the backward allocates next starts as NaN
    BACKEND.backward(dout, q, k, v, out, lse, dq, dk, dv, deterministic=False, **options)
    torch.cuda.synchronize()
    return dq, dk, dv


def _naive_grads(q, k, v, dout, compute_dtype, naive_options):
    leaves = [x.detach().to(compute_dtype).requires_grad_() for x in (q, k, v)]
    out, _ = naive_attention(*leaves, compute_dtype=compute_dtype, **naive_options)
    out.backward(dout.to(compute_dtype))
    return [x.grad for x in leaves]


def _check_forward_and_backward(head_dim, causal, dropout_p, dtype=torch.bfloat16, seqlens=(211, 333)):
    batch, heads = 2, 3
    seed, offset = 1234567, (5 << 32) + 77
    q = rand(batch, seqlens[0], heads, head_dim, dtype=dtype)
    k = rand(batch, seqlens[1], heads, head_dim, dtype=dtype)
    v = rand(batch, seqlens[1], heads, head_dim, dtype=dtype)
    naive_options = dict(causal=causal)
    if dropout_p > 0:
        bh = torch.arange(batch * heads, device="cuda").reshape(batch, heads)
        mask = philox_keep_mask(seed, offset, bh, range(seqlens[0]), range(seqlens[1]), dropout_p, device="cuda")
        naive_options.update(dropout_mask=mask, dropout_p=dropout_p)
    options = _options(q, causal, dropout_p, seed, offset)
    out, lse = _forward(q, k, v, options)
    ref, ref_lse = naive_attention(q, k, v, compute_dtype=torch.float64, **naive_options)
    low, _ = naive_attention(q, k, v, compute_dtype=dtype, **naive_options)
    assert_output(out, ref, low)
    if dropout_p == 0:
        _, low_lse = naive_attention(q.float(), k.float(), v.float(), compute_dtype=torch.float32, **naive_options)
        assert_lse(lse, ref_lse, low_lse)
    dout = torch.randn_like(out)
    grads = _backward(dout, q, k, v, out, lse, options)
    ref_grads = _naive_grads(q, k, v, dout, torch.float64, naive_options)
    low_grads = _naive_grads(q, k, v, dout, dtype, naive_options)
    for name, got, r, lo in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads):
        assert_within(name, got, r, lo, GRAD_FACTOR)


@pytest.fixture
def cap():
    """Sets the module's cap (bytes) for one test and restores the process's afterwards."""
    before = _C.smem_cap()

    def set_cap(nbytes):
        _C.set_smem_cap(nbytes)
        decode.forget_plans()  # the decode planner's occupancy depends on the cap
    yield set_cap
    set_cap(before)


def test_the_module_has_the_process_cap():
    assert _C.smem_cap() == (smem_cap.cap_bytes() or 0)


@pytest.mark.parametrize("dropout_p", [0.0, 0.17], ids=["plain", "dropout"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_forward_backward_at_the_process_budget(head_dim, causal, dropout_p):
    _check_forward_and_backward(head_dim, causal, dropout_p)


@pytest.mark.parametrize("dropout_p", [0.0, 0.17], ids=["plain", "dropout"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [224, 256])
@pytest.mark.parametrize("budget_kib", [99, 163])
def test_large_head_dims_at_a_part_budget(cap, budget_kib, head_dim, causal, dropout_p):
    """99 KiB: the 64 x 64 forward tile and the smallest backward tiles; 163 KiB: the wide ones.
    Long enough for several key and query blocks, with ragged tails."""
    cap(budget_kib * KIB)
    _check_forward_and_backward(head_dim, causal, dropout_p, dtype=torch.float16, seqlens=(300, 1000))


def test_a_launch_never_exceeds_the_budget(cap):
    """Below every tile of head dim 256 (96 KiB) the launch is refused with the budget named,
    not run with more shared memory than the cap allows."""
    q = rand(1, 128, 2, 256, dtype=torch.bfloat16)
    cap(96 * KIB - 1)
    with pytest.raises(RuntimeError, match=r"needs 98304 bytes of shared memory per block; the budget is 98303 "
                                           r"\(capped by PORTATTN_MAX_SMEM_KIB\)"):
        _forward(q, q, q, _options(q, causal=True))
    cap(96 * KIB)
    out, _ = _forward(q, q, q, _options(q, causal=True))
    assert not out.isnan().any()


def test_dispatch_under_the_process_cap_picks_what_the_part_would():
    """Under a cap below the H100's 227 KiB the Hopper path steps aside (the matrix's rule); a
    call at head dim 256 runs compiled on the sm80+ path, never on the reference backend."""
    import portattn

    q = rand(1, 64, 2, 256, dtype=torch.bfloat16)
    chosen = portattn.explain(q, q, q, causal=True).chosen
    budget = smem_cap.cap_bytes()
    props = torch.cuda.get_device_properties(q.device)
    own = getattr(props, "shared_memory_per_block_optin", 0)
    if budget is None or budget >= own:
        assert chosen in ("cuda-sm90", "cuda")
    else:
        assert chosen == "cuda"
