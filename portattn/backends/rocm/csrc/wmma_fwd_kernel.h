// Forward attention on RDNA matrix cores (wave32 WMMA: gfx1100 RDNA3,
// gfx1201 RDNA4): one workgroup per (64-query block, head-dim slice, head,
// sequence), online softmax over key blocks. Same algorithm, masks, dropout
// and helpers as the CDNA forward (fwd_kernel.h): common/online_softmax.h,
// common/block_range.h's MaskRule, common/seq_bounds.h, tiles.h's key-block
// stream; only the matrix instruction and its lane layout differ
// (Note [portattn WMMA layout] in rdna.h).
//
// Tile configuration (WmmaFwdTile): 4 waves x 16 query rows = 64 queries per
// workgroup; key blocks of kBlockN (a multiple of 16); head dims rounded up to
// kHeadDim (64, 128, 256) with zero-filled columns. Per key block each wave
// computes, transposed as on CDNA,
//   S^T (kBlockN x 16)   = K (kBlockN x D) . Q^T (D x 16)      kBlockN/16 * D/16 WMMAs
//   O^T (D' x 16)       += V^T (D' x kBlockN) . P^T            D'/16 * kBlockN/16 WMMAs
// where D' = D / kDimSplit: at D = 256 two workgroups share a query block,
// each owning half of O's columns and recomputing S (gfx11 holds Q as 16-slot
// operands, D/2 VGPRs, so Q (128) and a whole O^T (128) would fill the 256 a
// wave can address). Q stays in registers as B operands; K and V^T go through
// LDS, rows padded by 8 elements so every operand read is 16-byte aligned.
//
// Budget per variant (VGPRs per lane, of 1536 per SIMD lane and 256
// addressable per wave32; no AGPRs on RDNA; LDS <= 64 KiB per workgroup, 128 KiB
// per WGP). Numbers are data in variants.py (RDNA_CONFIGS), checked on the
// compiled code by tests/test_rocm_isa.py:
//   gen  D    kBlockN  split  Q in LDS  LDS bytes  WMMA/iter  waves/SIMD  VGPR budget  prefetch
//   11   64   32       1      yes       18944      16         6           <= 240       yes
//   11   128  32       1      yes       36352      32         3 (LDS)     <= 256       yes
//   11   256  16       2      yes       54528      24         2 (LDS)     <= 256       no
//   12   64   32       1      no         9728      16         6           <= 240       yes
//   12   128  32       1      no        18944      32         6           <= 240       no (19 spills)
//   12   256  16       2      yes       54528      24         2 (LDS)     <= 256       yes
// Measured with clang-19 (bf16; VGPRs, no spills, no scratch): gfx1100 218 / 221 / 197,
// gfx1201 159 / 232 / 190 at D = 64 / 128 / 256.
#pragma once
#include <limits.h>
#include <math.h>

#include "rdna.h"  // first: hip_runtime.h defines __forceinline__ for the common headers

#include "../../common/online_softmax.h"
#include "../../common/params.h"
#include "../../common/philox.h"
#include "tiles.h"

namespace portattn {
namespace rocm {
namespace PORTATTN_ROCM_ARCH_NS {

template <int kHeadDim_, int kBlockN_, bool kIsBf16_, int kWavesPerSimd_, bool kPrefetch_>
struct WmmaFwdTile {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr bool kIsBf16 = kIsBf16_;
  static constexpr int kWavesPerSimd = kWavesPerSimd_;
  static constexpr bool kPrefetch = kPrefetch_;

