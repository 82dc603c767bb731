// Backward attention on RDNA matrix cores (wave32 WMMA: gfx1100 RDNA3,
// gfx1201 RDNA4): Note [portattn rocm backward] (bwd_kernel.h) on WMMA. The
// same three kernels, the same products and the same shared helpers
// (bwd_common.h: rowsum(dO * O), probability and softcap derivative, launch;
// common/block_range.h's MaskRule; tiles.h's tile streams; the Philox mask);
// only the matrix instruction and its lane layout differ (Note [portattn WMMA
// layout] in rdna.h). No atomics, so always deterministic; no dQ workspace.
//
//   bwd_dq_kernel (the forward's shape, kWaves x 16 queries per workgroup,
//   loop over key blocks of kBlockN), per block and wave:
//     S^T  = K Q^T,  dP^T = V dO^T               kBlockN/16 x D/16 WMMAs each
//     dS^T = P^T (dP^T - Dr) (dropout, softcap)  in the accumulator layout
//     dQ^T += K^T dS^T                           D'/16 x kBlockN/16 WMMAs
//   bwd_dkdv_kernel (the transpose, kWaves x 16 keys of one KV head, looping
//   over the group's query heads and query blocks of kBlockQ):
//     S = Q K^T,  dP = dO V^T                    kBlockQ/16 x D/16 WMMAs each
//     dV^T += dO^T P_dropped,  dK^T += Q^T dS    D'/16 x kBlockQ/16 WMMAs each
// A lane owns one query (dq) or key (dkdv) column and 8 rows of each 16-row
// accumulator tile, which rdna.h's rows_as_b turns into the next product's B
// operand (gfx11: four shuffles with lane l ^ 16).
//
// Every operand goes through LDS, rows padded by 8 elements (16-byte reads):
// a gfx11 operand holds a whole 16-deep step in both half-waves, so resident
// Q and dO (dq) or K and V (dkdv) would take D VGPRs beside D'/2 of fp32
// accumulators (dkdv: D'), more than the 256 a wave addresses at D >= 128.
// The staged tiles are the workgroup's own rows (dq: Q, dO; dkdv: K, V, loaded
// once), the streamed block row-major (dq: K, V; dkdv: Q, dO) and the streamed
// block transposed for the output product's A operand (dq: K^T; dkdv: Q^T,
// dO^T), of this workgroup's head-dim slice only. D = 256 uses 2-wave
// workgroups (32 rows), since 64 rows of two D = 256 tiles are 66 KiB, and
// splits the output head dim over workgroups (kDimSplit: 2 for dQ, 4 for dK
// and dV), each recomputing S and dP.
// The S and dP products read both operands from LDS in a loop over the depth,
// unrolled by 2 in the dq kernel and rolled in the dkdv kernel: fully
// unrolled, the compiler issues every step's reads at once (the forward's
// measurement, wmma_fwd_kernel.h), and the dkdv kernel unrolled by 2 spills
// 6 VGPRs at D = 128 on gfx1100.
//
// Budget per variant (VGPRs per lane, <= 256 a wave32 addresses, 1536 per
// SIMD lane; LDS <= 64 KiB per workgroup, 128 KiB per WGP). Numbers are data
// in variants.py (RDNA_CONFIGS), checked on the compiled code by
// tests/test_rocm_isa.py:
//   kernel  D    waves  block  split  LDS bytes  WMMA/iter  waves/SIMD  prefetch
//   dq      64   4      32     1      32768      24         4           yes
//   dq      128  4      32     1      62464      48         2           yes
//   dq      256  2      16     2      56832      40         1           no
//   dkdv    64   4      32     1      38144      32         3           yes
//   dkdv    128  4      16     1      55936      32         2           no (18 / 3 spills)
//   dkdv    256  2      16     4      56960      40         1           no
//   rowdot  any  8      -      -          0       0         4           -
// Measured with clang-19 (VGPRs fp16 / bf16, no spills, no scratch, SGPRs
// 64-85), gfx1100 | gfx1201:
//   dq    193 / 193, 250 / 249, 211 / 211 | 172 / 172, 230 / 228, 194 / 194
//   dkdv  244 / 241, 253 / 253, 247 / 246 | 246 / 246, 238 / 238, 215 / 203
// at D = 64, 128, 256; rowdot 14 / 16. With 128 columns per dkdv workgroup at
// D = 256 (kDimSplit 2) gfx1100 spilled 17 VGPRs and gfx1201 6.
#pragma once
#include <limits.h>
#include <math.h>

