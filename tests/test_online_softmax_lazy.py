"""common/online_softmax.h's deferred lazy step on the CPU (Note [portattn hopper lazy rescale]).

The header is host/device code; a small driver compiled as plain C++ runs the Hopper forward's
pipelined order on one thread that holds a whole (4 x 16) score tile per key block: block 0 through
online_softmax_step_deferred<true>, every later block through online_softmax_step_deferred_lazy (or,
for comparison, the per-block online_softmax_step_deferred), then the previous block's P V lands in O,
and O is rescaled only when the step asked for it. Each result is checked against a float64 softmax of
the same scores. So is what the lazy rule promises: P never exceeds 2^8, and a rescale happens exactly
when some row's maximum moved more than 2^8 past the one it kept.
"""
from __future__ import annotations

import math

import pytest
import torch
from host_driver import compile_driver

ROWS, COLS, OCOLS = 4, 16, 8

_DRIVER = r"""
#include <stdio.h>
#include <stdlib.h>
#include "online_softmax.h"
using namespace portattn::softmax;
constexpr int kRows = 4, kCols = 16, kOCols = 8;
// One thread holds whole rows here, so the row and warp reductions are the identity.
struct OneThread {
  static float max(float x) { return x; }
  static float sum(float x) { return x; }
  static bool any(bool x) { return x; }
};
static float read_float() {
  char token[64];
  if (scanf("%63s", token) != 1) exit(2);
  return strtof(token, nullptr);  // accepts "-inf"
}
// stdin: "blocks scale_log2 lazy", then per block kRows x kCols scores and kCols x kOCols values of V.
// stdout: O (kRows x kOCols), the LSE per row, the largest P, and how many blocks rescaled O.
int main() {
  int blocks, lazy;
  float scale_log2;
  if (scanf("%d %f %d", &blocks, &scale_log2, &lazy) != 3) return 1;
  RowState<kRows> state;
  state.init();
  float o[kRows][kOCols] = {};
  float p[kRows][kCols], v[kCols][kOCols], correction[kRows];
  float max_p = 0.f;
  int rescales = 0;
  for (int b = 0; b < blocks; ++b) {
    float s[kRows][kCols], v_next[kCols][kOCols];
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < kCols; ++c) s[r][c] = read_float();
    for (int c = 0; c < kCols; ++c)
      for (int j = 0; j < kOCols; ++j) v_next[c][j] = read_float();
    bool rescale = false;
    if (b == 0) {
      online_softmax_step_deferred<true, kRows, kCols, OneThread>(s, state, scale_log2, correction);
    } else if (lazy) {
      rescale = online_softmax_step_deferred_lazy<kRows, kCols, OneThread>(s, state, scale_log2, correction);
    } else {
      online_softmax_step_deferred<false, kRows, kCols, OneThread>(s, state, scale_log2, correction);
      rescale = true;
    }
    if (b > 0) {  // the previous block's P V lands, then O takes this block's correction
      for (int r = 0; r < kRows; ++r)
        for (int j = 0; j < kOCols; ++j)
          for (int c = 0; c < kCols; ++c) o[r][j] += p[r][c] * v[c][j];
      if (rescale) rescale_rows(o, correction);
      rescales += rescale ? 1 : 0;
    }
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < kCols; ++c) {
        p[r][c] = s[r][c];
        max_p = p[r][c] > max_p ? p[r][c] : max_p;
      }
    for (int c = 0; c < kCols; ++c)
      for (int j = 0; j < kOCols; ++j) v[c][j] = v_next[c][j];
  }
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kOCols; ++j)
      for (int c = 0; c < kCols; ++c) o[r][j] += p[r][c] * v[c][j];
  float lse[kRows];
  online_softmax_finalize<kRows, kOCols, OneThread>(o, state, scale_log2, 1.f, lse);
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kOCols; ++j) printf("%.9g ", o[r][j]);
  for (int r = 0; r < kRows; ++r) printf("%.9g ", lse[r]);
  printf("%.9g %d\n", max_p, rescales);
  return 0;
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    # (online_softmax.h's `#pragma unroll` is for nvcc / hipcc; a host compiler warns about it.)
    return compile_driver(tmp_path_factory, "online_softmax_lazy", _DRIVER, flags=("-Wno-unknown-pragmas",))


def run(driver: str, scores: torch.Tensor, values: torch.Tensor, scale_log2: float, lazy: bool):
    """scores: (blocks, ROWS, COLS), values: (blocks, COLS, OCOLS) -> (O, lse, max P, rescales)."""
    import subprocess

    tokens = [f"{scores.shape[0]} {scale_log2!r} {int(lazy)}"]
    for block_scores, block_values in zip(scores, values):
        tokens.append(" ".join(repr(float(x)) for x in block_scores.flatten()))
        tokens.append(" ".join(repr(float(x)) for x in block_values.flatten()))
    done = subprocess.run([driver], input="\n".join(tokens) + "\n", check=True, capture_output=True, text=True)
    numbers = [float(x) for x in done.stdout.split()]
    o = torch.tensor(numbers[:ROWS * OCOLS], dtype=torch.float64).view(ROWS, OCOLS)
    lse = torch.tensor(numbers[ROWS * OCOLS:ROWS * OCOLS + ROWS], dtype=torch.float64)
    return o, lse, numbers[-2], int(numbers[-1])


def reference(scores: torch.Tensor, values: torch.Tensor, scale_log2: float):
    """float64 softmax over all blocks' keys: O and the natural-log LSE (-inf, O = 0 for empty rows)."""
    s = scores.double().permute(1, 0, 2).reshape(ROWS, -1) * scale_log2 * math.log(2.0)
    v = values.double().reshape(-1, OCOLS)
    lse = torch.logsumexp(s, dim=1)
    weights = torch.where(torch.isfinite(lse)[:, None], torch.exp(s - lse[:, None]), torch.zeros_like(s))
    return weights @ v, lse


