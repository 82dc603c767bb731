"""The error rule of every numerical test (the one flash-attn's own tests use).

A kernel's result is judged against an oracle, the same naive attention computed in
float64 from the same low-precision inputs, by comparing its error with PyTorch's own
error on the same inputs:

    max|got - oracle| <= factor * max|got_torch - oracle| + floor

- `got_torch` is the naive attention run by PyTorch in the inputs' dtype (fp16 / bf16): the
  error any implementation of that precision makes, so no tolerance is tuned by hand.
- `factor` is OUT_FACTOR (2) for outputs and GRAD_FACTOR (3) for gradients (dQ, dK, dV, each
  separately): the backward compounds one more rounding step.
- `floor` is FLOOR (1e-5): where PyTorch's error is 0 (exact cases, float32 inputs) the
  kernel's rounding noise still passes.
- NaN anywhere in `got` fails: tests NaN-poison outputs before a launch, so an element the
  kernel never wrote is caught.

The LSE is a float32 output whatever the input dtype: its rule compares with the float64
LSE, takes the float32 naive LSE's error as PyTorch's, uses LSE_FLOOR (1e-4), and applies
to the rows that see at least one key; rows that see none must be -inf exactly, on the same
rows as the oracle (never NaN).
Where it stops holding: at score ranges far beyond attention's (|LSE| in the hundreds), any
tensor-core kernel's LSE is 2-4x the CUDA-core float32 error. The fp32 accumulation of the
products keeps fewer bits there; a plain Triton GEMM of the same inputs shows the same error
(archive:2026-11-26-a55d02d-probe/lse_probe.txt). Tests keep scores in realistic ranges
(tests/gpu/test_cuda_hopper_forward.py, the growing-maxima test).
"""
from __future__ import annotations

import torch

OUT_FACTOR = 2.0
GRAD_FACTOR = 3.0
FLOOR = 1e-5
LSE_FLOOR = 1e-4


def max_error(got, oracle) -> float:
    """max |got - oracle| in float64 (0 for empty tensors)."""
    if got.numel() == 0:
        return 0.0
    return (got.detach().double() - oracle.detach().double()).abs().max().item()


def assert_errors(name, err, base, factor, floor=FLOOR, lowp="low-precision"):
    """The rule on measured errors: err = max|got - oracle|, base = max|got_torch - oracle|."""
    assert err <= factor * base + floor, (
        f"{name} error {err:.3e} > {factor:g} x torch {lowp} error {base:.3e} (+ {floor:g})")


def assert_within(name, got, oracle, torch_lowp, factor, floor=FLOOR):
    """The rule for one tensor: max|got - oracle| <= factor * max|torch_lowp - oracle| + floor."""
    assert not got.isnan().any(), f"{name} has NaN (unwritten or bad math)"
    assert_errors(name, max_error(got, oracle), max_error(torch_lowp, oracle), factor, floor, torch_lowp.dtype)


def assert_output(out, oracle, torch_lowp, name="out"):
    """An attention output: factor OUT_FACTOR."""
    assert_within(name, out, oracle, torch_lowp, OUT_FACTOR)


def assert_grads(grads, oracles, torch_lowps, names=("dq", "dk", "dv")):
    """Gradients, each separately: factor GRAD_FACTOR."""
    for name, got, oracle, low in zip(names, grads, oracles, torch_lowps):
        assert_within(name, got, oracle, low, GRAD_FACTOR)


def assert_lse(lse, oracle_lse, fp32_lse):
    """The LSE: -inf on exactly the oracle's empty rows, the rule (floor LSE_FLOOR) on the others."""
    assert not lse.isnan().any(), "lse has NaN (unwritten or bad math)"
    empty = oracle_lse.isinf()
    assert torch.equal(lse.isinf(), empty), "lse = -inf on a different set of rows"
    finite = ~empty
    if finite.any():
        assert_within("lse", lse[finite], oracle_lse[finite], fp32_lse[finite], OUT_FACTOR, LSE_FLOOR)


def sink_grad_from(out, lse, dout, s_aux):
    """d s_aux of dense attention with sinks from a given output and LSE:
    -sum over (batch, row) of exp(s_aux[h] - lse) * rowsum(dout * out), in float32 (out, dout
    (batch, seqlen, nheads, head_dim); lse (batch, nheads, seqlen))."""
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    return -(torch.exp(s_aux.float()[None, :, None] - lse.float()) * delta).sum(dim=(0, 2))


def assert_sink_grad(got, oracle, torch_autograd, torch_from_output):
    """d s_aux (one value per head, a sum over every query row of that head) under the gradient rule.

    PyTorch's error on such a sum depends on how its rounding errors happen to cancel: over four
    seeds of a (2, 300, 8, 64) bf16 case, its autograd's error ranged 0.06-2.2x that of the same
    gradient computed from its own bf16 output (sink_grad_from). PyTorch's error is therefore the
    larger of the two, both same-precision PyTorch computations against the float64 oracle."""
    assert not got.isnan().any(), "ds_aux has NaN (unwritten or bad math)"
    base = max(max_error(torch_autograd, oracle), max_error(torch_from_output, oracle))
    assert_errors("ds_aux", max_error(got, oracle), base, GRAD_FACTOR, FLOOR, torch_autograd.dtype)
