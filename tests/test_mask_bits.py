"""common/mask_bits.h on the CPU: the run of fragment columns a row keeps (one bit per column, Note
[portattn hopper mask bits]) is exactly the set the per-column rule keeps, offset(c) in [lo, hi] with
offset(c) = 8 (c / 2) + c % 2, for the 32 columns of a 128-key block and the 44 of a 176-key block, over
every bound from far left of the block to far right of it (the header is host/device code; here it is
compiled as plain C++)."""
from __future__ import annotations

import pytest
from host_driver import compile_driver, run_driver

_DRIVER = r"""
#include <stdio.h>
#include "mask_bits.h"
// stdin: lines "cols hi lo"; stdout per line: the kept columns' bits as an unsigned number.
int main() {
  int cols, hi, lo;
  while (scanf("%d %d %d", &cols, &hi, &lo) == 3) {
    unsigned long long bits = cols == 32 ? (unsigned long long)portattn::mask_bits::row_keep<32>(hi, lo)
                                         : (unsigned long long)portattn::mask_bits::row_keep<44>(hi, lo);
    // kept() is what the kernel tests; print its answers, so that both functions are checked.
    unsigned long long seen = 0;
    for (int c = 0; c < cols; ++c) {
      const bool k = cols == 32 ? portattn::mask_bits::kept((uint32_t)bits, c) : portattn::mask_bits::kept(bits, c);
      if (k) seen |= 1ull << c;
    }
    printf("%llu %llu\n", bits, seen);
  }
  return 0;
}
"""

# Bounds from far left of a block to far right of it, and the extremes a call can produce.
_BOUNDS = sorted(set(range(-12, 190)) | {-(2**31) + 1, -100000, 100000, 2**31 - 2})


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    return compile_driver(tmp_path_factory, "mask_bits", _DRIVER)


def _expected(cols: int, hi: int, lo: int) -> int:
    return sum(1 << c for c in range(cols) if lo <= 8 * (c // 2) + c % 2 <= hi)


@pytest.mark.parametrize("cols", [32, 44])
def test_right_bound_only(driver, cols):
    # lo = 0 is how the kernel passes "no left bound": every column offset is >= 0.
    cases = [(cols, hi, 0) for hi in _BOUNDS]
    rows = run_driver(driver, [f"{c} {h} {l}" for c, h, l in cases])
    for (c, h, l), (bits, seen) in zip(cases, rows):
        assert bits == seen == _expected(c, h, l), (c, h, l)


@pytest.mark.parametrize("cols", [32, 44])
def test_both_bounds(driver, cols):
    near = [b for b in _BOUNDS if -12 <= b <= 190][::3] + [-(2**31) + 1, 2**31 - 2]
    cases = [(cols, hi, lo) for hi in near for lo in near]
    rows = run_driver(driver, [f"{c} {h} {l}" for c, h, l in cases])
    for (c, h, l), (bits, seen) in zip(cases, rows):
        assert bits == seen == _expected(c, h, l), (c, h, l)
    # The runs are neither all empty nor all full.
    assert len({bits for bits, _ in rows}) > 100
