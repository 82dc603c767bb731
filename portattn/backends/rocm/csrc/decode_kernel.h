// Split-KV decode on CDNA matrix cores (gfx90a, gfx942, gfx950): few query rows
// against many keys, read in place from a contiguous cache, a paged cache or
// packed (varlen) sequences. Design: Note [portattn decode] in
// common/params.h; the sequence, page and key-range rules (with every
// device-read value clamped) are common/decode_sequence.h's.
//
// Tile configuration (DecodeTile): a workgroup owns 16 packed query rows
// (row = query * group + head-in-group) of one (sequence, KV head) and one key
// split; 4 waves take 16 different keys each of every 64-key stage, so a
// wave's score tile is one 16x16 MFMA tile and P never leaves registers:
//   S^T (16 keys x 16 rows)  = K (16 x D) . Q^T (D x 16)     D/16 MFMAs
//   O^T (D x 16 rows)       += V^T (D x 16) . P^T (16 x 16)   D/16 MFMAs
// transposed, as in the forward, so the four score registers of a lane are
// the B operand of the second product (16x16x16 layout in cdna.h).
//
// Why 16x16x16 and not the forward's 32x32x8: a decode tile has g * seqlen_q
// rows (g = 4-8 for common GQA models, seqlen_q = 1), so a 32-row tile would
// be 75-88% padding and would double the per-lane score and O registers
// (16 vs 4 score registers, D/2 vs D/4 O registers) for no extra bandwidth;
// the decode is bound by reading K and V once, and 16 rows is also the CUDA
// kernel's tile, so the split planner (portattn/decode.py) counts the same
// tiles for both vendors.
//
// No LDS for K and V. The contraction index of Q K^T and the output index of
// V^T P^T may be permuted freely (the first is summed over, the second only
// decides which lane stores which column), so each lane loads its MFMA
// operands straight from global memory with 16-byte reads:
//   K: lane (m = l % 16, g = l / 16) reads row m of its 16 keys, 16-byte chunk
//      c at columns 32c + 8g (4 lanes cover 64 contiguous bytes of a row per
//      read); MFMA step 2c + h uses the chunk's elements 4h..4h+3, and Q is
//      read into the B operand with the same column mapping.
//   V: lane (m, g) reads columns [m D/16, (m+1) D/16) of keys 4g..4g+3 (16
//      lanes cover a whole row per read); O^T tile u's row m is column
//      m D/16 + u, so at the end a lane owns the D/4 contiguous output
//      columns [g D/4, (g+1) D/4) of query row m.
// With kPrefetch the next stage's K/V reads are in flight in registers while
// this stage computes. LDS only merges the waves' (O, LSE) at the end: waves
// 1-3 leave LSE-weighted O in LDS (fp32, rows padded by 4 floats), wave 0
// adds its own and writes out (one split) or the fp32 partials.
//
// Budget per variant (16x16x16 MFMAs per wave per 64-key stage; registers per
// lane; VGPR+AGPR of 512 per SIMD lane, 64 KiB LDS per CU); numbers are data
// in variants.py (CONFIGS), checked on the compiled code by
// tests/test_rocm_isa.py:
//   D    LDS bytes  MFMA/stage  K+V regs per stage  waves/SIMD (LDS allows)  budget
//   64   13312      8           16 (x2 prefetched)  4 (4)                   <= 128
//   128  25600      16          32 (x2)             2 (2)                   <= 256
//   256  50176      32          64 (x2)             1 (1)                   <= 512
// Measured (VGPR+AGPR total, of which AGPR; gfx90a / gfx942; SGPRs 82-100,
// no spills, no scratch): 64: 116-117, 0 / 124, 0;  128: 178-180, 0 / 178, 0;
// 256: 338-339, 82-83 / 349-350, 93-94.
// gfx950 (clang-22): S^T = K Q^T takes D/32 double-depth 16x16x32 MFMAs (a
// lane's 16-byte K chunk and Q chunk are one operand each; Note [portattn MFMA
// double depth] in cdna.h); O^T += V^T P^T stays D/16 16x16x16 ones, a wave's 16
// keys being one shallow step. MFMA/stage 6 / 12 / 24; measured fp16 / bf16:
// 123 / 124, 176 / 177, 296 (40) / 296 (40); the same LDS and occupancy (at
// D = 256 two workgroups per CU would fit its 160 KiB of LDS, but not 256
// registers: 40 VGPRs spilled with the prefetch; docs/rocm.md, "CDNA4").
// The merge buffer sets the occupancy here (K/V need no LDS); at D = 256 a
// workgroup still keeps 4 waves x 2 stages x 16 KiB of K/V reads in flight.
//
// e4m3 caches (kFp8, Note [portattn fp8 kv cache] in common/params.h): the
// same lane mapping over bytes. A lane reads half the bytes (8-byte K chunks;
// V's D/16 bytes per key in 4- or 8-byte pieces, as fp8 rows are 8-byte
// aligned), the prefetched stage stays raw (half the registers) and is
// converted to the 16-bit operands when its stage starts (fp8.h: exact);
// k_descale[b, hk] is folded into the score scale and v_descale[b, hk]
// multiplies the output (or the split's partial output) before it is stored.
#pragma once
#include <limits.h>
#include <math.h>

