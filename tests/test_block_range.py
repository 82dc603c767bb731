"""common/block_range.h on the CPU: every helper against a brute-force reading of the
masking rule of Note [portattn semantics] (params.h), exhaustively over small lengths,
windows and block sizes (the header is host/device code; here it is compiled as plain C++).

Rows past len_q (and, for the key-block side, keys past len_k) are in the grids on
purpose: the CUDA forward kernels pass whole query blocks, and the helpers must say
what Note [portattn visible keys] promises for them too.
"""
from __future__ import annotations

import itertools

import pytest
from host_driver import compile_driver, run_driver
LENGTHS = [0, 1, 2, 3, 5, 8]
WINDOWS = [-1, 0, 1, 3]
BLOCKS = [1, 2, 3, 4]
PAST_END = 3  # rows / keys past the sequence in every grid

_DRIVER = r"""
#include <stdio.h>
#include "block_range.h"
// stdin: one query a line, "<op> len_q len_k wl wr a b c d"; stdout: its answer, one line.
//   V i j         -> visible(i, j)
//   K i           -> keys_of_query(i): lo hi
//   R qf ql block -> key_range(qf, ql), key_blocks(qf, ql, block), blocks_of(key_range, block): 9 ints
//   C kf kl block -> the same with query_range, query_blocks
//   T qf ql kf kl -> tile_fully_visible
//   M kind        -> of_kind<kind>: window_left window_right
int main() {
  char op;
  int len_q, len_k, wl, wr, a, b, c, d;
  while (scanf(" %c %d %d %d %d %d %d %d %d", &op, &len_q, &len_k, &wl, &wr, &a, &b, &c, &d) == 9) {
    const portattn::MaskRule rule = portattn::MaskRule::of(len_q, len_k, wl, wr);
    if (op == 'V') {
      printf("%d\n", rule.visible(a, b) ? 1 : 0);
    } else if (op == 'K') {
      const portattn::VisibleSpan s = rule.keys_of_query(a);
      printf("%d %d\n", s.lo, s.hi);
    } else if (op == 'R' || op == 'C') {
      const portattn::IndexRange r = op == 'R' ? rule.key_range(a, b) : rule.query_range(a, b);
      const portattn::IndexRange k = op == 'R' ? rule.key_blocks(a, b, c) : rule.query_blocks(a, b, c);
      const portattn::IndexRange o = portattn::MaskRule::blocks_of(r, c);
      printf("%d %d %d %d %d %d %d %d %d\n", r.begin, r.end, r.size(), k.begin, k.end, k.size(), o.begin, o.end,
             o.size());
    } else if (op == 'T') {
      printf("%d\n", rule.tile_fully_visible(a, b, c, d) ? 1 : 0);
    } else if (op == 'M') {
      portattn::MaskRule m = rule;
      if (a == portattn::kMaskKindNone) m = portattn::MaskRule::of_kind<portattn::kMaskKindNone>(len_q, len_k, wl, wr);
      if (a == portattn::kMaskKindCausal)
        m = portattn::MaskRule::of_kind<portattn::kMaskKindCausal>(len_q, len_k, wl, wr);
      if (a == portattn::kMaskKindLocal) m = portattn::MaskRule::of_kind<portattn::kMaskKindLocal>(len_q, len_k, wl, wr);
      printf("%d %d %d %d %d\n", m.len_q, m.len_k, m.diag, m.window_left, m.window_right);
    } else {
      return 1;
    }
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    return compile_driver(tmp_path_factory, "block_range", _DRIVER)


def _ask(driver, queries):
    """Answers (tuples of ints) to queries (op, len_q, len_k, wl, wr, *up to four ints)."""
    return run_driver(driver, [" ".join(map(str, (*q, *([0] * (9 - len(q)))))) for q in queries])


# ---- the rule, read straight from params.h ------------------------------------------

def in_window(i, j, len_q, len_k, wl, wr):
    """Key j is inside query i's window (lengths not tested)."""
    diag = len_k - len_q
    return (wl < 0 or i + diag - wl <= j) and (wr < 0 or j <= i + diag + wr)


def visible(i, j, len_q, len_k, wl, wr):
    return 0 <= i < len_q and 0 <= j < len_k and in_window(i, j, len_q, len_k, wl, wr)


def interval(indices):
    """(first, end) of a non-empty set that must be one interval, or None when empty."""
    if not indices:
        return None
    first, last = min(indices), max(indices)
    assert sorted(indices) == list(range(first, last + 1)), "the rule promises one interval"
    return first, last + 1


