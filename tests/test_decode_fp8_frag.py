"""The FP8 decode's register path (Note [portattn fp8 register fragments] in docs/decode.md) checked
on the CPU: csrc/decode_fp8_frag.h and the kernel's tile configuration are compiled host-side with
nvcc, their maps dumped for every instantiated head dim, and a warp's S = Q K^T and O = P V are
replayed from them through an emulation of ldmatrix (plain and .trans), __byte_perm and
mma.m16n8k16 (fragment layouts of the PTX ISA, as ptx.cuh writes them down), then compared with
float64 matrix products of the decoded e4m3 bytes.

What this cannot check: the hardware's agreement with the emulated instructions and the
e4m3 -> 16-bit conversion itself (fp8.cuh); tests/gpu/test_cuda_decode_fp8.py runs the FP8 paths
on a GPU.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess

import numpy as np
import pytest

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "portattn", "backends", "cuda", "csrc")
COMMON = os.path.join(ROOT, "portattn", "backends", "common")


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _load("_portattn_cuda_build_fp8_frag", os.path.join(ROOT, "portattn", "backends", "cuda", "build.py"))
HEAD_DIMS = build.variants.HEAD_DIMS

_DRIVER = r"""
#include <stdio.h>
#include "decode_kernel.cuh"

using namespace portattn::cuda;

template <int kHeadDim>
void dump(bool last) {
  using Config = DecodeTileConfig<kHeadDim, true, true>;
  using Layout = typename Config::RawLayout;
  printf("\"%d\": {\"stage_keys\": %d, \"warp_keys\": %d, \"warps\": %d, \"raw_tile_bytes\": %d, "
         "\"load_stage_bytes\": %d, \"smem_bytes\": %d, \"rows_per_step\": %d, \"panel_row_bytes\": %d,\n",
         kHeadDim, Config::kStageKeys, Config::kWarpKeys, Config::kWarps, Config::kRawTileBytes,
         Config::kLoadStageBytes, Config::kSmemBytes, Config::kLoadRowsPerStep, Layout::Tile::kPanelRowBytes);
  using Deep = DecodeTileConfig<kHeadDim, true, true, kFp8DeepStages>;
  printf("\"deep_stages\": %d, \"deep_load_stage_bytes\": %d, \"deep_smem_bytes\": %d,\n", Deep::kStages,
         Deep::kLoadStageBytes, Deep::kSmemBytes);
  printf("\"offset\": [");
  for (int row = 0; row < Config::kStageKeys; ++row)
    for (int chunk = 0; chunk < kHeadDim / 16; ++chunk)
      printf("%s%u", row + chunk ? "," : "", Layout::offset(row, chunk * 16));
  printf("],\n\"address\": [");  // [warp][lane][block][pair]
  bool first = true;
  for (int warp = 0; warp < Config::kWarps; ++warp)
    for (int lane = 0; lane < 32; ++lane)
      for (int block = 0; block < Layout::kBlocks; ++block)
        for (int pair = 0; pair < Layout::kPairs; ++pair) {
          printf("%s%u", first ? "" : ",", Layout::address(Layout::lane_part(warp, lane), block, pair));
          first = false;
        }
  printf("],\n\"q_col\": [");  // [kk][half][lane]
  first = true;
  for (int kk = 0; kk < kHeadDim / 16; ++kk)
    for (int half = 0; half < 2; ++half)
      for (int lane = 0; lane < 32; ++lane) {
        printf("%s%d", first ? "" : ",", fp8_frag::q_col(kk, half, lane));
        first = false;
      }
  printf("],\n\"o_col\": [");  // [c][lane]
  first = true;
  for (int c = 0; c < kHeadDim / 4; ++c)
    for (int lane = 0; lane < 32; ++lane) {
      printf("%s%d", first ? "" : ",", fp8_frag::o_col(c, lane));
      first = false;
    }
  printf("]}%s\n", last ? "" : ",");
}

