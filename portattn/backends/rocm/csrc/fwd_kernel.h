// Forward attention on CDNA matrix cores (gfx90a, gfx942, gfx950): one workgroup per
// (128-query block, head, sequence), online softmax over key blocks.
//
// Tile configuration (FwdTile): 4 waves x 32 query rows = 128 queries per
// workgroup; key blocks of kBlockN (a multiple of 32); head dims are rounded
// up to kHeadDim (64, 128, 256) with zero-filled columns, so every multiple
// of 8 up to 256 is served. Per key block each wave computes
//   S^T (kBlockN x 32)  = K (kBlockN x D) . Q^T (D x 32)   kBlockN/32 * D/8 MFMAs
//   O^T (D x 32)       += V^T (D x kBlockN) . P^T          D/32 * kBlockN/8 MFMAs
// transposed so that the score registers are directly the B operand of the
// second product and each lane owns one query row (Note [portattn MFMA layout]
// in cdna.h). Q stays in registers (D/4 VGPRs as packed 16-bit pairs), K and
// V^T go through LDS, V transposed on its way in so both MFMA A operands are
// 8-byte LDS reads; global loads are 16 bytes per lane, consecutive lanes on
// consecutive 16-byte chunks of a row.
//
// Budget per variant (32x32x8 MFMAs per wave per key block; registers per
// lane; a workgroup is one wave per SIMD; CDNA2/3 have 512 unified VGPR+AGPR
// per SIMD lane and 64 KiB LDS per CU). The numbers are data in variants.py
// (CONFIGS), from which tests/test_rocm_isa.py checks the compiled kernels:
//
//   D    kBlockN  LDS bytes  MFMA/iter  VGPR+AGPR budget  waves/SIMD        prefetch
//   64   64       17408      32         <= 256            2 (LDS allows 3)  yes
//   128  32       17664      32         <= 256            2 (LDS allows 3)  yes
//   256  32       35072      64         <= 512            1 (LDS allows 1)  no (registers)
// Measured (VGPR+AGPR total, of which AGPR; gfx90a / gfx942):
//   64: 190-195, 0 / 213-214, 0;  128: 208, 0 / 222, 0;
//   256: 425-427, 169-171 / 452-501, 196-245.  SGPRs 86-90, no spills, no scratch.
// gfx950 (clang-22, variants.CDNA4_CONFIGS) issues the double-depth 32x32x16
// MFMAs (Note [portattn MFMA double depth] in cdna.h: half the instructions,
// the same operand registers and LDS reads) and has 160 KiB of LDS per CU:
//   D    kBlockN  LDS bytes  MFMA/iter  budget  waves/SIMD  prefetch  measured fp16 / bf16
//   64   64       17408      16         256     2           no        194 / 246
//   128  32       17664      16         256     2           yes       218 / 240
//   256  64       68096      64         512     1           no        365 (109) / 375 (119)
// D=64 does not prefetch (9 spilled VGPRs in bf16 with it). D=256 takes 64-key
// blocks, which only CDNA4's LDS holds: per 64 keys one softmax pass and two
// barriers instead of two and four, at the same one wave per SIMD (304 / 329
// VGPR+AGPR with 32-key blocks).
//
// LDS rows are padded by 4 elements (8 bytes) so the 32 rows read by one MFMA
// operand fall on distinct bank pairs. With kPrefetch (D <= 128) the next key
// block's global reads are in flight in registers while this block computes;
// LDS is single-buffered (two barriers per key block).
#pragma once
#include <limits.h>
#include <math.h>

#include "cdna.h"  // first: hip_runtime.h defines __forceinline__ for the common headers

#include "../../common/online_softmax.h"
#include "../../common/params.h"
#include "../../common/philox.h"
#include "tiles.h"

namespace portattn {
namespace rocm {
namespace PORTATTN_ROCM_ARCH_NS {

template <int kHeadDim_, int kBlockN_, bool kIsBf16_, int kWavesPerSimd_, bool kPrefetch_>
struct FwdTile {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr bool kIsBf16 = kIsBf16_;
  // Occupancy the register allocator must preserve (amdgpu_waves_per_eu).
  static constexpr int kWavesPerSimd = kWavesPerSimd_;
  // Fetch the next key block into registers while computing on this one
  // (where the register budget leaves room for 2 x kBlockN x D / 128 VGPRs).
  static constexpr bool kPrefetch = kPrefetch_;

  static constexpr int kWaves = 4;  // one per SIMD of a CU
  static constexpr int kThreads = kWaves * kWaveSize;
  static constexpr int kBlockM = kWaves * kMfmaM;
  static constexpr int kKeyTiles = kBlockN / kMfmaM;   // S^T accumulators per wave
  static constexpr int kDimSteps = kHeadDim / kMfmaK;  // MFMA steps of Q K^T
  static constexpr int kDimTiles = kHeadDim / kMfmaM;  // O^T accumulators per wave
  static constexpr int kKeySteps = kBlockN / kMfmaK;   // MFMA steps of P V
  static constexpr int kKStride = row_stride<kHeadDim>();         // sK: kBlockN rows of kHeadDim
  static constexpr int kVtStride = transposed_stride<kBlockN>();  // sVt: kHeadDim rows of kBlockN
  static constexpr int kLdsBytes = 2 * (kBlockN * kKStride + kHeadDim * kVtStride);
  static constexpr int kMfmaPerIter = (kKeyTiles * kDimSteps + kDimTiles * kKeySteps) / kStepsPerMfma;