  static constexpr int kWaves = 4;
  static constexpr int kThreads = kWaves * kWave32;
  static constexpr int kBlockM = kWaves * kWmma;
  static constexpr int kDimSplit = kHeadDim > 128 ? 2 : 1;
  static constexpr int kOutDim = kHeadDim / kDimSplit;
  static constexpr int kKeyTiles = kBlockN / kWmma;   // S^T accumulators per wave
  static constexpr int kDimSteps = kHeadDim / kWmma;  // WMMA steps of Q K^T
  static constexpr int kOutTiles = kOutDim / kWmma;   // O^T accumulators per wave
  // Q as B operands takes D/2 VGPRs on gfx11 (16 slots, replicated halves),
  // D/4 on gfx12: where that does not fit beside O^T and the operand reads
  // (measured: 98-146 spilled VGPRs at D >= 128 on gfx1100, 5-114 at D = 256
  // on gfx1201), Q is staged in LDS once and read like K.
  static constexpr bool kQInLds = PORTATTN_ROCM_WMMA_GEN == 11 || kHeadDim > 128;
  static constexpr int kKStride = row_stride<kHeadDim, kWmmaLdsPad>();
  static constexpr int kVtStride = transposed_stride<kBlockN, kWmmaLdsPad>();
  static constexpr int kLdsBytes =
      2 * (kBlockN * kKStride + kHeadDim * kVtStride + (kQInLds ? kBlockM * kKStride : 0));
  static constexpr int kMfmaPerIter = kKeyTiles * kDimSteps + kOutTiles * kKeyTiles;