#include <type_traits>

#include "cdna.h"  // first: hip_runtime.h defines __forceinline__ for the common headers

#include "../../common/decode_sequence.h"
#include "../../common/online_softmax.h"
#include "../../common/params.h"
#include "decode_common.h"  // KeySource, the split combine, the cache append
#include "fp8.h"
#include "tiles.h"

namespace portattn {
namespace rocm {
namespace PORTATTN_ROCM_ARCH_NS {

template <int kHeadDim_, int kStageKeys_, bool kIsBf16_, int kWavesPerSimd_, bool kPrefetch_>
struct DecodeTile {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kStageKeys = kStageKeys_;  // keys per workgroup per step
  static constexpr bool kIsBf16 = kIsBf16_;
  static constexpr int kWavesPerSimd = kWavesPerSimd_;
  static constexpr bool kPrefetch = kPrefetch_;  // next stage's reads in flight while computing

  static constexpr int kWaves = 4;
  static constexpr int kWaveLanes = kWaveSize;
  static constexpr int kThreads = kWaves * kWaveSize;
  static constexpr int kBlockM = kMfma16;                // packed query rows per workgroup
  static constexpr int kWaveKeys = kStageKeys / kWaves;  // one MFMA tile of keys per wave
  static constexpr int kDimSteps = kHeadDim / kMfma16;   // MFMA steps of S^T = K Q^T
  static constexpr int kDimTiles = kHeadDim / kMfma16;   // O^T accumulators per wave
  static constexpr int kChunks = kHeadDim / 32;          // 16-byte K / Q reads per lane per row
  static constexpr int kVDims = kHeadDim / kMfma16;      // V columns per lane per key
  static constexpr int kVWords = kVDims / 2;             // ... as 32-bit words
  static constexpr int kLaneDims = kHeadDim / 4;         // output columns a lane owns
  static constexpr int kMergePitch = kHeadDim + kLdsPad;  // fp32 per merge row
  static constexpr int kLdsBytes = 4 * ((kWaves - 1) * kBlockM * kMergePitch + kWaves * kBlockM);
  // S^T's steps pair up on CDNA4 (16x16x32); O^T's do not: a wave has only 16 keys.
  static constexpr int kMfmaPerIter = kDimSteps / kStepsPerMfma + kDimTiles;

  static_assert(kWaveKeys == kMfma16, "a wave takes one 16-key MFMA tile per stage");
  static_assert(kHeadDim % 64 == 0 && kHeadDim <= 256, "K chunks of 8 columns x 4 lanes, V words per lane");
  static_assert(kLdsBytes * kWavesPerSimd <= kLdsBytesPerCu, "the designed occupancy must fit a CU's LDS");
};

// This lane's share of one wave's 16 keys, read straight into MFMA operand
// order (see the docblock): K row m's chunks and V's columns of keys 4g..4g+3.
template <class Tile>
struct DecodeKV {
  u32x4 k[Tile::kChunks];
  uint32_t v[4][Tile::kVWords];

