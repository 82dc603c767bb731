"""Tensors on a GPU that is not the current device (issue 12 item 5): every per-device
decision (properties, shared-memory opt-in, the stream, the launch) follows the tensors.
Needs two GPUs; skipped with the reason otherwise (the CPU tests cover the bookkeeping
with fake devices: tests/test_call_device.py)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from cuda_gpu_setup import BACKEND  # noqa: E402,F401  (skips without a GPU)

import portattn  # noqa: E402
from naive import naive_attention  # noqa: E402

if torch.cuda.device_count() < 2:
    pytest.skip(f"needs two GPUs (this machine has {torch.cuda.device_count()})", allow_module_level=True)


@pytest.mark.parametrize("decode", [False, True])
def test_forward_backward_and_decode_on_the_second_gpu_while_the_first_is_current(decode):
    torch.cuda.set_device(0)
    device = torch.device("cuda", 1)
    seqlen_q = 1 if decode else 200
    q = torch.randn(2, seqlen_q, 8, 128, device=device, dtype=torch.bfloat16, requires_grad=not decode)
    k = torch.randn(2, 1024, 2, 128, device=device, dtype=torch.bfloat16, requires_grad=not decode)
    v = torch.randn(2, 1024, 2, 128, device=device, dtype=torch.bfloat16, requires_grad=not decode)
    out = portattn.flash_attn_func(q, k, v, causal=True)
    assert out.device == device and torch.cuda.current_device() == 0
    ref, _ = naive_attention(q.detach(), k.detach(), v.detach(), causal=True)
    low, _ = naive_attention(q.detach(), k.detach(), v.detach(), causal=True, compute_dtype=torch.bfloat16)
    err = (out.detach().double() - ref).abs().max().item()
    assert err <= 2 * (low.double() - ref).abs().max().item() + 1e-5
    if not decode:
        grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        assert all(g.device == device and torch.isfinite(g).all() for g in grads)
    torch.cuda.synchronize(device)