  static_assert(kHeadDim % kMfmaM == 0 && kBlockN % kMfmaM == 0, "tiles are whole MFMA tiles");
  static_assert(kLdsBytes <= kLdsBytesPerCu, "one workgroup must fit a CU's LDS");
};

template <class Tile>
__global__ void PORTATTN_LAUNCH_BOUNDS(Tile::kThreads, Tile::kWavesPerSimd)
    fwd_kernel(const PortattnFwdParams p) {
  using T = Dtype<Tile::kIsBf16>;
  constexpr int kScoreCols = Tile::kKeyTiles * 16;
  constexpr int kOutCols = Tile::kDimTiles * 16;
  __shared__ __attribute__((aligned(16))) uint16_t sK[Tile::kBlockN * Tile::kKStride];
  __shared__ __attribute__((aligned(16))) uint16_t sVt[Tile::kHeadDim * Tile::kVtStride];

  const int b = blockIdx.z;
  const int h = blockIdx.y;
  const SeqBounds seq = seq_bounds(p, b);
  const int m0 = blockIdx.x * Tile::kBlockM;
  if (m0 >= seq.len_q) return;  // varlen: this sequence is shorter than the longest

  const int lane = threadIdx.x % kWaveSize;
  const int lq = lane % kMfmaM;  // the query column this lane owns in every MFMA tile
  const int lh = lane / kMfmaM;  // which 4-deep half of each 8-deep step it supplies
  const int i = m0 + (threadIdx.x / kWaveSize) * kMfmaM + lq;
  const bool row_valid = i < seq.len_q;
  const int hk = h / (p.nheads / p.nheads_k);

  const uint16_t* gQ = head_row(p.q, p.q_strides, b, seq.q_start, h);
  const uint16_t* gK = head_row(p.k, p.k_strides, b, seq.k_start, hk);
  const uint16_t* gV = head_row(p.v, p.v_strides, b, seq.k_start, hk);

  u16x4 rQ[Tile::kDimSteps];  // B operand of S^T = K Q^T, all steps
#pragma unroll
  for (int s = 0; s < Tile::kDimSteps; ++s) {
    // headdim is a multiple of 8, so the test is per step (scalar), not per lane.
    rQ[s] = u16x4{0, 0, 0, 0};
    if (row_valid && s * kMfmaK < p.headdim) {
      rQ[s] = load<u16x4>(gQ + i * p.q_strides.row_stride + s * kMfmaK + 4 * lh);
    }
  }

  // The keys the block's rows see: Note [portattn visible keys] (block_range.h).
  const MaskRule rule = MaskRule::of(seq, p.window_left, p.window_right);
  const int diag = rule.diag;  // key j is aligned with query i at j = i + diag
  const int q_last = min(m0 + Tile::kBlockM, seq.len_q) - 1;
  const IndexRange keys = rule.key_range(m0, q_last);

  const bool use_softcap = p.softcap > 0.f;
  const bool use_alibi = p.alibi_slopes != nullptr;
  const float slope = use_alibi ? p.alibi_slopes[b * p.alibi_batch_stride + h] : 0.f;
  const DropoutLane dropout(p, b, h);

  f32x16 acc_o[Tile::kDimTiles];
#pragma unroll
  for (int u = 0; u < Tile::kDimTiles; ++u) acc_o[u] = f32x16{};
  softmax::RowState<1> state;
  state.init();

  KeyBlockStream<Tile::kBlockN, Tile::kHeadDim, Tile::kThreads, Tile::kPrefetch> kv{gK, gV, p, seq.len_k, keys.end};
  const int n_first = (keys.begin / Tile::kBlockN) * Tile::kBlockN;
  kv.start(n_first);

  for (int n0 = n_first; n0 < keys.end; n0 += Tile::kBlockN) {
    kv.stage(n0, sK, nullptr, nullptr, sVt);

    f32x16 acc_s[Tile::kKeyTiles];
#pragma unroll
    for (int t = 0; t < Tile::kKeyTiles; ++t) {
      acc_s[t] = f32x16{};
#pragma unroll
      for (int s = 0; s < Tile::kDimSteps; s += kStepsPerMfma) {
        const MfmaOperand a = operand_along_row(sK, Tile::kKStride, t * kMfmaM + lq, s * kMfmaK + 4 * lh);
        acc_s[t] = T::mfma(a, operand_at(rQ, s), acc_s[t]);
      }
    }

    // The mask is skipped when every (valid query, key) pair of the block is visible.
    const bool block_visible = rule.tile_fully_visible(m0, q_last, n0, n0 + Tile::kBlockN - 1);
    // Register r of score tile t is key j = n0 + 4lh + c with the small constant
    // c = 32t + 8(r/4) + r%4, so every per-element test below compares c with a
    // per-lane bound (inline constants, no per-element scalar registers).
    const int lane_key0 = n0 + 4 * lh;
    const int rel_diag = i + diag - lane_key0;  // c of the key aligned with query i
    // rule.keys_of_query(i) as offsets c from lane_key0 (written out: block_range.h says why).
    const int c_lo = rule.window_left >= 0 ? rel_diag - rule.window_left : INT_MIN;
    const int c_hi = min(rule.window_right >= 0 ? rel_diag + rule.window_right : INT_MAX, seq.len_k - lane_key0 - 1);
    float rS[1][kScoreCols];  // scores in log2 units, then probabilities
#pragma unroll
    for (int t = 0; t < Tile::kKeyTiles; ++t) {
#pragma unroll
      for (int r = 0; r < 16; ++r) {
        const int c = t * kMfmaM + 8 * (r / 4) + r % 4;
        float x = acc_s[t][r] * p.softmax_scale;
        if (use_softcap) x = p.softcap * tanhf(x / p.softcap);
        if (use_alibi) x -= slope * fabsf(static_cast<float>(rel_diag - c));
        x *= softmax::kLog2e;
        if (!block_visible && (c < c_lo || c > c_hi)) x = softmax::neg_inf();
        rS[0][t * 16 + r] = x;
      }
    }

    float rO[1][kOutCols];
#pragma unroll
    for (int u = 0; u < Tile::kDimTiles; ++u)
#pragma unroll
      for (int r = 0; r < 16; ++r) rO[0][u * 16 + r] = acc_o[u][r];
    softmax::online_softmax_step<false, 1, kScoreCols, kOutCols, HalfWaveReduce>(rS, rO, state, 1.f);
#pragma unroll
    for (int u = 0; u < Tile::kDimTiles; ++u)
#pragma unroll
      for (int r = 0; r < 16; ++r) acc_o[u][r] = rO[0][u * 16 + r];

    // P^T as B operands: registers 4s..4s+3 of a score tile are keys j0..j0+3,
    // j0 = n0 + 32t + 8s + 4lh, which is also one Philox call's group of 4.
    u16x4 rP[Tile::kKeyTiles * 4];
#pragma unroll
    for (int t = 0; t < Tile::kKeyTiles; ++t) {
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        float pr[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) pr[e] = rS[0][t * 16 + 4 * s + e];
        if (dropout.on) {
          const uint32_t kept = dropout.keep4(i, n0 + t * kMfmaM + s * kMfmaK + 4 * lh);
#pragma unroll
          for (int e = 0; e < 4; ++e) pr[e] = (kept >> e) & 1u ? pr[e] : 0.f;
        }
        rP[t * 4 + s] = pack4<Tile::kIsBf16>(pr[0], pr[1], pr[2], pr[3]);
      }
    }

#pragma unroll
    for (int u = 0; u < Tile::kDimTiles; ++u) {
#pragma unroll
      for (int s = 0; s < Tile::kKeySteps; s += kStepsPerMfma) {
        const MfmaOperand a = operand_along_row(sVt, Tile::kVtStride, u * kMfmaM + lq, s * kMfmaK + 4 * lh);
        acc_o[u] = T::mfma(a, operand_at(rP, s), acc_o[u]);
      }
    }
  }

