"""common/fast_divide.h on the CPU: the multiply-high division the Hopper forward decodes its
tiles with equals `/` and `%` for every divisor a launch can pass (1 .. 2^31 - 1) and every
dividend 0 .. 2^31 - 1 it can divide (the header is host/device code; here it is plain C++)."""
from __future__ import annotations

import random

import pytest
from host_driver import compile_driver, run_driver

_INT_MAX = 2**31 - 1

_DRIVER = r"""
#include <stdio.h>
#include "fast_divide.h"
// stdin: lines "n d"; stdout per line: "quotient remainder" from fast_divmod, then fast_div's quotient.
int main() {
  long long n, d;
  while (scanf("%lld %lld", &n, &d) == 2) {
    const portattn::FastDivisor f = portattn::make_fast_divisor((int)d);
    int remainder = -1;
    const int q = portattn::fast_divmod((int)n, f, remainder);
    printf("%d %d %d\n", q, remainder, portattn::fast_div((int)n, f));
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    return compile_driver(tmp_path_factory, "fast_divide", _DRIVER)


def _divisors(rng):
    """Small ones (head and block counts), powers of two and their neighbours, and random ones."""
    small = list(range(1, 300))
    powers = [p + e for k in range(1, 31) for p in (2**k,) for e in (-1, 0, 1)]
    return sorted(set(small + powers + [_INT_MAX, _INT_MAX - 1] + [rng.randrange(1, _INT_MAX) for _ in range(300)]))


def _dividends(rng, d):
    """Edges where a wrong rounding shows first: around multiples of d and near 2^31."""
    near = [0, 1, d - 1, d, d + 1, _INT_MAX, _INT_MAX - 1, _INT_MAX - d]
    top = _INT_MAX - _INT_MAX % d  # the largest multiple of d
    near += [top - 1, top, top - d, top - d - 1]
    near += [rng.randrange(0, _INT_MAX) for _ in range(12)]
    multiples = [k * d + e for k in (rng.randrange(0, _INT_MAX // d + 1) for _ in range(4)) for e in (-1, 0, 1)]
    return [n for n in set(near + multiples) if 0 <= n <= _INT_MAX]


def test_fast_divmod_equals_integer_division(driver):
    rng = random.Random(20261126)
    cases = [(n, d) for d in _divisors(rng) for n in _dividends(rng, d)]
    rows = run_driver(driver, [f"{n} {d}" for n, d in cases])
    wrong = [(n, d, row) for (n, d), row in zip(cases, rows) if row != (n // d, n % d, n // d)]
    assert not wrong, f"{len(wrong)} of {len(cases)} wrong, e.g. (n, d, (q, r, q)) = {wrong[:5]}"
    assert len(cases) > 8000


def test_fast_divmod_exhaustive_for_small_tile_counts(driver):
    """Every dividend below 4096 for every divisor below 130: the tile counts short calls use."""
    cases = [(n, d) for d in range(1, 130) for n in range(0, 4096, 7)]
    rows = run_driver(driver, [f"{n} {d}" for n, d in cases])
    assert rows == [(n // d, n % d, n // d) for n, d in cases]