#include "rdna.h"  // first: hip_runtime.h defines __forceinline__ for the common headers

#include "bwd_common.h"

namespace portattn {
namespace rocm {
namespace PORTATTN_ROCM_ARCH_NS {

// Above D = 128 a workgroup is 2 waves: two 64-row D = 256 tiles are 66 KiB of LDS.
template <int kHeadDim>
constexpr int wmma_bwd_waves() {
  return kHeadDim > 128 ? 2 : 4;
}

// Writes columns [d0, d0 + 16 kTiles) of one output row from accumulators in
// the transposed layout (acc[u][r] is column d0 + 16u + row(lane, r)), times
// `scale`; columns past the head dim are skipped (headdim is a multiple of 8).
template <class W, bool kIsBf16, int kTiles>
__device__ __forceinline__ void store_transposed(uint16_t* g_row, const f32x8 (&acc)[kTiles], int d0, int lane,
                                                 int headdim, float scale) {
  using T = Dtype<kIsBf16>;
#pragma unroll
  for (int u = 0; u < kTiles; ++u) {
    if constexpr (W::kRowsContiguous) {  // rows 8 (lane / 16) + 0..7: one 16-byte store
      const int d = d0 + u * kWmma + W::row(lane, 0);
      if (d < headdim) {
        u16x8 packed;
#pragma unroll
        for (int r = 0; r < 8; ++r) packed[r] = T::from_float(acc[u][r] * scale);
        store<u16x8>(g_row + d, packed);
      }
    } else {
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        const int d = d0 + u * kWmma + W::row(lane, r);
        if (d < headdim) g_row[d] = T::from_float(acc[u][r] * scale);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// 2. dQ.

template <int kHeadDim_, int kBlockN_, bool kIsBf16_, int kWavesPerSimd_, bool kPrefetch_>
struct WmmaBwdDqTile {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr bool kIsBf16 = kIsBf16_;
  static constexpr int kWavesPerSimd = kWavesPerSimd_;
  static constexpr bool kPrefetch = kPrefetch_;  // next key block in flight during compute
  static constexpr int kWaves = wmma_bwd_waves<kHeadDim>();
  static constexpr int kThreads = kWaves * kWave32;
  static constexpr int kBlockM = kWaves * kWmma;
  static constexpr int kDimSplit = kHeadDim > 128 ? 2 : 1;
  static constexpr int kOutDim = kHeadDim / kDimSplit;
  static constexpr int kKeyTiles = kBlockN / kWmma;
  static constexpr int kDimSteps = kHeadDim / kWmma;
  static constexpr int kOutTiles = kOutDim / kWmma;
  static constexpr int kStride = row_stride<kHeadDim, kWmmaLdsPad>();
  static constexpr int kTStride = transposed_stride<kBlockN, kWmmaLdsPad>();
  // sQ, sdO (the workgroup's rows), sK, sV (the key block) and sKt (its
  // transpose, this workgroup's dQ columns only).
  static constexpr int kLdsBytes = 2 * ((2 * kBlockM + 2 * kBlockN) * kStride + kOutDim * kTStride);
  static constexpr int kMfmaPerIter = 2 * kKeyTiles * kDimSteps + kOutTiles * kKeyTiles;
  static_assert(kHeadDim % kWmma == 0 && kBlockN % kWmma == 0, "tiles are whole WMMA tiles");
  static_assert(kDimSteps % 2 == 0, "the S / dP loop is unrolled by 2");
  static_assert(kLdsBytes <= 65536, "one workgroup must fit 64 KiB of LDS");
};

template <class Tile>
__global__ void PORTATTN_LAUNCH_BOUNDS(Tile::kThreads, Tile::kWavesPerSimd)
    bwd_dq_kernel(const PortattnBwdParams bp) {
  const PortattnFwdParams& p = bp.fwd;
  using W = Wmma<PORTATTN_ROCM_WMMA_GEN, Tile::kIsBf16>;
  using Operand = typename W::Operand;
  __shared__ __attribute__((aligned(16))) uint16_t sQ[Tile::kBlockM * Tile::kStride];
  __shared__ __attribute__((aligned(16))) uint16_t sdO[Tile::kBlockM * Tile::kStride];
  __shared__ __attribute__((aligned(16))) uint16_t sK[Tile::kBlockN * Tile::kStride];
  __shared__ __attribute__((aligned(16))) uint16_t sV[Tile::kBlockN * Tile::kStride];
  __shared__ __attribute__((aligned(16))) uint16_t sKt[Tile::kOutDim * Tile::kTStride];

  const int b = blockIdx.z, h = blockIdx.y;
  const SeqBounds seq = seq_bounds(p, b);
  const int m0 = (blockIdx.x / Tile::kDimSplit) * Tile::kBlockM;
  const int d0 = (blockIdx.x % Tile::kDimSplit) * Tile::kOutDim;  // this workgroup's dQ head-dim slice
  if (m0 >= seq.len_q) return;
  const int lane = threadIdx.x % kWave32;
  const int lq = lane % kWmma;      // the query column this lane owns in every tile
  const int k0 = W::k_first(lane);  // first depth index of this lane's operand slots
  const int i = m0 + (threadIdx.x / kWave32) * kWmma + lq;
  const bool row_valid = i < seq.len_q;
  const int hk = h / (p.nheads / p.nheads_k);

  const uint16_t* gK = head_row(p.k, p.k_strides, b, seq.k_start, hk);
  const uint16_t* gV = head_row(p.v, p.v_strides, b, seq.k_start, hk);
  uint16_t* const gdQ = opaque(head_row(bp.dq, bp.dq_strides, b, seq.q_start + i, h));
  {  // Q and dO rows (zero past the sequence); the first key block's barrier publishes them.
    TileInFlight<Tile::kBlockM, Tile::kHeadDim, Tile::kThreads, kWmmaLdsPad> rows;
    rows.fetch(head_row(p.q, p.q_strides, b, seq.q_start, h), p.q_strides.row_stride, m0, seq.len_q, p.headdim);
    rows.deposit(sQ, nullptr);
    rows.fetch(head_row(bp.dout, bp.dout_strides, b, seq.q_start, h), bp.dout_strides.row_stride, m0, seq.len_q,
               p.headdim);
    rows.deposit(sdO, nullptr);
  }
  const int own_row = ((threadIdx.x / kWave32) * kWmma + lq) * Tile::kStride + k0;
  const float lse_log2 = lse_log2_or_inf(p, seq, b, h, i);
  const float rowdot = row_valid ? rowdot_row(bp, b, h)[i] : 0.f;

  // The keys the block's rows see: Note [portattn visible keys] (block_range.h).
  const MaskRule rule = MaskRule::of(seq, p.window_left, p.window_right);
  const int diag = rule.diag;
  const int q_last = min(m0 + Tile::kBlockM, seq.len_q) - 1;
  const IndexRange keys = rule.key_range(m0, q_last);
  const ScoreOptions opt = score_options(p, b, h);
  const DropoutLane dropout(p, b, h);

  f32x8 acc_dq[Tile::kOutTiles];
#pragma unroll
  for (int u = 0; u < Tile::kOutTiles; ++u) acc_dq[u] = f32x8{};

  KeyBlockStream<Tile::kBlockN, Tile::kHeadDim, Tile::kThreads, Tile::kPrefetch, kWmmaLdsPad> kv{
      gK, gV, p, seq.len_k, keys.end};
  const int n_first = (keys.begin / Tile::kBlockN) * Tile::kBlockN;
  kv.start(n_first);

  for (int n0 = n_first; n0 < keys.end; n0 += Tile::kBlockN) {
    kv.stage(n0, sK, sKt, sV, nullptr, d0, d0 + Tile::kOutDim);

    const bool block_visible = rule.tile_fully_visible(m0, q_last, n0, n0 + Tile::kBlockN - 1);
    // Register r of tile t is key lane_key0 + c, c = 16t + row_step(r) (a
    // constant): every test compares c with per-lane bounds, as in the forward.
    const int lane_key0 = n0 + W::row(lane, 0);
    const int rel_diag = i + diag - lane_key0;
    const int c_lo = rule.window_left >= 0 ? rel_diag - rule.window_left : INT_MIN;
    const int c_hi = min(rule.window_right >= 0 ? rel_diag + rule.window_right : INT_MAX, seq.len_k - lane_key0 - 1);

    Operand rdS[Tile::kKeyTiles];  // dS^T as B operands of dQ^T, one 16-key step per tile
#pragma unroll
    for (int t = 0; t < Tile::kKeyTiles; ++t) {
      f32x8 acc_s = f32x8{}, acc_dp = f32x8{};
      const uint16_t* k_row = sK + (t * kWmma + lq) * Tile::kStride + k0;
      const uint16_t* v_row = sV + (t * kWmma + lq) * Tile::kStride + k0;
#pragma unroll 2
      for (int s = 0; s < Tile::kDimSteps; ++s) {
        acc_s = W::mma(W::read(k_row + s * kWmma), W::read(sQ + own_row + s * kWmma), acc_s);
        acc_dp = W::mma(W::read(v_row + s * kWmma), W::read(sdO + own_row + s * kWmma), acc_dp);
      }
      // Keep bits, bit r for register r. Philox draws 4 consecutive keys of a
      // query: gfx12's registers are keys 8 (lane / 16) + 0..7 (2 draws);
      // gfx11's are keys 2r + lane / 16, two in each group of 4 (4 draws).
      uint32_t kept = 0xFFu;
      if (dropout.on) {
        kept = 0;
        if constexpr (W::kRowsContiguous) {
#pragma unroll
          for (int g = 0; g < 2; ++g) kept |= dropout.keep4(i, lane_key0 + t * kWmma + 4 * g) << (4 * g);
        } else {
          const int half = lane / 16;
#pragma unroll
          for (int g = 0; g < 4; ++g) {
            const uint32_t bits = dropout.keep4(i, n0 + t * kWmma + 4 * g);
            kept |= ((bits >> half) & 1u) << (2 * g) | ((bits >> (2 + half)) & 1u) << (2 * g + 1);
          }
        }
      }
      float ds[8];
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        const int c = t * kWmma + W::row_step(r);
        float dtanh;
        const bool visible = block_visible | ((c >= c_lo) & (c <= c_hi));
        const float prob = probability(acc_s[r], opt, rel_diag - c, lse_log2, visible, dtanh);
        const float dp = (kept >> r) & 1u ? acc_dp[r] * dropout.scale : 0.f;
        ds[r] = prob * (dp - rowdot) * dtanh;
      }
      rdS[t] = W::rows_as_b(ds);
    }

#pragma unroll
    for (int u = 0; u < Tile::kOutTiles; ++u) {
#pragma unroll
      for (int t = 0; t < Tile::kKeyTiles; ++t) {
        const Operand a = W::read(sKt + (u * kWmma + lq) * Tile::kTStride + t * kWmma + k0);
        acc_dq[u] = W::mma(a, rdS[t], acc_dq[u]);
      }
    }
  }

  if (row_valid) store_transposed<W, Tile::kIsBf16>(gdQ, acc_dq, d0, lane, p.headdim, p.softmax_scale);
}

// ---------------------------------------------------------------------------
// 3. dK, dV.

template <int kHeadDim_, int kBlockQ_, bool kIsBf16_, int kWavesPerSimd_, bool kPrefetch_>
struct WmmaBwdDkdvTile {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockQ = kBlockQ_;
  static constexpr bool kIsBf16 = kIsBf16_;
  static constexpr int kWavesPerSimd = kWavesPerSimd_;
  static constexpr bool kPrefetch = kPrefetch_;  // next query block in flight during compute
  static constexpr int kWaves = wmma_bwd_waves<kHeadDim>();
  static constexpr int kThreads = kWaves * kWave32;
  static constexpr int kBlockN = kWaves * kWmma;  // keys per workgroup
  static constexpr int kQueryTiles = kBlockQ / kWmma;
  static constexpr int kDimSteps = kHeadDim / kWmma;
  // D = 256: 4 workgroups of 64 columns (64 VGPRs of dK^T, dV^T; 2 of 128
  // columns spill, see the docblock).
  static constexpr int kDimSplit = kHeadDim > 128 ? 4 : 1;
  static constexpr int kOutDim = kHeadDim / kDimSplit;
  static constexpr int kOutTiles = kOutDim / kWmma;
  static constexpr int kStride = row_stride<kHeadDim, kWmmaLdsPad>();
  static constexpr int kTStride = transposed_stride<kBlockQ, kWmmaLdsPad>();
  // sK, sV (the workgroup's keys), sQ, sdO (the query block), sQt, sdOt (its
  // transpose, this workgroup's columns), fp32 LSE and Dr per query.
  static constexpr int kLdsBytes =
      2 * ((2 * kBlockN + 2 * kBlockQ) * kStride + 2 * kOutDim * kTStride) + 2 * 4 * kBlockQ;
  static constexpr int kMfmaPerIter = 2 * kQueryTiles * kDimSteps + 2 * kOutTiles * kQueryTiles;
  static_assert(kHeadDim % kWmma == 0 && kBlockQ % kWmma == 0, "tiles are whole WMMA tiles");
  static_assert(kBlockQ <= kThreads, "one lane per query stages LSE and Dr");
  static_assert(kLdsBytes <= 65536, "one workgroup must fit 64 KiB of LDS");
};

template <class Tile>
__global__ void PORTATTN_LAUNCH_BOUNDS(Tile::kThreads, Tile::kWavesPerSimd)
    bwd_dkdv_kernel(const PortattnBwdParams bp) {
  const PortattnFwdParams& p = bp.fwd;
  using W = Wmma<PORTATTN_ROCM_WMMA_GEN, Tile::kIsBf16>;
  using Operand = typename W::Operand;
  __shared__ __attribute__((aligned(16))) uint16_t sK[Tile::kBlockN * Tile::kStride];
  __shared__ __attribute__((aligned(16))) uint16_t sV[Tile::kBlockN * Tile::kStride];
  __shared__ __attribute__((aligned(16))) uint16_t sQ[Tile::kBlockQ * Tile::kStride];
  __shared__ __attribute__((aligned(16))) uint16_t sdO[Tile::kBlockQ * Tile::kStride];
  __shared__ __attribute__((aligned(16))) uint16_t sQt[Tile::kOutDim * Tile::kTStride];
  __shared__ __attribute__((aligned(16))) uint16_t sdOt[Tile::kOutDim * Tile::kTStride];
  __shared__ float sLse[Tile::kBlockQ];     // log2 units, +inf for rows without keys / past the end
  __shared__ float sRowdot[Tile::kBlockQ];  // Dr

  const int b = blockIdx.z, hk = blockIdx.y;
  const SeqBounds seq = seq_bounds(p, b);
  const int n0 = (blockIdx.x / Tile::kDimSplit) * Tile::kBlockN;
  const int d0 = (blockIdx.x % Tile::kDimSplit) * Tile::kOutDim;  // this workgroup's head-dim slice
  if (n0 >= seq.len_k) return;
  const int lane = threadIdx.x % kWave32;
  const int lk = lane % kWmma;  // the key column this lane owns in every tile
  const int k0 = W::k_first(lane);
  const int j = n0 + (threadIdx.x / kWave32) * kWmma + lk;  // this lane's key
  const bool key_valid = j < seq.len_k;
  const int group = p.nheads / p.nheads_k;

  {  // K and V rows (zero past the sequence); the first query block's barrier publishes them.
    TileInFlight<Tile::kBlockN, Tile::kHeadDim, Tile::kThreads, kWmmaLdsPad> rows;
    rows.fetch(head_row(p.k, p.k_strides, b, seq.k_start, hk), p.k_strides.row_stride, n0, seq.len_k, p.headdim);
    rows.deposit(sK, nullptr);
    rows.fetch(head_row(p.v, p.v_strides, b, seq.k_start, hk), p.v_strides.row_stride, n0, seq.len_k, p.headdim);
    rows.deposit(sV, nullptr);
  }
  const int own_row = ((threadIdx.x / kWave32) * kWmma + lk) * Tile::kStride + k0;

  // Output rows, addressed now and moved to VGPRs (opaque): their uniform parts
  // would otherwise pin SGPRs across the loops.
  uint16_t* const gdK = opaque(head_row(bp.dk, bp.dk_strides, b, seq.k_start + j, hk));
  uint16_t* const gdV = opaque(head_row(bp.dv, bp.dv_strides, b, seq.k_start + j, hk));

  // The queries that see the block's keys: Note [portattn visible keys] (block_range.h).
  const MaskRule rule = MaskRule::of(seq, p.window_left, p.window_right);
  const int diag = rule.diag;
  const IndexRange queries = rule.query_range(n0, min(n0 + Tile::kBlockN, seq.len_k) - 1);

  DropoutLane dropout(p, b, hk * group);  // bh is set per query head below
  f32x8 acc_dk[Tile::kOutTiles], acc_dv[Tile::kOutTiles];
#pragma unroll
  for (int u = 0; u < Tile::kOutTiles; ++u) acc_dk[u] = acc_dv[u] = f32x8{};

  const int m_first = (queries.begin / Tile::kBlockQ) * Tile::kBlockQ;
  TileInFlight<Tile::kBlockQ, Tile::kHeadDim, Tile::kThreads, kWmmaLdsPad> next_q, next_do;
  for (int h = hk * group; h < (hk + 1) * group; ++h) {
    const uint16_t* gQ = head_row(p.q, p.q_strides, b, seq.q_start, h);
    const uint16_t* gdO = head_row(bp.dout, bp.dout_strides, b, seq.q_start, h);
    auto fetch = [&](int m) {
      next_q.fetch(gQ, p.q_strides.row_stride, m, seq.len_q, p.headdim);
      next_do.fetch(gdO, bp.dout_strides.row_stride, m, seq.len_q, p.headdim);
    };
    const ScoreOptions opt = score_options(p, b, h);
    dropout.bh = b * p.nheads + h;
    const float* rowdot = rowdot_row(bp, b, h);
    // Prefetching stays within one query head: its first block is fetched here.
    if (Tile::kPrefetch && m_first < queries.end) fetch(m_first);

    for (int m0 = m_first; m0 < queries.end; m0 += Tile::kBlockQ) {
      __syncthreads();
      if (Tile::kPrefetch) {
        next_q.deposit(sQ, sQt, d0, d0 + Tile::kOutDim);
        next_do.deposit(sdO, sdOt, d0, d0 + Tile::kOutDim);
      } else {  // one tile's reads in registers at a time (D = 256: 32 VGPRs each beside 128 of dK^T, dV^T)
        next_q.fetch(gQ, p.q_strides.row_stride, m0, seq.len_q, p.headdim);
        next_q.deposit(sQ, sQt, d0, d0 + Tile::kOutDim);
        next_q.fetch(gdO, bp.dout_strides.row_stride, m0, seq.len_q, p.headdim);
        next_q.deposit(sdO, sdOt, d0, d0 + Tile::kOutDim);
      }
      if (threadIdx.x < Tile::kBlockQ) {
        const int row = m0 + threadIdx.x;
        sLse[threadIdx.x] = lse_log2_or_inf(p, seq, b, h, row);
        sRowdot[threadIdx.x] = row < seq.len_q ? rowdot[row] : 0.f;
      }
      __syncthreads();
      if (Tile::kPrefetch && m0 + Tile::kBlockQ < queries.end) fetch(m0 + Tile::kBlockQ);

      // Register r of tile t is query lane_query0 + c, c = 16t + row_step(r);
      // the queries that see key j (rule.visible) as offsets c from lane_query0.
      const int lane_query0 = m0 + W::row(lane, 0);
      const int rel_diag = lane_query0 + diag - j;  // i + diag - j at c = 0
      const int c_lo = rule.window_right >= 0 ? j - diag - rule.window_right - lane_query0 : INT_MIN;
      const int c_hi = key_valid ? min(rule.window_left >= 0 ? j - diag + rule.window_left - lane_query0 : INT_MAX,
                                       seq.len_q - 1 - lane_query0)
                                 : -1;

      Operand rP[Tile::kQueryTiles], rdS[Tile::kQueryTiles];  // B operands, one 16-query step per tile
#pragma unroll
      for (int t = 0; t < Tile::kQueryTiles; ++t) {
        f32x8 acc_s = f32x8{}, acc_dp = f32x8{};
        const uint16_t* q_row = sQ + (t * kWmma + lk) * Tile::kStride + k0;
        const uint16_t* do_row = sdO + (t * kWmma + lk) * Tile::kStride + k0;
#pragma unroll 1
        for (int s = 0; s < Tile::kDimSteps; ++s) {
          acc_s = W::mma(W::read(q_row + s * kWmma), W::read(sK + own_row + s * kWmma), acc_s);
          acc_dp = W::mma(W::read(do_row + s * kWmma), W::read(sV + own_row + s * kWmma), acc_dp);
        }
        // This lane walks queries and Philox draws 4 keys of one query, so one
        // draw per element, in a rolled loop that keeps its registers few.
        uint32_t kept = 0xFFu;
        if (dropout.on) {
          kept = 0;
#pragma unroll 1
          for (int r = 0; r < 8; ++r) kept |= dropout.keep1(lane_query0 + t * kWmma + W::row_step(r), j) << r;
        }
        float pd[8], ds[8];
#pragma unroll
        for (int r = 0; r < 8; ++r) {
          const int c = t * kWmma + W::row_step(r);
          const int row = W::row(lane, 0) + c;  // query index inside the block
          float dtanh;
          const bool visible = (c >= c_lo) & (c <= c_hi);
          const float prob = probability(acc_s[r], opt, rel_diag + c, sLse[row], visible, dtanh);
          const float keep_scale = (kept >> r) & 1u ? dropout.scale : 0.f;
          pd[r] = prob * keep_scale;
          ds[r] = prob * (acc_dp[r] * keep_scale - sRowdot[row]) * dtanh;
        }
        rP[t] = W::rows_as_b(pd);
        rdS[t] = W::rows_as_b(ds);
      }

#pragma unroll
      for (int u = 0; u < Tile::kOutTiles; ++u) {
#pragma unroll
        for (int t = 0; t < Tile::kQueryTiles; ++t) {
          const int at = (u * kWmma + lk) * Tile::kTStride + t * kWmma + k0;
          acc_dv[u] = W::mma(W::read(sdOt + at), rP[t], acc_dv[u]);
          acc_dk[u] = W::mma(W::read(sQt + at), rdS[t], acc_dk[u]);
        }
      }
    }
  }

  if (!key_valid) return;
  store_transposed<W, Tile::kIsBf16>(gdK, acc_dk, d0, lane, p.headdim, p.softmax_scale);
  store_transposed<W, Tile::kIsBf16>(gdV, acc_dv, d0, lane, p.headdim, 1.f);
}

template <class DqTile, class DkdvTile>
hipError_t launch_bwd(const PortattnBwdParams& p) {
  return launch_bwd_kernels<DqTile, DkdvTile>(p, bwd_dq_kernel<DqTile>, bwd_dkdv_kernel<DkdvTile>);
}

}  // namespace PORTATTN_ROCM_ARCH_NS
}  // namespace rocm
}  // namespace portattn
