"""common/seq_bounds.h on the CPU: whatever cu_seqlens_q/k and seqused_k hold, every
sequence's rows stay inside the tensors and under the call's maxima, and valid values
pass through unchanged (the header is host/device code; here it is compiled as plain C++).
"""
from __future__ import annotations

import itertools

import pytest
from host_driver import compile_driver, run_driver
_INT_MIN, _INT_MAX = -(2**31), 2**31 - 1
OFFSETS = [_INT_MIN, -5, 0, 1, 3, 17, 39, 40, 41, _INT_MAX]
TOTALS = [0, 5, 40]
MAXIMA = [0, 3, 40]
USED = [None, _INT_MIN, -1, 0, 2, 100, _INT_MAX]

_DRIVER = r"""
#include <stdio.h>
#include "seq_bounds.h"
// stdin: lines "cu0 cu1 total max_len has_used used"; stdout per line: the varlen bounds
// "q_start len_q k_start len_k", then those of a dense call (seqlen_q 7, seqlen_k max_len).
int main() {
  long long cu0, cu1, total, max_len, has_used, used;
  while (scanf("%lld %lld %lld %lld %lld %lld", &cu0, &cu1, &total, &max_len, &has_used, &used) == 6) {
    int32_t cu[2] = {(int32_t)cu0, (int32_t)cu1};
    int32_t used32 = (int32_t)used;
    PortattnFwdParams p = {};
    p.cu_seqlens_q = cu;
    p.cu_seqlens_k = cu;
    p.seqused_k = has_used ? &used32 : nullptr;
    p.seqlen_q = p.seqlen_k = (int)max_len;
    p.total_q = p.total_k = total;
    const portattn::SeqBounds s = portattn::seq_bounds(p, 0);
    PortattnFwdParams d = {};
    d.seqused_k = p.seqused_k;
    d.seqlen_q = 7;
    d.seqlen_k = (int)max_len;
    const portattn::SeqBounds t = portattn::seq_bounds(d, 0);
    printf("%d %d %d %d %d %d %d %d\n", s.q_start, s.len_q, s.k_start, s.len_k, t.q_start, t.len_q, t.k_start,
           t.len_k);
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    return compile_driver(tmp_path_factory, "seq_bounds", _DRIVER)


def _bounds(driver, cases):
    """[(varlen bounds, dense bounds)] of (cu0, cu1, total, max_len, used) cases, used None = no seqused_k."""
    rows = run_driver(driver, [f"{a} {b} {t} {m} {int(u is not None)} {u or 0}" for a, b, t, m, u in cases])
    return [(row[:4], row[4:]) for row in rows]


def test_bounds_stay_inside_the_tensors_for_any_values(driver):
    cases = [(a, b, t, m, u) for a, b, t, m in itertools.product(OFFSETS, OFFSETS, TOTALS, MAXIMA)
             for u in (None, 2, _INT_MIN, _INT_MAX)]
    for case, ((q_start, len_q, k_start, len_k), (d_qs, d_lq, d_ks, d_lk)) in zip(cases, _bounds(driver, cases)):
        cu0, cu1, total, max_len, used = case
        assert 0 <= q_start and 0 <= len_q <= max_len and q_start + len_q <= total, case
        assert 0 <= k_start and 0 <= len_k <= max_len and k_start + len_k <= total, case
        if 0 <= cu0 <= cu1 <= total and cu1 - cu0 <= max_len:  # valid values pass through unchanged
            assert (q_start, len_q) == (cu0, cu1 - cu0), case
            expected_k = cu1 - cu0 if used is None else min(max(used, 0), cu1 - cu0)
            assert (k_start, len_k) == (cu0, expected_k), case
        assert (d_qs, d_lq, d_ks) == (0, 7, 0), case
        assert d_lk == (max_len if used is None else min(max(used, 0), max_len)), case


@pytest.mark.parametrize("used", USED)
def test_seqused_k_never_exceeds_the_sequence(driver, used):
    [((_, _, _, len_k), (_, _, _, dense_k))] = _bounds(driver, [(3, 17, 40, 40, used)])
    assert len_k == (14 if used is None else min(max(used, 0), 14))
    assert dense_k == (40 if used is None else min(max(used, 0), 40))