  __device__ __forceinline__ void fetch(const KeySource<uint16_t>& src, int key0, int lm, int lg) {
    const int k_key = key0 + lm;
    const bool k_valid = k_key < src.seqlen_k;
    const int64_t k_row = k_valid ? src.at.offset(src.k_strides, src.cache_row, src.key_base + k_key) : 0;
#pragma unroll
    for (int c = 0; c < Tile::kChunks; ++c) {
      const int col = 32 * c + 8 * lg;
      k[c] = u32x4{0u, 0u, 0u, 0u};
      if (k_valid && col < src.headdim) k[c] = load<u32x4>(src.gK + k_row + col);
    }
    const int v_col = lm * Tile::kVDims;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const int key = key0 + 4 * lg + kk;
      // Zero-filled past the sequence: P is 0 there, but 0 * (stale NaN) is not.
      const bool valid = key < src.seqlen_k && v_col < src.headdim;
      const int64_t v_row = valid ? src.at.offset(src.v_strides, src.cache_row, src.key_base + key) : 0;
      if constexpr (Tile::kVWords % 4 == 0) {
#pragma unroll
        for (int w = 0; w < Tile::kVWords; w += 4) {
          u32x4 words{0u, 0u, 0u, 0u};
          // headdim is a multiple of 8: a 16-byte piece is wholly inside or outside it.
          if (valid && v_col + 2 * w < src.headdim) words = load<u32x4>(src.gV + v_row + v_col + 2 * w);
          v[kk][w] = words.x, v[kk][w + 1] = words.y, v[kk][w + 2] = words.z, v[kk][w + 3] = words.w;
        }
      } else {
        static_assert(Tile::kVWords == 2, "D = 64: one 8-byte piece per key");
        u32x2 words{0u, 0u};
        if (valid) words = load<u32x2>(src.gV + v_row + v_col);
        v[kk][0] = words.x, v[kk][1] = words.y;
      }
    }
  }

  // A operand of S^T's MFMA step s: K[key m][columns of step s].
  __device__ __forceinline__ u16x4 k_operand(int s) const {
    const u32x4& chunk = k[s / 2];
    return s % 2 == 0 ? __builtin_bit_cast(u16x4, u32x2{chunk.x, chunk.y})
                      : __builtin_bit_cast(u16x4, u32x2{chunk.z, chunk.w});
  }

  // ... of steps s..s + kStepsPerMfma - 1 (on CDNA4 the whole chunk of steps s, s + 1).
  __device__ __forceinline__ MfmaOperand k_mfma_operand(int s) const {
#if defined(PORTATTN_ROCM_CDNA4)
    return __builtin_bit_cast(u16x8, k[s / 2]);
#else
    return k_operand(s);
#endif
  }

  // A operand of O^T tile u: V^T[column m D/16 + u][keys 4g..4g+3].
  __device__ __forceinline__ u16x4 v_operand(int u) const {
    const int shift = 16 * (u % 2);
    return u16x4{static_cast<uint16_t>(v[0][u / 2] >> shift), static_cast<uint16_t>(v[1][u / 2] >> shift),
                 static_cast<uint16_t>(v[2][u / 2] >> shift), static_cast<uint16_t>(v[3][u / 2] >> shift)};
  }

  __device__ __forceinline__ DecodeKV widened() const { return *this; }
};

// DecodeKV's share of one wave's 16 keys as raw e4m3 bytes (the same columns and
// keys), widened to DecodeKV when its stage is computed.
template <class Tile>
struct DecodeKVBytes {
  static constexpr int kVBytesWords = Tile::kVDims / 4;  // D/16 bytes of a key as 32-bit words
  u32x2 k[Tile::kChunks];
  uint32_t v[4][kVBytesWords];

