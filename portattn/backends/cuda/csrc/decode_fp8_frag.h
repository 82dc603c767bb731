// Register fragments of the FP8 decode's register path (decode_kernel.cuh with kFp8Regs;
// Note [portattn fp8 register fragments] in docs/decode.md): where a stage's e4m3 bytes sit
// in shared memory, the ldmatrix addresses that bring them straight into mma operand
// registers, the byte selections that spread them for fp8::e4m3x2_from_spread, and the
// head-dim permutations of Q and O that match. Everything the kernel decides about the
// layout is here and host-callable: tests/test_decode_fp8_frag.py dumps these maps on a
// machine without a GPU and checks them against an emulation of ldmatrix and mma.
//
// With g = lane / 4, q = lane % 4 (fragment conventions: ptx.cuh):
// - K is the B operand of S = Q K^T (k = head dim). ldmatrix (b16, not transposed) of 8 key
//   rows x 16 bytes gives lane (g, q) bytes 4q .. 4q + 3 of key g: dims 4q .. 4q + 3. They
//   serve as B rows k = 2q, 2q + 1 (dims 4q, 4q + 1) and k = 8 + 2q, 9 + 2q (dims 4q + 2,
//   4q + 3): the mma's k runs over the 16 dims in another order, which leaves the dot product
//   unchanged once Q's A fragment is read in the same order (q_col).
// - V is the B operand of O = P V (k = key). ldmatrix.trans of the same kind of matrix gives
//   lane (g, q) the 16-bit pair (dims 2g, 2g + 1) of keys 2q and 2q + 1: bytes
//   (V[2q][2g], V[2q][2g+1], V[2q+1][2g], V[2q+1][2g+1]). The first and third bytes are B
//   column n = g of an mma whose n runs over the even dims, the second and fourth that of
//   one over the odd dims; O's columns come out interleaved (o_col), which only the write
//   of O to shared memory at the end has to know.
// Keys keep their order, so masking, ALiBi and P's A fragments are the 16-bit path's.
#pragma once
#include <stdint.h>

#include "ptx.cuh"

namespace portattn {
namespace cuda {
namespace fp8_frag {

// One stage's e4m3 rows of K (or of V): kStageKeys rows of kHeadDim bytes, viewed as 16-bit
// pairs and stored as a ptx::SwizzledTile, so that the 8 rows of one ldmatrix matrix land in
// 8 different bank groups. Rows are padded to a multiple of 64 bytes (head dims 32, 96, 160
// and 224; the padding is never loaded or read).
template <int kHeadDim, int kStageKeys, int kWarpKeys>
struct StageLayout {
  using Tile = ptx::SwizzledTile<kStageKeys, (kHeadDim / 2 + 31) / 32 * 32>;
  static constexpr int kTileBytes = Tile::kBytes;
  static constexpr int kPairs = kHeadDim / 32;  // pairs of 16-byte chunks: one ldmatrix.x4 per 16 keys
  static constexpr int kBlocks = kWarpKeys / 16;  // 16-key blocks of a warp
  static_assert(kHeadDim % 32 == 0 && kWarpKeys % 16 == 0, "whole chunk pairs and 16-key blocks");

  // Where the loader puts bytes col .. col + 15 of key row `row` (col a multiple of 16).
  static __host__ __device__ uint32_t offset(int row, int col) { return Tile::offset(row, col / 2); }

  // The per-lane part of warp `warp`'s ldmatrix addresses. Lane l addresses row l % 8 of
  // matrix l / 8; matrices 0-3 are (keys 0-7, chunk 2p), (keys 8-15, chunk 2p),
  // (keys 0-7, chunk 2p + 1), (keys 8-15, chunk 2p + 1) of a 16-key block and chunk pair p.
  static __host__ __device__ uint32_t lane_part(int warp, int lane) {
    return Tile::lane(warp * kWarpKeys + lane % 8 + ((lane / 8) % 2) * 8, lane / 16);
  }

  // Tile-relative address of 16-key block `block` of the warp's keys and chunk pair `pair`
  // (dims 32 pair .. 32 pair + 31); block and pair are compile-time in the kernel, so this is
  // one LOP3 or an immediate.
  static __host__ __device__ uint32_t address(uint32_t lane_part, int block, int pair) {
    return (lane_part ^ Tile::chunk_xor(2 * pair)) + Tile::fixed(block * 16, 2 * pair);
  }
};

// The four ldmatrix registers raw[0..3] of one (block, pair) feed two mma_m16n16 calls, one per
// chunk h of the pair: operand b[i] is __byte_perm(raw[2 h + source(i)], 0, selector(i)),
// which puts two e4m3 bytes into the high bytes of two 16-bit lanes (fp8::spread_low's form).
// K: raw[2h] holds keys 0-7, raw[2h + 1] keys 8-15; b[0] = dims (4q, 4q + 1), b[1] = (4q + 2,
// 4q + 3) of the first n8 tile (keys 0-7), b[2], b[3] the same of the second.
__host__ __device__ constexpr int key_source(int i) { return i / 2; }
__host__ __device__ constexpr uint32_t key_selector(int i) { return i % 2 == 0 ? 0x1404u : 0x3424u; }
// V: raw[2h] holds keys 2q, 2q + 1, raw[2h + 1] keys 8 + 2q, 9 + 2q; b[0], b[1] are the
// even-dim n8 tile's (dim 2g), b[2], b[3] the odd-dim one's (dim 2g + 1).
__host__ __device__ constexpr int value_source(int i) { return i % 2; }
__host__ __device__ constexpr uint32_t value_selector(int i) { return i < 2 ? 0x2404u : 0x3414u; }

// Head-dim column of the pair (col, col + 1) in Q's A register a[2 half + r] of 16-dim chunk
// kk (rows g + 8 r): the K order above. The 16-bit path reads kk * 16 + 8 half + 2q.
__host__ __device__ constexpr int q_col(int kk, int half, int lane) { return kk * 16 + 4 * (lane % 4) + 2 * half; }

// Head-dim column of accumulator o[r][c]: mma_m16n16 n16 block c / 4 covers dims
// 16 (c / 4) .. + 15, its first n8 tile the even ones, its second the odd ones, so a lane holds
// the four consecutive dims 16 (c / 4) + 4q .. + 3. The 16-bit path: (c / 2) 8 + 2q + c % 2.
__host__ __device__ constexpr int o_col(int c, int lane) {
  return (c / 4) * 16 + 4 * (lane % 4) + 2 * (c % 2) + (c / 2) % 2;
}

}  // namespace fp8_frag
}  // namespace cuda
}  // namespace portattn