  float rO[1][kOutCols];
#pragma unroll
  for (int u = 0; u < Tile::kDimTiles; ++u)
#pragma unroll
    for (int r = 0; r < 16; ++r) rO[0][u * 16 + r] = acc_o[u][r];
  float lse[1];
  softmax::online_softmax_finalize<1, kOutCols, HalfWaveReduce>(rO, state, 1.f, dropout.scale, lse);
  if (!row_valid) return;

  uint16_t* gO = head_row(p.out, p.out_strides, b, seq.q_start + i, h);
#pragma unroll
  for (int u = 0; u < Tile::kDimTiles; ++u) {
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      const int d = u * kMfmaM + 8 * g + 4 * lh;
      if (d >= p.headdim) continue;
      const float* o = &rO[0][u * 16 + 4 * g];
      store<u16x4>(gO + d, pack4<Tile::kIsBf16>(o[0], o[1], o[2], o[3]));
    }
  }
  if (lh == 0 && p.lse != nullptr) p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + seq.q_start + i] = lse[0];
}

template <class Tile>
hipError_t launch_fwd(const PortattnFwdParams& p) {
  const dim3 grid((p.seqlen_q + Tile::kBlockM - 1) / Tile::kBlockM, p.nheads, p.batch);
  hipLaunchKernelGGL(fwd_kernel<Tile>, grid, dim3(Tile::kThreads), 0,
                     static_cast<hipStream_t>(p.stream), p);
  return hipGetLastError();
}

}  // namespace PORTATTN_ROCM_ARCH_NS
}  // namespace rocm
}  // namespace portattn
