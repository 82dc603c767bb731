"""common/dq_swizzle.h on the CPU: the layout of the Hopper backward's bulk dQ rows (the staging tile
the consumers write and the accumulator the convert kernel reads back).

What the layout must give (the header's comment says why): every aligned group of eight 16-byte chunks
maps onto itself (a permutation, so a row's bytes stay in the row and the convert kernel reads each
element once), and the kernels' staging stores hit 32 different banks per wavefront in both patterns:
the 64-query kernels' 8-byte stores (a half warp at a time: rows g = 0-3 or 4-7) and the 80-query
kernel's 4-byte stores of dQ^T (rows 2 q4 + h: {0, 2, 4, 6} or {1, 3, 5, 7}). The header is host /
device code; here it is compiled as plain C++ and its answers are checked, not a copy of its formula.
"""
from __future__ import annotations

import pytest
from host_driver import compile_driver, run_driver

_DRIVER = r"""
#include <stdio.h>
#include "dq_swizzle.h"
// stdin: lines "row byte"; stdout per line: dq_chunk_key(row) and dq_chunk_swizzle(row, byte).
int main() {
  int row, byte;
  while (scanf("%d %d", &row, &byte) == 2)
    printf("%d %d\n", portattn::cuda::dq_chunk_key(row), portattn::cuda::dq_chunk_swizzle(row, byte));
  return 0;
}
"""

ROW_BYTES = 128 * 4  # an hd128 accumulator row (fp32): a multiple of 128 bytes, as at every head dim
ROWS = range(0, 160)


@pytest.fixture(scope="module")
def swizzle(tmp_path_factory):
    driver = compile_driver(tmp_path_factory, "dq_swizzle", _DRIVER)
    lines = [f"{row} {byte}" for row in ROWS for byte in range(0, ROW_BYTES, 4)]
    answers = run_driver(driver, lines)
    table = {}
    for line, (key, at) in zip(lines, answers):
        row, byte = map(int, line.split())
        table[row, byte] = (key, at)
    return table


def test_each_row_is_a_permutation_of_its_chunk_groups(swizzle):
    for row in ROWS:
        keys = {swizzle[row, byte][0] for byte in range(0, ROW_BYTES, 4)}
        assert len(keys) == 1 and 0 <= keys.pop() < 8
        targets = [swizzle[row, byte][1] for byte in range(0, ROW_BYTES, 4)]
        assert sorted(targets) == list(range(0, ROW_BYTES, 4)), row
        for byte in range(0, ROW_BYTES, 4):
            at = swizzle[row, byte][1]
            assert at // 128 == byte // 128 and at % 16 == byte % 16, (row, byte, at)
    assert sorted(swizzle[row, 0][0] for row in range(8)) == list(range(8))


def _wavefronts(addresses: list) -> int:
    """Shared-memory wavefronts one request of these 4-byte word addresses takes: the most distinct
    words any of the 32 banks is asked for."""
    banks = {}
    for address in addresses:
        banks.setdefault((address // 4) % 32, set()).add(address // 4)
    return max(len(words) for words in banks.values())


def _staged(swizzle, row: int, byte: int) -> int:
    return row * ROW_BYTES + swizzle[row, byte][1]


def test_the_64_query_kernels_8_byte_stores_are_conflict_free(swizzle):
    # Lane (g, q4) writes 8 bytes of row g at chunk 2 j + (q4 >> 1) of its column group col0 (two
    # consumers of 64 columns, or hd64's 32-column halves), half 8 (q4 & 1); the hardware serves a
    # 64-bit store a half warp (16 lanes) at a time.
    for col0 in (0, 32, 64):
        for j in range(8 if col0 == 0 else 4):
            for half in (0, 1):
                words = []
                for lane in range(16 * half, 16 * half + 16):
                    g, q4 = divmod(lane, 4)
                    byte = 4 * col0 + 16 * (2 * j + (q4 >> 1)) + 8 * (q4 & 1)
                    words += [_staged(swizzle, g, byte), _staged(swizzle, g, byte + 4)]
                assert _wavefronts(words) == 1, (col0, j, half)


def test_the_80_query_kernels_transposed_stores_are_conflict_free(swizzle):
    # dQ^T's element (column wg * 64 + warp * 16 + g + 8 r, query 8 j + 2 q4 + h): one 4-byte store a
    # (r, j, h), all 32 lanes at once.
    for wg in (0, 1):
        for warp in range(4):
            for r in (0, 1):
                for h in (0, 1):
                    for j in range(10):
                        words = []
                        for lane in range(32):
                            g, q4 = divmod(lane, 4)
                            words.append(_staged(swizzle, 8 * j + 2 * q4 + h, 4 * (wg * 64 + warp * 16 + g + 8 * r)))
                        assert _wavefronts(words) == 1, (wg, warp, r, h, j)