int main() {
  printf("{\"key\": [");
  for (int i = 0; i < 4; ++i) printf("%s[%d, %u]", i ? "," : "", fp8_frag::key_source(i), fp8_frag::key_selector(i));
  printf("], \"value\": [");
  for (int i = 0; i < 4; ++i)
    printf("%s[%d, %u]", i ? "," : "", fp8_frag::value_source(i), fp8_frag::value_selector(i));
  printf("], \"head_dims\": {\n");
  HEAD_DIM_CALLS
  printf("}}\n");
  return 0;
}
"""


@pytest.fixture(scope="module")
def maps(tmp_path_factory):
    nvcc = build.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found: cannot compile csrc/decode_fp8_frag.h host-side")
    folder = tmp_path_factory.mktemp("decode_fp8_frag")
    calls = "\n  ".join(f"dump<{d}>({'true' if i == len(HEAD_DIMS) - 1 else 'false'});"
                        for i, d in enumerate(HEAD_DIMS))
    source = folder / "dump.cu"
    source.write_text(_DRIVER.replace("HEAD_DIM_CALLS", calls))
    binary = folder / "dump"
    subprocess.run([nvcc, "-std=c++17", "-arch=sm_80", f"-I{CSRC}", f"-I{COMMON}", str(source), "-o", str(binary)],
                   check=True)
    text = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout
    return json.loads(text)


def _tables(maps, head_dim):
    m = maps["head_dims"][str(head_dim)]
    warps, blocks, pairs = m["warps"], m["warp_keys"] // 16, head_dim // 32
    m["offset_of"] = np.array(m["offset"]).reshape(m["stage_keys"], head_dim // 16)
    m["address_of"] = np.array(m["address"]).reshape(warps, 32, blocks, pairs)
    m["q_col_of"] = np.array(m["q_col"]).reshape(head_dim // 16, 2, 32)
    m["o_col_of"] = np.array(m["o_col"]).reshape(head_dim // 4, 32)
    return m


# ---- emulated instructions (PTX ISA; ptx.cuh's fragment conventions) -------------------------

def ldmatrix_x4(smem: np.ndarray, addresses, trans: bool):
    """regs[lane][m] (uint32) of ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lane l gives
    the address of row l % 8 of matrix l / 8 (16 bytes)."""
    regs = np.zeros((32, 4), dtype=np.uint64)
    for m in range(4):
        rows = [smem[addresses[8 * m + r] : addresses[8 * m + r] + 16] for r in range(8)]
        for lane in range(32):
            g, q = lane // 4, lane % 4
            if trans:  # b16 elements (2q, g) low, (2q + 1, g) high
                b = [rows[2 * q][2 * g], rows[2 * q][2 * g + 1], rows[2 * q + 1][2 * g], rows[2 * q + 1][2 * g + 1]]
            else:  # b16 elements (g, 2q) low, (g, 2q + 1) high
                b = list(rows[g][4 * q : 4 * q + 4])
            regs[lane, m] = sum(int(x) << (8 * i) for i, x in enumerate(b))
    return regs


def byte_perm_zero(x: int, selector: int) -> int:
    """__byte_perm(x, 0, selector) for selectors whose nibbles are < 8 (no sign replication)."""
    out = 0
    for i in range(4):
        n = (selector >> (4 * i)) & 0xF
        assert n < 8
        byte = (x >> (8 * n)) & 0xFF if n < 4 else 0
        out |= byte << (8 * i)
    return out


E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double().numpy()


def spread_values(word: int):
    """The two values fp8::e4m3x2_from_spread makes of a spread word: each 16-bit lane holds an e4m3
    byte in its high byte and zero in its low byte."""
    lanes = (word & 0xFFFF, word >> 16)
    assert all(lane & 0xFF == 0 for lane in lanes), "a spread lane's low byte must be 0"
    return E4M3[lanes[0] >> 8], E4M3[lanes[1] >> 8]


def mma_m16n8k16(acc, a, b0, b1):
    """acc[lane][4] += A B with a[lane][4] and b0/b1[lane] value pairs in the m16n8k16 fragment
    layouts (A rows g, g + 8 x columns 2q.., 8 + 2q..; B rows 2q.., 8 + 2q.. x column g; C rows g,
    g + 8 x columns 2q, 2q + 1). Every element of A and B must be given exactly once, consistently."""
    A = np.full((16, 16), np.nan)
    B = np.full((16, 8), np.nan)
    for lane in range(32):
        g, q = lane // 4, lane % 4
        for j in range(2):
            for reg, (row, col) in enumerate([(g, 2 * q), (g + 8, 2 * q), (g, 8 + 2 * q), (g + 8, 8 + 2 * q)]):
                assert np.isnan(A[row, col + j]) or A[row, col + j] == a[lane][reg][j]
                A[row, col + j] = a[lane][reg][j]
            B[2 * q + j, g] = b0[lane][j]
            B[8 + 2 * q + j, g] = b1[lane][j]
    assert not np.isnan(A).any() and not np.isnan(B).any()
    D = A @ B
    for lane in range(32):
        g, q = lane // 4, lane % 4
        acc[lane][0] += D[g, 2 * q]
        acc[lane][1] += D[g, 2 * q + 1]
        acc[lane][2] += D[g + 8, 2 * q]
        acc[lane][3] += D[g + 8, 2 * q + 1]


def mma_m16n16(acc, n16, a, b):
    """fwd_kernel.cuh's mma_m16n16 with mt = 0: acc[lane][r][c] (c = 4 n16 .. 4 n16 + 3) += A B for
    two n8 tiles, b[lane][0..1] the first, b[lane][2..3] the second."""
    for tile in range(2):
        part = [[acc[lane][0][4 * n16 + 2 * tile], acc[lane][0][4 * n16 + 2 * tile + 1],
                 acc[lane][1][4 * n16 + 2 * tile], acc[lane][1][4 * n16 + 2 * tile + 1]] for lane in range(32)]
        mma_m16n8k16(part, a, [b[lane][2 * tile] for lane in range(32)], [b[lane][2 * tile + 1] for lane in range(32)])
        for lane in range(32):
            acc[lane][0][4 * n16 + 2 * tile], acc[lane][0][4 * n16 + 2 * tile + 1] = part[lane][0], part[lane][1]
            acc[lane][1][4 * n16 + 2 * tile], acc[lane][1][4 * n16 + 2 * tile + 1] = part[lane][2], part[lane][3]


# ---- the maps -----------------------------------------------------------------------------

@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_stage_layout_is_a_bijection_that_ldmatrix_reads_without_bank_conflicts(maps, head_dim):
    m = _tables(maps, head_dim)
    offsets = m["offset_of"]
    assert len(set(offsets.flatten().tolist())) == offsets.size, "two chunks share a place"
    assert (offsets % 16 == 0).all() and offsets.max() + 16 <= m["raw_tile_bytes"]
    assert m["load_stage_bytes"] == 2 * m["raw_tile_bytes"]
    # Three raw stages and nothing else: no converted stage on this path.
    assert m["smem_bytes"] == max(3 * m["load_stage_bytes"], m["warps"] * 16 * (head_dim + 1) * 4)
    # regs_deep (Note [portattn fp8 deep pipeline]): the same stages, 5 of them, still nothing else; the
    # warps' merge buffer fits in the ring; 80 KiB at head dims 64, 128 and 256, within a 99 KiB part.
    assert m["deep_load_stage_bytes"] == m["load_stage_bytes"] and m["deep_stages"] == 5
    assert m["deep_smem_bytes"] == 5 * m["load_stage_bytes"] >= m["warps"] * 16 * (head_dim + 1) * 4
    assert m["deep_smem_bytes"] <= 99 * 1024
    if head_dim in (64, 128, 256):
        assert m["deep_smem_bytes"] == 80 * 1024
    # decode_kernel.cuh's loader steps rows by rows_per_step from one base offset when that is a
    # multiple of 8; the swizzle must then keep its bits.
    if m["rows_per_step"] % 8 == 0:
        step = m["rows_per_step"]
        assert (offsets[step:] == offsets[:-step] + step * m["panel_row_bytes"]).all()
    address = m["address_of"]
    for warp in range(m["warps"]):
        for block in range(m["warp_keys"] // 16):
            for pair in range(head_dim // 32):
                for matrix in range(4):
                    lanes = range(8 * matrix, 8 * matrix + 8)
                    got = [address[warp, lane, block, pair] for lane in lanes]
                    row0 = warp * m["warp_keys"] + block * 16 + (matrix % 2) * 8
                    want = [offsets[row0 + r, 2 * pair + matrix // 2] for r in range(8)]
                    assert got == want, (warp, block, pair, matrix)
                    assert len({(a % 128) // 16 for a in got}) == 8, "bank conflict in one ldmatrix matrix"


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_q_and_o_permutations_are_bijections(maps, head_dim):
    m = _tables(maps, head_dim)
    q_col, o_col = m["q_col_of"], m["o_col_of"]
    for q in range(4):  # the four lanes of a row group hold its columns between them
        lanes = [4 * g + q for g in range(8)]
        assert all((q_col[:, :, lane] == q_col[:, :, q]).all() for lane in lanes), "q_col depends on g"
        assert all((o_col[:, lane] == o_col[:, q]).all() for lane in lanes), "o_col depends on g"
    pairs = sorted(c + j for c in q_col[:, :, :4].flatten().tolist() for j in range(2))
    assert pairs == list(range(head_dim)), "Q's fragments miss or repeat a head-dim column"
    assert sorted(o_col[:, :4].flatten().tolist()) == list(range(head_dim)), "O's registers miss or repeat a column"


# ---- S = Q K^T and O = P V of one stage, replayed -------------------------------------------

@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_warp_products_match_float64(maps, head_dim):
    m = _tables(maps, head_dim)
    rng = np.random.default_rng(head_dim)
    keys, wk = m["stage_keys"], m["warp_keys"]
    # Every e4m3 byte but the NaNs (0x7f, 0xff), subnormals and zeros included.
    finite = np.array([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=np.uint8)
    tiles, logical = [], []
    for _ in range(2):  # K, V
        rows = rng.choice(finite, size=(keys, head_dim))
        smem = np.zeros(m["raw_tile_bytes"], dtype=np.uint8)
        for row in range(keys):
            for chunk in range(head_dim // 16):
                at = m["offset_of"][row, chunk]
                smem[at : at + 16] = rows[row, 16 * chunk : 16 * chunk + 16]
        tiles.append(smem)
        logical.append(E4M3[rows])
    K, V = logical
    Q = rng.standard_normal((16, head_dim))
    key_ops, value_ops = maps["key"], maps["value"]
    for warp in range(m["warps"]):
        # Q's A fragments in q_col's order.
        qa = [[[(Q[lane // 4 + 8 * r, c], Q[lane // 4 + 8 * r, c + 1])
                for half in range(2) for r in range(2)
                for c in [m["q_col_of"][kk, half, lane]]]
               for kk in range(head_dim // 16)] for lane in range(32)]
        s = [[[0.0] * (wk // 4) for _ in range(2)] for _ in range(32)]
        for pair in range(head_dim // 32):
            for np_ in range(wk // 16):
                raw = ldmatrix_x4(tiles[0], [m["address_of"][warp, lane, np_, pair] for lane in range(32)], False)
                for h in range(2):
                    b = [[spread_values(byte_perm_zero(int(raw[lane, 2 * h + src]), sel)) for src, sel in key_ops]
                         for lane in range(32)]
                    mma_m16n16(s, np_, [qa[lane][2 * pair + h] for lane in range(32)], b)
        for lane in range(32):
            g, q = lane // 4, lane % 4
            for r in range(2):
                for c in range(wk // 4):
                    key = warp * wk + (c // 2) * 8 + 2 * q + c % 2  # decode_kernel.cuh's key of s[r][c]
                    assert s[lane][r][c] == pytest.approx(Q[g + 8 * r] @ K[key], rel=1e-12, abs=1e-12)

        # P V: P of this warp's keys in the score registers' layout, packed as the kernel packs it.
        P = rng.random((16, wk))
        sP = [[[P[lane // 4 + 8 * r, (c // 2) * 8 + 2 * (lane % 4) + c % 2] for c in range(wk // 4)] for r in range(2)]
              for lane in range(32)]
        o = [[[0.0] * (head_dim // 4) for _ in range(2)] for _ in range(32)]
        for kk in range(wk // 16):
            p = [[(sP[lane][0][4 * kk], sP[lane][0][4 * kk + 1]), (sP[lane][1][4 * kk], sP[lane][1][4 * kk + 1]),
                  (sP[lane][0][4 * kk + 2], sP[lane][0][4 * kk + 3]), (sP[lane][1][4 * kk + 2], sP[lane][1][4 * kk + 3])]
                 for lane in range(32)]
            for pair in range(head_dim // 32):
                raw = ldmatrix_x4(tiles[1], [m["address_of"][warp, lane, kk, pair] for lane in range(32)], True)
                for h in range(2):
                    b = [[spread_values(byte_perm_zero(int(raw[lane, 2 * h + src]), sel)) for src, sel in value_ops]
                         for lane in range(32)]
                    mma_m16n16(o, 2 * pair + h, p, b)
        want = P @ V[warp * wk : (warp + 1) * wk]
        for lane in range(32):
            for r in range(2):
                for c in range(head_dim // 4):
                    col = m["o_col_of"][c, lane]
                    assert o[lane][r][c] == pytest.approx(want[lane // 4 + 8 * r, col], rel=1e-12, abs=1e-12)
