"""The reference backend's dropout mask against Philox4x32-10 itself and against philox.h.

Three independent witnesses: Random123's known-answer vectors, a plain-Python integer
Philox written here, and the C header compiled with g++.
"""
from __future__ import annotations

import ctypes
import pathlib
import shutil
import subprocess

import pytest
import torch

from portattn.backends import reference
from portattn.backends.reference import (
    dropout_threshold,
    philox4x32_10,
    philox_keep_mask,
    philox_random,
)

M32 = 0xFFFFFFFF
HEADER_DIR = pathlib.Path(reference.__file__).parent / "common"

# Random123 kat_vectors, philox4x32 with 10 rounds: (counter, key, result).
KAT_VECTORS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M32, M32, M32, M32), (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


def python_philox(counter, key):
    """Philox4x32-10 on Python ints, straight from Salmon et al. (SC'11)."""
    x, y, z, w = counter
    k0, k1 = key
    for _ in range(10):
        p0 = 0xD2511F53 * x
        p1 = 0xCD9E8D57 * z
        x, y, z, w = (p1 >> 32) ^ y ^ k0, p1 & M32, (p0 >> 32) ^ w ^ k1, p0 & M32
        k0 = (k0 + 0x9E3779B9) & M32
        k1 = (k1 + 0xBB67AE85) & M32
    return x, y, z, w


def python_draw(seed, offset, bh, i, j):
    """philox.h's r(b, h, i, j) for one entry, from Note [portattn dropout mask]."""
    counter = (j // 4, i, bh, offset & M32)
    key = (seed & M32, ((seed >> 32) ^ (offset >> 32)) & M32)
    return python_philox(counter, key)[j % 4]


@pytest.mark.parametrize("counter,key,expected", KAT_VECTORS)
def test_known_answer_vectors(counter, key, expected):
    assert python_philox(counter, key) == expected
    got = tuple(int(r) for r in philox4x32_10(counter, *key))
    assert got == expected


def test_torch_philox_matches_python_on_random_words():
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(0, 2**32, (4, 200), generator=gen, dtype=torch.int64)
    extremes = torch.tensor([[0, 1, M32, M32 - 1, 2**31, 2**31 - 1]] * 4, dtype=torch.int64)
    words = torch.cat([words, extremes], dim=1)
    keys = [(0, 0), (M32, M32), (0x12345678, 0x9ABCDEF0), (1, 2**31)]
    for key in keys:
        got = torch.stack(philox4x32_10(tuple(words), *key))
        for n in range(words.shape[1]):
            expected = python_philox(tuple(int(c) for c in words[:, n]), key)
            assert tuple(int(r) for r in got[:, n]) == expected, (key, n)


SEED_OFFSETS = [(0, 0), (42, 7), (2**63 + 12345, 2**40 + 3), (M32, 2**64 - 1)]


@pytest.mark.parametrize("seed,offset", SEED_OFFSETS)
def test_draws_follow_the_counter_layout(seed, offset):
    bh = torch.tensor([[0, 1, 5], [6, 7, 11]])  # (b, h) = b * nheads + h with nheads = 6
    rows, cols = range(0, 6), range(3, 14)  # start off a four-column group
    draws = philox_random(seed, offset, bh, rows, cols)
    assert draws.shape == (2, 3, 6, 11)
    for a in range(2):
        for c in range(3):
            for r, i in enumerate(rows):
                for s, j in enumerate(cols):
                    assert int(draws[a, c, r, s]) == python_draw(seed, offset, int(bh[a, c]), i, j)


def test_column_chunks_agree_with_the_whole_row():
    whole = philox_random(9, 3, torch.arange(4), range(5), range(37))
    for j0, j1 in [(0, 4), (1, 2), (5, 11), (30, 37)]:
        part = philox_random(9, 3, torch.arange(4), range(5), range(j0, j1))
        assert torch.equal(part, whole[..., j0:j1])
    picked = philox_random(9, 3, torch.arange(4), torch.tensor([4, 0]), torch.tensor([36, 2, 17]))
    assert torch.equal(picked, whole[:, [4, 0]][:, :, [36, 2, 17]])


def test_threshold_rounds_p_through_float32():
    assert dropout_threshold(0.0) == 0
    assert dropout_threshold(0.5) == 2**31
    assert dropout_threshold(1.0) == M32
    # 0.1 is 0.100000001490116... as a float32: floor(that * 2^32), not of the double.
    assert dropout_threshold(0.1) == 429496736
    assert int(0.1 * 2**32) == 429496729


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_fraction_is_one_minus_p(p):
    keep = philox_keep_mask(1234, 0, torch.arange(8), range(64), range(64), p)
    n = keep.numel()
    # Binomial: 6 standard deviations is a test that fails only for a wrong mask.
    assert abs(keep.float().mean().item() - (1 - p)) < 6 * (p * (1 - p) / n) ** 0.5
    assert philox_keep_mask(1234, 0, torch.arange(8), range(64), range(64), 0.0).all()


def test_offset_and_seed_change_the_mask():
    base = philox_keep_mask(1, 0, torch.arange(2), range(16), range(16), 0.5)
    for seed, offset in [(2, 0), (1, 4), (1, 2**32), (1 + 2**32, 0)]:
        other = philox_keep_mask(seed, offset, torch.arange(2), range(16), range(16), 0.5)
        assert not torch.equal(base, other), (seed, offset)


_C_SOURCE = r"""
#include "philox.h"
extern "C" void draws(uint64_t seed, uint64_t offset, int bh, int rows, int cols,
                      uint32_t* out) {
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < cols; ++j) {
      const portattn::Philox4 r = portattn::dropout_random4(seed, offset, bh, i, j & ~3);
      const uint32_t words[4] = {r.x, r.y, r.z, r.w};
      out[i * cols + j] = words[j % 4];
    }
}
extern "C" uint32_t threshold(float p) { return portattn::dropout_threshold(p); }
"""


@pytest.fixture(scope="module")
def philox_h(tmp_path_factory):
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("g++ not found: cannot compile backends/common/philox.h")
    folder = tmp_path_factory.mktemp("philox_h")
    source = folder / "philox_h.cpp"
    source.write_text(_C_SOURCE)
    library = folder / "philox_h.so"
    subprocess.run(
        [compiler, "-O2", "-shared", "-fPIC", f"-I{HEADER_DIR}", str(source), "-o", str(library)],
        check=True,
    )
    lib = ctypes.CDLL(str(library))
    lib.draws.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.POINTER(ctypes.c_uint32)]
    lib.draws.restype = None
    lib.threshold.argtypes = [ctypes.c_float]
    lib.threshold.restype = ctypes.c_uint32
    return lib


@pytest.mark.parametrize("seed,offset", SEED_OFFSETS)
def test_matches_compiled_header(philox_h, seed, offset):
    rows, cols = 19, 45
    for bh in [0, 1, 13, 2**20 + 7]:
        buffer = (ctypes.c_uint32 * (rows * cols))()
        philox_h.draws(seed, offset, bh, rows, cols, buffer)
        expected = torch.tensor(list(buffer), dtype=torch.int64).view(rows, cols)
        assert torch.equal(philox_random(seed, offset, bh, range(rows), range(cols)), expected)


def test_threshold_matches_compiled_header(philox_h):
    for p in [0.0, 1e-7, 0.1, 0.17, 0.3333, 0.5, 0.9, 0.99999994, 1.0]:
        assert dropout_threshold(p) == philox_h.threshold(p), p