  __device__ __forceinline__ void fetch(const KeySource<uint8_t>& src, int key0, int lm, int lg) {
    const int k_key = key0 + lm;
    const bool k_valid = k_key < src.seqlen_k;
    const int64_t k_row = k_valid ? src.at.offset(src.k_strides, src.cache_row, src.key_base + k_key) : 0;
#pragma unroll
    for (int c = 0; c < Tile::kChunks; ++c) {
      const int col = 32 * c + 8 * lg;
      k[c] = u32x2{0u, 0u};
      if (k_valid && col < src.headdim) k[c] = load<u32x2>(src.gK + k_row + col);
    }
    const int v_col = lm * Tile::kVDims;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const int key = key0 + 4 * lg + kk;
      const bool valid = key < src.seqlen_k && v_col < src.headdim;
      const int64_t v_row = valid ? src.at.offset(src.v_strides, src.cache_row, src.key_base + key) : 0;
      if constexpr (kVBytesWords == 1) {  // D = 64: 4 bytes, wholly inside the head dim (a multiple of 8)
        v[kk][0] = valid ? load<uint32_t>(src.gV + v_row + v_col) : 0u;
      } else {
#pragma unroll
        for (int w = 0; w < kVBytesWords; w += 2) {
          u32x2 words{0u, 0u};
          if (valid && v_col + 4 * w < src.headdim) words = load<u32x2>(src.gV + v_row + v_col + 4 * w);
          v[kk][w] = words.x, v[kk][w + 1] = words.y;
        }
      }
    }
  }

  __device__ __forceinline__ DecodeKV<Tile> widened() const {
    DecodeKV<Tile> out;
#pragma unroll
    for (int c = 0; c < Tile::kChunks; ++c) out.k[c] = fp8::e4m3x8_to<Tile::kIsBf16>(k[c]);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int w = 0; w < Tile::kVWords; ++w)  // 16-bit word w: columns 2w, 2w + 1
        out.v[kk][w] = w % 2 == 0 ? fp8::e4m3x2_at<Tile::kIsBf16, 0>(v[kk][w / 2])
                                  : fp8::e4m3x2_at<Tile::kIsBf16, 2>(v[kk][w / 2]);
    return out;
  }
};