  static_assert(kHeadDim % kWmma == 0 && kBlockN % kWmma == 0, "tiles are whole WMMA tiles");
  static_assert(kLdsBytes <= 65536, "one workgroup must fit 64 KiB of LDS");
};

template <class Tile>
__global__ void PORTATTN_LAUNCH_BOUNDS(Tile::kThreads, Tile::kWavesPerSimd)
    fwd_kernel(const PortattnFwdParams p) {
  using W = Wmma<PORTATTN_ROCM_WMMA_GEN, Tile::kIsBf16>;
  using Operand = typename W::Operand;
  constexpr int kScoreCols = Tile::kKeyTiles * 8;
  constexpr int kOutCols = Tile::kOutTiles * 8;
  __shared__ __attribute__((aligned(16))) uint16_t sK[Tile::kBlockN * Tile::kKStride];
  __shared__ __attribute__((aligned(16))) uint16_t sVt[Tile::kHeadDim * Tile::kVtStride];
  __shared__ __attribute__((aligned(16))) uint16_t sQ[Tile::kQInLds ? Tile::kBlockM * Tile::kKStride : 8];

  const int b = blockIdx.z;
  const int h = blockIdx.y;
  const SeqBounds seq = seq_bounds(p, b);
  const int m0 = (blockIdx.x / Tile::kDimSplit) * Tile::kBlockM;
  const int d0 = (blockIdx.x % Tile::kDimSplit) * Tile::kOutDim;  // this workgroup's O columns
  if (m0 >= seq.len_q) return;  // varlen: this sequence is shorter than the longest

  const int lane = threadIdx.x % kWave32;
  const int lq = lane % kWmma;        // the query column this lane owns in every tile
  const int k0 = W::k_first(lane);    // first depth index of this lane's operand slots
  const int i = m0 + (threadIdx.x / kWave32) * kWmma + lq;
  const bool row_valid = i < seq.len_q;
  const int hk = h / (p.nheads / p.nheads_k);

  const uint16_t* gQ = head_row(p.q, p.q_strides, b, seq.q_start, h);
  const uint16_t* gK = head_row(p.k, p.k_strides, b, seq.k_start, hk);
  const uint16_t* gV = head_row(p.v, p.v_strides, b, seq.k_start, hk);

  // B operands of S^T = K Q^T: resident, or this wave's 16 rows of the LDS Q tile
  // (zero rows past the sequence; the first key block's barrier publishes it).
  Operand rQ[Tile::kQInLds ? 1 : Tile::kDimSteps];
  const uint16_t* sQ_row = sQ + ((threadIdx.x / kWave32) * kWmma + lq) * Tile::kKStride + k0;
  if constexpr (Tile::kQInLds) {
    TileInFlight<Tile::kBlockM, Tile::kHeadDim, Tile::kThreads, kWmmaLdsPad> q_tile;
    q_tile.fetch(gQ, p.q_strides.row_stride, m0, seq.len_q, p.headdim);
    q_tile.deposit(sQ, nullptr);
  } else {
#pragma unroll
    for (int s = 0; s < Tile::kDimSteps; ++s) {
      const int col = s * kWmma + k0;
      rQ[s] = W::read(gQ + i * p.q_strides.row_stride + col, row_valid ? p.headdim - col : 0);
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

  f32x8 acc_o[Tile::kOutTiles];
#pragma unroll
  for (int u = 0; u < Tile::kOutTiles; ++u) acc_o[u] = f32x8{};
  softmax::RowState<1> state;
  state.init();

  KeyBlockStream<Tile::kBlockN, Tile::kHeadDim, Tile::kThreads, Tile::kPrefetch, kWmmaLdsPad> kv{
      gK, gV, p, seq.len_k, keys.end};
  const int n_first = (keys.begin / Tile::kBlockN) * Tile::kBlockN;
  kv.start(n_first);

  for (int n0 = n_first; n0 < keys.end; n0 += Tile::kBlockN) {
    kv.stage(n0, sK, nullptr, nullptr, sVt);

    f32x8 acc_s[Tile::kKeyTiles];
#pragma unroll
    for (int t = 0; t < Tile::kKeyTiles; ++t) {
      acc_s[t] = f32x8{};
      if constexpr (Tile::kQInLds) {
        // Both operands from LDS: a rolled loop, because unrolled the compiler
        // issues every step's reads at once (2 x 8 VGPRs a step on gfx11: 128
        // spilled VGPRs at D = 256 on gfx1100).
#pragma unroll 2
        for (int s = 0; s < Tile::kDimSteps; ++s) {
          const Operand a = W::read(sK + (t * kWmma + lq) * Tile::kKStride + s * kWmma + k0);
          acc_s[t] = W::mma(a, W::read(sQ_row + s * kWmma), acc_s[t]);
        }
      } else {
#pragma unroll
        for (int s = 0; s < Tile::kDimSteps; ++s) {
          const Operand a = W::read(sK + (t * kWmma + lq) * Tile::kKStride + s * kWmma + k0);
          acc_s[t] = W::mma(a, rQ[s], acc_s[t]);
        }
      }
    }

    // The mask is skipped when every (valid query, key) pair of the block is visible.
    const bool block_visible = rule.tile_fully_visible(m0, q_last, n0, n0 + Tile::kBlockN - 1);
    // Register r of score tile t is key j = lane_key0 + c with the small constant
    // c = 16t + row_step(r), so every per-element test compares c with a per-lane
    // bound (inline constants; per-lane offsets would be hoisted out of the loop
    // and pin a register each).
    const int lane_key0 = n0 + W::row(lane, 0);
    const int rel_diag = i + diag - lane_key0;  // c of the key aligned with query i
    const int c_lo = rule.window_left >= 0 ? rel_diag - rule.window_left : INT_MIN;
    const int c_hi = min(rule.window_right >= 0 ? rel_diag + rule.window_right : INT_MAX, seq.len_k - lane_key0 - 1);
    float rS[1][kScoreCols];  // scores in log2 units, then probabilities
#pragma unroll
    for (int t = 0; t < Tile::kKeyTiles; ++t) {
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        const int c = t * kWmma + W::row_step(r);
        float x = acc_s[t][r] * p.softmax_scale;
        if (use_softcap) x = p.softcap * tanhf(x / p.softcap);
        if (use_alibi) x -= slope * fabsf(static_cast<float>(rel_diag - c));
        x *= softmax::kLog2e;
        if (!block_visible && (c < c_lo || c > c_hi)) x = softmax::neg_inf();
        rS[0][t * 8 + r] = x;
      }
    }

    float rO[1][kOutCols];
#pragma unroll
    for (int u = 0; u < Tile::kOutTiles; ++u)
#pragma unroll
      for (int r = 0; r < 8; ++r) rO[0][u * 8 + r] = acc_o[u][r];
    softmax::online_softmax_step<false, 1, kScoreCols, kOutCols, PairReduce>(rS, rO, state, 1.f);
#pragma unroll
    for (int u = 0; u < Tile::kOutTiles; ++u)
#pragma unroll
      for (int r = 0; r < 8; ++r) acc_o[u][r] = rO[0][u * 8 + r];

    // P^T as B operands, one 16-key step per score tile; dropout zeroes slots
    // (keys n0 + 16t + k0 + e, consecutive, so one Philox call per 4 slots).
    Operand rP[Tile::kKeyTiles];
#pragma unroll
    for (int t = 0; t < Tile::kKeyTiles; ++t) {
      float x[8];
#pragma unroll
      for (int r = 0; r < 8; ++r) x[r] = rS[0][t * 8 + r];
      rP[t] = W::rows_as_b(x);
      if (dropout.on) {
#pragma unroll
        for (int e = 0; e < W::kSlots; e += 4) {
          const uint32_t kept = dropout.keep4(i, n0 + t * kWmma + k0 + e);
#pragma unroll
          for (int f = 0; f < 4; ++f) rP[t][e + f] = (kept >> f) & 1u ? rP[t][e + f] : uint16_t{0};
        }
      }
    }

#pragma unroll
    for (int u = 0; u < Tile::kOutTiles; ++u) {
#pragma unroll
      for (int t = 0; t < Tile::kKeyTiles; ++t) {
        const Operand a = W::read(sVt + (d0 + u * kWmma + lq) * Tile::kVtStride + t * kWmma + k0);
        acc_o[u] = W::mma(a, rP[t], acc_o[u]);
      }
    }
  }

  float rO[1][kOutCols];
#pragma unroll
  for (int u = 0; u < Tile::kOutTiles; ++u)
#pragma unroll
    for (int r = 0; r < 8; ++r) rO[0][u * 8 + r] = acc_o[u][r];
  float lse[1];
  softmax::online_softmax_finalize<1, kOutCols, PairReduce>(rO, state, 1.f, dropout.scale, lse);
  if (!row_valid) return;

  using T = Dtype<Tile::kIsBf16>;
  uint16_t* gO = head_row(p.out, p.out_strides, b, seq.q_start + i, h);
#pragma unroll
  for (int u = 0; u < Tile::kOutTiles; ++u) {
    if constexpr (W::kRowsContiguous) {
      // Rows 8 (lane / 16) + 0..7: one 16-byte store (headdim is a multiple of 8).
      const int d = d0 + u * kWmma + W::row(lane, 0);
      if (d < p.headdim) {
        u16x8 packed;
#pragma unroll
        for (int r = 0; r < 8; ++r) packed[r] = T::from_float(rO[0][u * 8 + r]);
        store<u16x8>(gO + d, packed);
      }
    } else {
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        const int d = d0 + u * kWmma + W::row(lane, r);
        if (d < p.headdim) gO[d] = T::from_float(rO[0][u * 8 + r]);
      }
    }
  }
  if (lane < kWmma && d0 == 0 && p.lse != nullptr)
    p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + seq.q_start + i] = lse[0];
}

template <class Tile>
hipError_t launch_fwd(const PortattnFwdParams& p) {
  const dim3 grid((p.seqlen_q + Tile::kBlockM - 1) / Tile::kBlockM * Tile::kDimSplit, p.nheads, p.batch);
  hipLaunchKernelGGL(fwd_kernel<Tile>, grid, dim3(Tile::kThreads), 0, static_cast<hipStream_t>(p.stream), p);
  return hipGetLastError();
}

}  // namespace PORTATTN_ROCM_ARCH_NS
}  // namespace rocm
}  // namespace portattn
