"""Programmatic dependent launch (Note [portattn programmatic dependent launch], pdl.cuh): every
kernel of the forward, backward and decode paths may be scheduled while the kernel before it in
the stream finishes, and waits for that grid before touching memory. What could go wrong is a
kernel reading its inputs before the previous kernel has written them, so these tests chain
calls whose inputs are the previous call's outputs, with no synchronisation between them, and
compare with the same chain run with PDL switched off (PORTATTN_PDL=0, read once per process,
hence one subprocess per setting): bit for bit, in the deterministic mode.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

from cuda_gpu_setup import cuda_backend  # noqa: E402  (skips without a GPU)

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")

# A chain of dependent calls on one stream: each forward's query is the previous output, the
# backward runs through all of them; the Hopper kernels (head dims 64, 128) and the sm80+ ones (32) both take
# part; then a decode step whose query is the last output. Prints a digest of every result.
CHAIN = r"""
import hashlib, sys, torch
import portattn
from portattn.backends.cuda import _C
print("pdl", _C.pdl_enabled())
torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16
def digest(t):
    return hashlib.sha256(t.detach().float().cpu().numpy().tobytes()).hexdigest()[:16]
for hd, seqlen, causal in [(64, 512, True), (128, 1000, False), (64, 100, False), (32, 300, True)]:
    batch, heads = 4, 8
    q = torch.randn(batch, seqlen, heads, hd, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(batch, seqlen, heads, hd, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(batch, seqlen, heads, hd, device=dev, dtype=dt, requires_grad=True)
    x = q
    for layer in range(4):
        x = portattn.flash_attn_func(x * 4.0, k, v, causal=causal, deterministic=True)
    x.float().square().sum().backward()
    print(hd, seqlen, causal, digest(x), digest(q.grad), digest(k.grad), digest(v.grad))
cache_k = torch.randn(2, 4096, 4, 128, device=dev, dtype=dt)
cache_v = torch.randn(2, 4096, 4, 128, device=dev, dtype=dt)
qd = torch.randn(2, 1, 16, 128, device=dev, dtype=dt)
seqlens = torch.tensor([4000, 2500], device=dev, dtype=torch.int32)
for step in range(3):
    qd = portattn.flash_attn_with_kvcache(qd * 2.0, cache_k, cache_v, cache_seqlens=seqlens)
print("decode", digest(qd))
"""


def _run_chain(pdl: str) -> list:
    env = dict(os.environ, PORTATTN_PDL=pdl)
    result = subprocess.run([sys.executable, "-c", CHAIN], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.splitlines()


def test_dependent_chains_give_the_same_bits_with_and_without_pdl():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm90+; before it the launches are plain")
    with_pdl, without = _run_chain("1"), _run_chain("0")
    assert with_pdl[0] == "pdl True", with_pdl[0]
    assert without[0] == "pdl False", without[0]
    assert len(with_pdl) == len(without) == 6
    assert with_pdl[1:] == without[1:]


def test_pdl_switch_reads_the_environment_once():
    code = ("import os\nfrom portattn.backends.cuda import _C\nfirst = _C.pdl_enabled()\n"
            "os.environ['PORTATTN_PDL'] = '0' if first else '1'\nprint(first, _C.pdl_enabled())\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={key: value for key, value in os.environ.items() if key != "PORTATTN_PDL"})
    assert result.returncode == 0, result.stderr[-2000:]
    first, second = result.stdout.split()
    assert first == second
    assert first == str(torch.cuda.get_device_capability()[0] >= 9)