// kFp8: k and v hold e4m3 bytes (DecodeKVBytes), the docblock's last paragraph.
template <class Tile, bool kFp8>
__global__ void PORTATTN_LAUNCH_BOUNDS(Tile::kThreads, Tile::kWavesPerSimd)
    decode_kernel(const PortattnDecodeParams p) {
  using T = Dtype<Tile::kIsBf16>;
  using Elem = std::conditional_t<kFp8, uint8_t, uint16_t>;
  using Fetched = std::conditional_t<kFp8, DecodeKVBytes<Tile>, DecodeKV<Tile>>;
  constexpr int kLaneDims = Tile::kLaneDims;
  constexpr int kVDims = Tile::kVDims;
  // Waves 1.. leave their weighted O here; every wave its LSE per row.
  __shared__ __attribute__((aligned(16))) float sMerge[(Tile::kWaves - 1) * Tile::kBlockM * Tile::kMergePitch];
  __shared__ float sLse[Tile::kWaves * Tile::kBlockM];

  const int split = blockIdx.x;
  const int b = blockIdx.z;
  const int group = p.nheads / p.nheads_k;
  const int m_tiles = (p.seqlen_q * group + Tile::kBlockM - 1) / Tile::kBlockM;
  const int hk = blockIdx.y / m_tiles;
  const int row0 = (blockIdx.y % m_tiles) * Tile::kBlockM;

  const decode::Sequence seq = decode::Sequence::of(p, b);
  const int rows = seq.seqlen_q * group;
  if (row0 >= rows) return;  // a shorter varlen sequence: nothing of it here (the combine skips it too)
  // Out-of-range cache_seqlens / leftpad / batch_idx: an empty sequence, reported once
  // (Note [portattn decode errors]). Out-of-range page numbers: a workgroup scans the pages of
  // the keys it will read (below, before the key loop) and, if one lies outside the pool, reads
  // no key and writes its rows as contained: out 0 and lse -inf, or a +inf partial LSE that the
  // split combine turns into that, so every split of the sequence agrees. decode_common.h's
  // contained_sequence (the RDNA decode's: the whole sequence's pages, and Sequence::contain()
  // feeding the key loop) cost this kernel 2-20 spilled SGPRs at D = 256 on gfx942; this form
  // none. Unlike that scan, a bad page outside every key the workgroup reads (a sliding
  // window's past) does not empty the sequence: no key of it is read either.
  if (seq.seqlen_k == 0 && split == 0 && blockIdx.y == 0 && threadIdx.x == 0 && p.errors != nullptr) {
    int value = 0;
    const int argument = decode::metadata_error(p, b, &value);
    if (argument >= 0) decode::record_error(p.errors, argument, b, value);
  }
  const decode::KeyRange range = decode::KeyRange::of(p, seq, row0, Tile::kBlockM, group, Tile::kStageKeys, split);

  const int wave = threadIdx.x / kWaveSize;
  const int lane = threadIdx.x % kWaveSize;
  const int lm = lane % kMfma16;  // this lane's packed row (S^T / O^T column); K: its key row; V: its columns
  const int lg = lane / kMfma16;  // which 4 of each 16-deep step it supplies
  const int packed = row0 + lm;
  const bool row_valid = packed < rows;
  const int packed_safe = row_valid ? packed : rows - 1;  // padding rows compute a copy, never stored
  const int i = packed_safe / group;                       // query within the sequence
  const int h = hk * group + packed_safe % group;

  const int64_t q_batch = p.cu_seqlens_q != nullptr ? 0 : b * p.q_strides.batch_stride;
  const uint16_t* gQ = static_cast<const uint16_t*>(p.q) + q_batch +
                       static_cast<int64_t>(seq.q_start + i) * p.q_strides.row_stride + h * p.q_strides.head_stride;
  u16x4 rQ[Tile::kDimSteps];  // B operand of S^T = K Q^T, same column mapping as K's chunks
#pragma unroll
  for (int c = 0; c < Tile::kChunks; ++c) {
    const int col = 32 * c + 8 * lg;
    u32x4 chunk{0u, 0u, 0u, 0u};
    if (row_valid && col < p.headdim) chunk = load<u32x4>(gQ + col);
    rQ[2 * c] = __builtin_bit_cast(u16x4, u32x2{chunk.x, chunk.y});
    rQ[2 * c + 1] = __builtin_bit_cast(u16x4, u32x2{chunk.z, chunk.w});
  }

  const KeySource<Elem> src = KeySource<Elem>::of(p, seq, b, hk);
  const KvScales scales = kv_scales<kFp8>(p, b, hk);  // FP8: the descales, in VGPRs
  const float score_scale = scales.score;
  const float v_descale = scales.v;

  const bool use_softcap = p.softcap > 0.f;
  const bool use_alibi = p.alibi_slopes != nullptr;
  const float slope = use_alibi ? p.alibi_slopes[b * p.alibi_batch_stride + h] : 0.f;
  // Key j of this lane's row is visible for keys.lo <= j <= keys.hi.
  const int aligned_key = i + range.diag;
  const VisibleSpan keys = seq.rule(p).keys_of_query(i);

  f32x4 acc_o[Tile::kDimTiles];
#pragma unroll
  for (int u = 0; u < Tile::kDimTiles; ++u) acc_o[u] = f32x4{0.f, 0.f, 0.f, 0.f};
  softmax::RowState<1> state;
  state.init();

  // The containment of out-of-range page numbers described above.
  if (p.block_table != nullptr) {
    const int32_t* pages = p.block_table + b * p.block_table_batch_stride;
    const int lo = range.begin * Tile::kStageKeys;
    const int hi = min(range.end * Tile::kStageKeys, seq.seqlen_k);
    const int bad_slot = hi > lo ? decode::first_bad_page_slot(pages, p.page_size, p.num_pages, seq.key_base + lo,
                                                               hi - lo, threadIdx.x, Tile::kThreads)
                                 : -1;
    // The vote's word is sMerge's first, which nothing touches before the merge's barriers.
    if (workgroup_any(bad_slot >= 0, reinterpret_cast<int*>(sMerge))) {
      if (bad_slot >= 0) decode::record_error(p.errors, PORTATTN_ERR_BLOCK_TABLE, b, pages[bad_slot]);
      if (wave != 0 || !row_valid) return;
      const int col0 = lg * kLaneDims;
      const decode::OutputRow at{b, h, seq.q_start, i};
      if (p.num_splits == 1) {
        uint16_t* gO = static_cast<uint16_t*>(p.out) + at.out_offset(p);
#pragma unroll
        for (int e = 0; e < kLaneDims; e += 4)
          if (col0 + e < p.headdim) store<u16x4>(gO + col0 + e, u16x4{0, 0, 0, 0});
        if (lg == 0 && p.lse != nullptr) p.lse[at.lse_offset(p)] = softmax::neg_inf();
      } else if (lg == 0) {
        p.lse_partial[at.partial_row(p, split)] = __builtin_huge_valf();  // the combine's "contained"
      }
      return;
    }
  }

  Fetched kv;
  const int wave_key0 = wave * Tile::kWaveKeys;
  if (Tile::kPrefetch && range.begin < range.end)
    kv.fetch(src, range.begin * Tile::kStageKeys + wave_key0, lm, lg);

  for (int stage = range.begin; stage < range.end; ++stage) {
    const int stage_key0 = stage * Tile::kStageKeys;
    const int key0 = stage_key0 + wave_key0;
    if (!Tile::kPrefetch) kv.fetch(src, key0, lm, lg);
    const DecodeKV<Tile> cur = kv.widened();
    if (Tile::kPrefetch && stage + 1 < range.end) kv.fetch(src, key0 + Tile::kStageKeys, lm, lg);

    f32x4 acc_s{0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int s = 0; s < Tile::kDimSteps; s += kStepsPerMfma)
      acc_s = T::mfma16(cur.k_mfma_operand(s), operand_at(rQ, s), acc_s);

    // Register r is key j = key0 + 4g + r of row i (scores in log2 units after this).
    const bool all_visible = range.all_visible(p, seq, stage_key0, Tile::kStageKeys);
    float rS[1][4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int j = key0 + 4 * lg + r;
      float x = acc_s[r] * score_scale;
      if (use_softcap) x = p.softcap * tanhf(x / p.softcap);
      if (use_alibi) x -= slope * fabsf(static_cast<float>(aligned_key - j));
      x *= softmax::kLog2e;
      if (!all_visible && (j < keys.lo || j > keys.hi)) x = softmax::neg_inf();
      rS[0][r] = x;
    }

    float rO[1][Tile::kDimTiles * 4];
#pragma unroll
    for (int u = 0; u < Tile::kDimTiles; ++u)
#pragma unroll
      for (int r = 0; r < 4; ++r) rO[0][u * 4 + r] = acc_o[u][r];
    softmax::online_softmax_step<false, 1, 4, Tile::kDimTiles * 4, QuarterWaveReduce>(rS, rO, state, 1.f);
#pragma unroll
    for (int u = 0; u < Tile::kDimTiles; ++u)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc_o[u][r] = rO[0][u * 4 + r];

    const u16x4 rP = pack4<Tile::kIsBf16>(rS[0][0], rS[0][1], rS[0][2], rS[0][3]);
#pragma unroll
    for (int u = 0; u < Tile::kDimTiles; ++u) acc_o[u] = T::mfma16(cur.v_operand(u), rP, acc_o[u]);
  }

  // Register r of O^T tile u is column (4g + r) D/16 + u: lane column e = r D/16 + u of [g D/4, (g+1) D/4).
  float rO[1][kLaneDims];
#pragma unroll
  for (int e = 0; e < kLaneDims; ++e) rO[0][e] = acc_o[e % kVDims][e / kVDims];
  float lse[1];
  softmax::online_softmax_finalize<1, kLaneDims, QuarterWaveReduce>(rO, state, 1.f, 1.f, lse);

  // ---- merge the waves' (O, LSE): the same LSE-weighted sum the split combine does ----
  if (lg == 0) sLse[wave * Tile::kBlockM + lm] = lse[0];
  __syncthreads();
  float m = softmax::neg_inf();
#pragma unroll
  for (int w = 0; w < Tile::kWaves; ++w) m = fmaxf(m, sLse[w * Tile::kBlockM + lm]);
  float total_lse = softmax::neg_inf();
  if (m != softmax::neg_inf()) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < Tile::kWaves; ++w) sum += expf(sLse[w * Tile::kBlockM + lm] - m);
    total_lse = m + logf(sum);
  }
  // exp(-inf - finite) = 0 for a wave that saw no visible key.
  const float weight = total_lse == softmax::neg_inf() ? 0.f : expf(lse[0] - total_lse);
  if (wave > 0) {
    float* dst = sMerge + ((wave - 1) * Tile::kBlockM + lm) * Tile::kMergePitch + lg * kLaneDims;
#pragma unroll
    for (int e = 0; e < kLaneDims; e += 4)
      store<f32x4>(dst + e, f32x4{weight * rO[0][e], weight * rO[0][e + 1], weight * rO[0][e + 2],
                                  weight * rO[0][e + 3]});
  }
  __syncthreads();
  if (wave != 0 || !row_valid) return;

  float out[kLaneDims];