def ramp_scores(blocks: int, growth: float, scale_log2: float, seed: int) -> torch.Tensor:
    """Rows 0 and 2 grow by `growth` (log2 units) a block, rows 1 and 3 stay put (noise only)."""
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(blocks, ROWS, COLS, generator=generator, dtype=torch.float64)
    ramp = torch.arange(blocks, dtype=torch.float64)[:, None, None] * growth * torch.tensor([1.0, 0, 1.0, 0])[:, None]
    return ((noise + ramp) / scale_log2).float()


def random_values(blocks: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed + 1)
    return torch.randn(blocks, COLS, OCOLS, generator=generator).float()


SCALE_LOG2 = 0.125 * 1.4426950408889634


@pytest.mark.parametrize("growth, blocks", [(0.0, 8), (0.5, 12), (3.0, 9), (6.0, 9), (10.0, 6), (30.0, 5)])
@pytest.mark.parametrize("lazy", [True, False])
def test_lazy_and_per_block_steps_match_a_float64_softmax(driver, growth, blocks, lazy):
    scores, values = ramp_scores(blocks, growth, SCALE_LOG2, seed=blocks), random_values(blocks, seed=blocks)
    o, lse, max_p, rescales = run(driver, scores, values, SCALE_LOG2, lazy)
    ref_o, ref_lse = reference(scores, values, SCALE_LOG2)
    assert torch.allclose(o, ref_o, rtol=2e-5, atol=2e-6), (o - ref_o).abs().max()
    assert torch.allclose(lse, ref_lse, rtol=2e-6, atol=2e-6), (lse - ref_lse).abs().max()
    if lazy:
        assert max_p <= 2.0 ** 8 * (1 + 1e-6)
    else:
        assert max_p <= 1.0 + 1e-6 and rescales == blocks - 1


def test_lazy_step_rescales_exactly_when_a_row_moves_past_the_bound(driver):
    # Per block, in log2 units: the growing rows' maximum climbs by 3 (kept: 3 and 6 are within 8 of
    # the block-0 maximum), then 9 past block 0 at block 3 (moves), then 2 more (kept).
    climb = [0.0, 3.0, 6.0, 9.0, 11.0]
    scores = torch.full((len(climb), ROWS, COLS), -4.0 / SCALE_LOG2)
    for block, level in enumerate(climb):
        scores[block, 0, 0] = level / SCALE_LOG2
        scores[block, 1, 3] = 0.0  # a row whose maximum never moves
    values = random_values(len(climb), seed=7)
    o, lse, max_p, rescales = run(driver, scores, values, SCALE_LOG2, lazy=True)
    ref_o, ref_lse = reference(scores, values, SCALE_LOG2)
    assert rescales == 1
    assert max_p == pytest.approx(2.0 ** 6, rel=1e-5)  # block 2's 6 above the kept maximum
    assert torch.allclose(o, ref_o, rtol=2e-5, atol=2e-6) and torch.allclose(lse, ref_lse, rtol=2e-6, atol=2e-6)


def test_rows_without_a_visible_key_until_a_late_block(driver):
    # Row 0 sees keys only from block 2 on, row 1 never: its O must be 0 and its LSE -inf.
    blocks = 4
    scores = ramp_scores(blocks, 1.0, SCALE_LOG2, seed=3)
    scores[:2, 0, :] = float("-inf")
    scores[:, 1, :] = float("-inf")
    values = random_values(blocks, seed=3)
    for lazy in (True, False):
        o, lse, _, _ = run(driver, scores, values, SCALE_LOG2, lazy)
        ref_o, ref_lse = reference(scores, values, SCALE_LOG2)
        assert lse[1] == float("-inf") and torch.all(o[1] == 0)
        finite = torch.isfinite(ref_lse)
        assert torch.allclose(o[finite], ref_o[finite], rtol=2e-5, atol=2e-6)
        assert torch.allclose(lse[finite], ref_lse[finite], rtol=2e-6, atol=2e-6)