def blocks(indices, block):
    return interval({x // block for x in indices})


def configs():
    return itertools.product(LENGTHS, LENGTHS, WINDOWS, WINDOWS)


def test_visible_is_the_rule(driver):
    queries = [("V", lq, lk, wl, wr, i, j) for lq, lk, wl, wr in configs()
               for i in range(lq + PAST_END) for j in range(lk + PAST_END)]
    for q, (got,) in zip(queries, _ask(driver, queries)):
        assert got == visible(q[5], q[6], *q[1:5]), q


def test_keys_of_query_are_the_rule(driver):
    queries = [("K", lq, lk, wl, wr, i) for lq, lk, wl, wr in configs() for i in range(lq + PAST_END)]
    for q, (lo, hi) in zip(queries, _ask(driver, queries)):
        _, lq, lk, wl, wr, i = q
        # every key that exists and is in query i's window (i itself untested)
        expected = [j < lk and in_window(i, j, lq, lk, wl, wr) for j in range(lk + PAST_END)]
        assert [lo <= j <= hi for j in range(lk + PAST_END)] == expected, q
        assert wl >= 0 or lo == -(2**31), q  # an unbounded left side is INT_MIN: no test of it survives


@pytest.mark.parametrize("op", ["R", "C"])
def test_ranges_and_blocks_are_what_some_row_sees(driver, op):
    queries = [(op, lq, lk, wl, wr, first, last, block) for lq, lk, wl, wr in configs() for block in BLOCKS
               for first in range((lq if op == "R" else lk) + PAST_END)
               for last in range(first, (lq if op == "R" else lk) + PAST_END)]
    for q, (begin, end, size, b_begin, b_end, b_size, o_begin, o_end, o_size) in zip(queries, _ask(driver, queries)):
        _, lq, lk, wl, wr, first, last, block = q
        if op == "R":  # keys that exist and some row first..last (rows untested) sees
            seen = {j for j in range(lk) for i in range(first, last + 1) if in_window(i, j, lq, lk, wl, wr)}
        else:  # queries that exist and see some key first..last (keys untested)
            seen = {i for i in range(lq) for j in range(first, last + 1) if in_window(i, j, lq, lk, wl, wr)}
        expected = interval(seen)
        if expected is None:
            assert size == 0 and begin >= 0 and o_size == 0 and o_begin >= 0, q
        else:
            assert (begin, end, size) == (*expected, expected[1] - expected[0]), q
            expected_blocks = blocks(seen, block)
            assert (o_begin, o_end, o_size) == (*expected_blocks, expected_blocks[1] - expected_blocks[0]), q
        if first >= (lq if op == "R" else lk):
            continue  # the block helpers ask for a row (key) of the sequence: kernels return before asking without
        if expected is None:
            assert b_size == 0 and b_begin >= 0, q
        else:
            expected_blocks = blocks(seen, block)
            assert (b_begin, b_end, b_size) == (*expected_blocks, expected_blocks[1] - expected_blocks[0]), q


def test_tile_fully_visible_is_every_pair_visible(driver):
    queries = [("T", lq, lk, wl, wr, qf, ql, kf, kl) for lq, lk, wl, wr in configs()
               for qf in range(lq + PAST_END) for ql in range(qf, lq + PAST_END)
               for kf in range(lk + PAST_END) for kl in range(kf, lk + PAST_END)]
    for q, (got,) in zip(queries, _ask(driver, queries)):
        _, lq, lk, wl, wr, qf, ql, kf, kl = q
        # rows untested against len_q (Note [portattn visible keys]); keys must exist
        expected = all(j < lk and in_window(i, j, lq, lk, wl, wr)
                       for i in range(qf, ql + 1) for j in range(kf, kl + 1))
        assert got == expected, q


@pytest.mark.parametrize("kind, expected", [(0, lambda wl, wr: (-1, -1)), (1, lambda wl, wr: (-1, 0)),
                                            (2, lambda wl, wr: (wl, wr))])
def test_mask_kind_keeps_only_its_window_sides(driver, kind, expected):
    queries = [("M", 5, 7, wl, wr, kind) for wl in WINDOWS for wr in WINDOWS]
    for q, got in zip(queries, _ask(driver, queries)):
        assert got == (5, 7, 2, *expected(q[3], q[4])), q