#pragma unroll
  for (int e = 0; e < kLaneDims; ++e) out[e] = weight * rO[0][e];
#pragma unroll
  for (int w = 1; w < Tile::kWaves; ++w) {
    const float* src = sMerge + ((w - 1) * Tile::kBlockM + lm) * Tile::kMergePitch + lg * kLaneDims;
#pragma unroll
    for (int e = 0; e < kLaneDims; e += 4) {
      const f32x4 part = load<f32x4>(src + e);
      out[e] += part.x, out[e + 1] += part.y, out[e + 2] += part.z, out[e + 3] += part.w;
    }
  }
  if constexpr (kFp8) {
#pragma unroll
    for (int e = 0; e < kLaneDims; ++e) out[e] *= v_descale;
  }

  const int col0 = lg * kLaneDims;
  const decode::OutputRow at{b, h, seq.q_start, i};
  if (p.num_splits == 1) {
    uint16_t* gO = static_cast<uint16_t*>(p.out) + at.out_offset(p);
#pragma unroll
    for (int e = 0; e < kLaneDims; e += 4) {
      // headdim is a multiple of 8: each group of 4 columns is wholly inside or outside it.
      if (col0 + e < p.headdim)
        store<u16x4>(gO + col0 + e, pack4<Tile::kIsBf16>(out[e], out[e + 1], out[e + 2], out[e + 3]));
    }
    if (lg == 0 && p.lse != nullptr) p.lse[at.lse_offset(p)] = total_lse;
  } else {
    const int64_t row_index = at.partial_row(p, split);
    float* gOp = p.o_partial + row_index * p.headdim;
#pragma unroll
    for (int e = 0; e < kLaneDims; e += 4) {
      if (col0 + e < p.headdim) store<f32x4>(gOp + col0 + e, f32x4{out[e], out[e + 1], out[e + 2], out[e + 3]});
    }
    if (lg == 0) p.lse_partial[row_index] = total_lse;
  }
}

// ---- launches --------------------------------------------------------------------

template <class Tile>
hipError_t launch_decode(const PortattnDecodeParams& p) {
  if (p.seqlen_q == 0 || p.batch == 0 || p.nheads == 0) return hipSuccess;
  const hipStream_t stream = static_cast<hipStream_t>(p.stream);
  const int group = p.nheads / p.nheads_k;
  const int m_tiles = (p.seqlen_q * group + Tile::kBlockM - 1) / Tile::kBlockM;
  const dim3 grid(p.num_splits, p.nheads_k * m_tiles, p.batch);
  if (p.kv.cache_dtype == PORTATTN_CACHE_FP8_E4M3) {
    hipLaunchKernelGGL((decode_kernel<Tile, true>), grid, dim3(Tile::kThreads), 0, stream, p);
  } else {
    hipLaunchKernelGGL((decode_kernel<Tile, false>), grid, dim3(Tile::kThreads), 0, stream, p);
  }
  hipError_t err = hipGetLastError();
  if (err != hipSuccess || p.num_splits == 1) return err;
  return launch_decode_combine<Tile>(p);
}

}  // namespace PORTATTN_ROCM_ARCH_NS
}  // namespace rocm
}  // namespace portattn
