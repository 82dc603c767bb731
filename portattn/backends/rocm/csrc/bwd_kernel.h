// Backward attention on CDNA matrix cores (gfx90a, gfx942, gfx950): three kernels,
// no atomics, so the result is bitwise reproducible by construction.
//
// Note [portattn rocm backward]
//   1. bwd_rowdot_kernel: Dr[i] = rowsum(dO * O) (fp32, into the workspace).
//   2. bwd_dq_kernel, the forward's shape (128 queries per workgroup, loop
//      over key blocks of kBlockN): per key block each wave computes
//        S^T  = K Q^T,  dP^T = V dO^T                  (keys x 32 queries)
//        P    = exp2(S log2e - lse log2e),  dS = P * (dP - Dr)   (dropout, softcap applied)
//        dQ^T += K^T dS^T                               (D x 32 queries)
//      with Q and dO resident as B operands and K^T from a transposed copy
//      of the K tile.
//   3. bwd_dkdv_kernel, the transpose (128 keys per workgroup, one KV head,
//      looping over the query heads of its GQA group and query blocks of
//      kBlockQ): per query block each wave computes
//        S = Q K^T,  dP = dO V^T                        (kBlockQ queries x 32 keys)
//        dV^T += dO^T P_dropped,  dK^T += Q^T dS        (D x 32 keys)
//      with K and V resident and Q^T, dO^T read down the columns of the
//      row-major tiles. Summing the group inside one workgroup is what makes
//      GQA need no dK/dV accumulator.
// Kernel 1, the per-element probability and the launch are bwd_common.h's,
// shared with the RDNA backward (wmma_bwd_kernel.h: the same design on WMMA).
// Recomputing S and dP in both kernels costs 7 matrix products per tile pair
// instead of FlashAttention-2's 5 (which adds dQ with fp32 atomics); it buys
// determinism, no dQ workspace and no conversion pass. The register layouts
// are those of Note [portattn MFMA layout]: the lane owning a query (dq
// kernel) or a key (dkdv kernel) holds 4 consecutive keys / queries per
// register group, which is also the B operand of the following product.
//
// D=256 splits the dQ / dK,dV head dim over 2 workgroups per block (kDimSplit),
// each recomputing S and dP, so the accumulators fit next to the resident
// operands.
//
// Budgets (registers per lane, a workgroup is one wave per SIMD; data in
// variants.py (CONFIGS), checked on the compiled kernels by
// tests/test_rocm_isa.py). Measured VGPR+AGPR total (AGPR), gfx90a / gfx942:
//   kernel  D    block  LDS bytes  MFMA/iter  budget  waves/SIMD  prefetch  measured
//   dq      64   64     26112      48         256     2           no        241-242 (0) / 238-239 (0)
//   dq      128  32     26112      48         512     1           yes       304 (96) / 332-333 (76-77)
//   dq      256  32     51712      80         512     1           yes       394-395 (138-139) / 424-425 (168-169)
//   dkdv    64   32      8960      32         256     2           no        245-246 (0) / 249-250 (0)
//   dkdv    128  32     17152      64         512     1           yes       442 (186) / 404 (160)
//   dkdv    256  32     33536      96         512     1           no        483 (227) / 453 (197)
//   rowdot  any  -          0       0         128     4           -         22-26 (0)
// gfx950 (clang-22): the same tiles with the double-depth 32x32x16 MFMAs (Note
// [portattn MFMA double depth] in cdna.h), MFMA/iter halved (dq 24 / 24 / 40,
// dkdv 16 / 32 / 48 at D = 64 / 128 / 256); measured fp16 / bf16:
//   dq 232 / 233, 282 (26) / 282 (26), 380 (124) / 380 (124);
//   dkdv 239 / 240, 362 (106) / 364 (108), 443 (187) / 445 (189).
// At D=128 two waves per SIMD spill there too (bf16 without prefetch: dq 6,
// dkdv 83 VGPRs), so CDNA4's larger LDS buys the backward nothing.
// SGPRs 66-101, no spills, no scratch. dq LDS: K, V and K^T; dkdv LDS: Q, dO
// and 256 bytes of per-query LSE and rowsum. At D=128 both dq and dkdv need a
// few registers more than 256 (2-4 spills when held to 2 waves per SIMD), so
// they are designed for one.
#pragma once
#include <limits.h>
#include <math.h>

#include "cdna.h"  // first: hip_runtime.h defines __forceinline__ for the common headers

#include "bwd_common.h"

namespace portattn {
namespace rocm {
namespace PORTATTN_ROCM_ARCH_NS {

// S and dP of one 32 x 32 tile (rows from two row-major LDS tiles as A
// operands, the lane's resident fragments as B operands).
template <bool kIsBf16, int kDimSteps>
__device__ __forceinline__ void scores_and_grads(f32x16& acc_s, f32x16& acc_dp, const uint16_t* lds_s,
                                                 const uint16_t* lds_dp, int stride, int row, int lh,
                                                 const u16x4 (&b_s)[kDimSteps], const u16x4 (&b_dp)[kDimSteps]) {
  using T = Dtype<kIsBf16>;
  acc_s = acc_dp = f32x16{};
#pragma unroll
  for (int s = 0; s < kDimSteps; s += kStepsPerMfma) {
    acc_s = T::mfma(operand_along_row(lds_s, stride, row, s * kMfmaK + 4 * lh), operand_at(b_s, s), acc_s);
    acc_dp = T::mfma(operand_along_row(lds_dp, stride, row, s * kMfmaK + 4 * lh), operand_at(b_dp, s), acc_dp);
  }
}

// Writes columns [d0, d0 + 32 kTiles) of one output row from accumulators in
// the transposed layout (Note [portattn MFMA layout]: 4 consecutive columns per
// register group), times `scale`; columns past the head dim are skipped.
template <bool kIsBf16, int kTiles>
__device__ __forceinline__ void store_row(uint16_t* g_row, const f32x16 (&acc)[kTiles], int d0, int lh, int headdim,
                                          float scale) {
#pragma unroll
  for (int u = 0; u < kTiles; ++u) {
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      const int d = d0 + u * kMfmaM + 8 * g + 4 * lh;
      if (d >= headdim) continue;
      store<u16x4>(g_row + d, pack4<kIsBf16>(acc[u][4 * g] * scale, acc[u][4 * g + 1] * scale,
                                              acc[u][4 * g + 2] * scale, acc[u][4 * g + 3] * scale));
    }
  }
}

// ---------------------------------------------------------------------------
// 2. dQ.

template <int kHeadDim_, int kBlockN_, bool kIsBf16_, int kWavesPerSimd_, bool kPrefetch_>
struct BwdDqTile {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr bool kIsBf16 = kIsBf16_;
  static constexpr int kWavesPerSimd = kWavesPerSimd_;
  static constexpr bool kPrefetch = kPrefetch_;  // next key block in flight during compute
  static constexpr int kWaves = 4;
  static constexpr int kThreads = kWaves * kWaveSize;
  static constexpr int kBlockM = kWaves * kMfmaM;
  static constexpr int kKeyTiles = kBlockN / kMfmaM;
  static constexpr int kDimSteps = kHeadDim / kMfmaK;
  static constexpr int kDimTiles = kHeadDim / kMfmaM;
  static constexpr int kKeySteps = kBlockN / kMfmaK;
  // As in the dkdv kernel, D=256 splits the dQ head dim over 2 workgroups.
  static constexpr int kDimSplit = kHeadDim > 128 ? 2 : 1;
  static constexpr int kOutDim = kHeadDim / kDimSplit;
  static constexpr int kOutTiles = kOutDim / kMfmaM;
  static constexpr int kStride = row_stride<kHeadDim>();
  static constexpr int kTStride = transposed_stride<kBlockN>();
  // sK, sV row-major (A operands of S^T, dP^T) and sKt (A operand of dQ^T):
  // the transposed copy makes that operand one 8-byte read instead of four
  // 2-byte ones, which also keeps fewer fragments in flight.
  static constexpr int kLdsBytes = 2 * (2 * kBlockN * kStride + kHeadDim * kTStride);
  static constexpr int kMfmaPerIter = (2 * kKeyTiles * kDimSteps + kOutTiles * kKeySteps) / kStepsPerMfma;
  static_assert(kHeadDim % kMfmaM == 0 && kBlockN % kMfmaM == 0, "tiles are whole MFMA tiles");
  static_assert(kLdsBytes <= kLdsBytesPerCu, "one workgroup must fit a CU's LDS");
};

template <class Tile>
__global__ void PORTATTN_LAUNCH_BOUNDS(Tile::kThreads, Tile::kWavesPerSimd)
    bwd_dq_kernel(const PortattnBwdParams bp) {
  const PortattnFwdParams& p = bp.fwd;
  using T = Dtype<Tile::kIsBf16>;
  __shared__ __attribute__((aligned(16))) uint16_t sK[Tile::kBlockN * Tile::kStride];
  __shared__ __attribute__((aligned(16))) uint16_t sV[Tile::kBlockN * Tile::kStride];
  __shared__ __attribute__((aligned(16))) uint16_t sKt[Tile::kHeadDim * Tile::kTStride];

  const int b = blockIdx.z, h = blockIdx.y;
  const SeqBounds seq = seq_bounds(p, b);
  const int m0 = (blockIdx.x / Tile::kDimSplit) * Tile::kBlockM;
  const int d0 = (blockIdx.x % Tile::kDimSplit) * Tile::kOutDim;  // this workgroup's dQ head-dim slice
  if (m0 >= seq.len_q) return;
  const int lane = threadIdx.x % kWaveSize;
  const int lq = lane % kMfmaM, lh = lane / kMfmaM;
  const int i = m0 + (threadIdx.x / kWaveSize) * kMfmaM + lq;
  const bool row_valid = i < seq.len_q;
  const int hk = h / (p.nheads / p.nheads_k);

  const uint16_t* gQ = head_row(p.q, p.q_strides, b, seq.q_start, h);
  const uint16_t* gdO = head_row(bp.dout, bp.dout_strides, b, seq.q_start, h);
  const uint16_t* gK = head_row(p.k, p.k_strides, b, seq.k_start, hk);
  const uint16_t* gV = head_row(p.v, p.v_strides, b, seq.k_start, hk);
  // Moved to VGPRs (opaque): its uniform part would otherwise pin SGPRs across the loop.
  uint16_t* const gdQ = opaque(head_row(bp.dq, bp.dq_strides, b, seq.q_start + i, h));

  u16x4 rQ[Tile::kDimSteps], rdO[Tile::kDimSteps];  // B operands of S^T and dP^T
#pragma unroll
  for (int s = 0; s < Tile::kDimSteps; ++s) {
    rQ[s] = rdO[s] = u16x4{0, 0, 0, 0};
    if (row_valid && s * kMfmaK < p.headdim) {
      rQ[s] = load<u16x4>(gQ + i * p.q_strides.row_stride + s * kMfmaK + 4 * lh);
      rdO[s] = load<u16x4>(gdO + i * bp.dout_strides.row_stride + s * kMfmaK + 4 * lh);
    }
  }
  const float lse_log2 = lse_log2_or_inf(p, seq, b, h, i);
  const float rowdot = row_valid ? rowdot_row(bp, b, h)[i] : 0.f;

  // The keys the block's rows see: Note [portattn visible keys] (block_range.h).
  const MaskRule rule = MaskRule::of(seq, p.window_left, p.window_right);
  const int diag = rule.diag;
  const int q_last = min(m0 + Tile::kBlockM, seq.len_q) - 1;
  const IndexRange keys = rule.key_range(m0, q_last);

  const ScoreOptions opt = score_options(p, b, h);
  const DropoutLane dropout(p, b, h);

  f32x16 acc_dq[Tile::kOutTiles];
#pragma unroll
  for (int u = 0; u < Tile::kOutTiles; ++u) acc_dq[u] = f32x16{};

  KeyBlockStream<Tile::kBlockN, Tile::kHeadDim, Tile::kThreads, Tile::kPrefetch> kv{gK, gV, p, seq.len_k, keys.end};
  const int n_first = (keys.begin / Tile::kBlockN) * Tile::kBlockN;
  kv.start(n_first);

  for (int n0 = n_first; n0 < keys.end; n0 += Tile::kBlockN) {
    kv.stage(n0, sK, sKt, sV, nullptr);

    const bool block_visible = rule.tile_fully_visible(m0, q_last, n0, n0 + Tile::kBlockN - 1);
    const int lane_key0 = n0 + 4 * lh;
    const int rel_diag = i + diag - lane_key0;
    // rule.keys_of_query(i) as offsets c from lane_key0 (written out: block_range.h says why).
    const int c_lo = rule.window_left >= 0 ? rel_diag - rule.window_left : INT_MIN;
    const int c_hi = min(rule.window_right >= 0 ? rel_diag + rule.window_right : INT_MAX, seq.len_k - lane_key0 - 1);

    u16x4 rdS[Tile::kKeyTiles * 4];  // dS^T as B operands, 4 keys per register group
#pragma unroll
    for (int t = 0; t < Tile::kKeyTiles; ++t) {
      f32x16 acc_s, acc_dp;
      scores_and_grads<Tile::kIsBf16>(acc_s, acc_dp, sK, sV, Tile::kStride, t * kMfmaM + lq, lh, rQ, rdO);
      // Register group g holds keys lane_key0 + 32t + 8g + 0..3 of query i: one
      // Philox call each, in a rolled loop that keeps its registers few.
      uint32_t kept = 0xFFFFu;  // bit r: element r survives dropout
      if (dropout.on) {
        kept = 0;
#pragma unroll 1
        for (int g = 0; g < 4; ++g) kept |= dropout.keep4(i, lane_key0 + t * kMfmaM + 8 * g) << (4 * g);
      }
#pragma unroll
      for (int g = 0; g < 4; ++g) {
        float ds[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = 4 * g + e;
          const int c = t * kMfmaM + 8 * g + e;
          float dtanh;
          const bool visible = block_visible | ((c >= c_lo) & (c <= c_hi));
          const float prob = probability(acc_s[r], opt, rel_diag - c, lse_log2, visible, dtanh);
          const float dp = (kept >> r) & 1u ? acc_dp[r] * dropout.scale : 0.f;
          ds[e] = prob * (dp - rowdot) * dtanh;
        }
        rdS[t * 4 + g] = pack4<Tile::kIsBf16>(ds[0], ds[1], ds[2], ds[3]);
      }
    }

#pragma unroll
    for (int u = 0; u < Tile::kOutTiles; ++u) {
#pragma unroll
      for (int s = 0; s < Tile::kKeySteps; s += kStepsPerMfma) {
        const MfmaOperand a = operand_along_row(sKt, Tile::kTStride, d0 + u * kMfmaM + lq, s * kMfmaK + 4 * lh);
        acc_dq[u] = T::mfma(a, operand_at(rdS, s), acc_dq[u]);
      }
    }
  }

  if (row_valid) store_row<Tile::kIsBf16>(gdQ, acc_dq, d0, lh, p.headdim, p.softmax_scale);
}

// ---------------------------------------------------------------------------
// 3. dK, dV.

template <int kHeadDim_, int kBlockQ_, bool kIsBf16_, int kWavesPerSimd_, bool kPrefetch_>
struct BwdDkdvTile {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockQ = kBlockQ_;
  static constexpr bool kIsBf16 = kIsBf16_;
  static constexpr int kWavesPerSimd = kWavesPerSimd_;
  static constexpr bool kPrefetch = kPrefetch_;  // next query block in flight during compute
  static constexpr int kWaves = 4;
  static constexpr int kThreads = kWaves * kWaveSize;
  static constexpr int kBlockN = kWaves * kMfmaM;  // keys per workgroup
  static constexpr int kQueryTiles = kBlockQ / kMfmaM;
  static constexpr int kDimSteps = kHeadDim / kMfmaK;
  static constexpr int kDimTiles = kHeadDim / kMfmaM;
  static constexpr int kQuerySteps = kBlockQ / kMfmaK;
  // Above D=128, K + V fragments (D/2 VGPRs) and the dK^T, dV^T accumulators
  // (D) do not fit 512 registers with the score tiles: kDimSplit workgroups
  // share a key block, each accumulating dK and dV for its slice of the head
  // dim (S and dP are recomputed by each, +50% MFMAs at D=256).
  static constexpr int kDimSplit = kHeadDim > 128 ? 2 : 1;
  static constexpr int kOutDim = kHeadDim / kDimSplit;
  static constexpr int kOutTiles = kOutDim / kMfmaM;
  static constexpr int kStride = row_stride<kHeadDim>();
  static constexpr int kLdsBytes = 2 * 2 * kBlockQ * kStride + 2 * kBlockQ * 4;  // sQ, sdO, LSE, Dr
  static constexpr int kMfmaPerIter = (2 * kQueryTiles * kDimSteps + 2 * kOutTiles * kQuerySteps) / kStepsPerMfma;
  static_assert(kHeadDim % kMfmaM == 0 && kBlockQ % kMfmaM == 0, "tiles are whole MFMA tiles");
  static_assert(kOutDim % kMfmaM == 0, "head-dim slices are whole MFMA tiles");
  static_assert(kBlockQ <= kThreads, "one lane per query stages LSE and Dr");
  static_assert(kLdsBytes <= kLdsBytesPerCu, "one workgroup must fit a CU's LDS");
};

template <class Tile>
__global__ void PORTATTN_LAUNCH_BOUNDS(Tile::kThreads, Tile::kWavesPerSimd)
    bwd_dkdv_kernel(const PortattnBwdParams bp) {
  const PortattnFwdParams& p = bp.fwd;
  using T = Dtype<Tile::kIsBf16>;
  __shared__ __attribute__((aligned(16))) uint16_t sQ[Tile::kBlockQ * Tile::kStride];
  __shared__ __attribute__((aligned(16))) uint16_t sdO[Tile::kBlockQ * Tile::kStride];
  __shared__ float sLse[Tile::kBlockQ];     // log2 units, +inf for rows without keys / past the end
  __shared__ float sRowdot[Tile::kBlockQ];  // Dr

  const int b = blockIdx.z, hk = blockIdx.y;
  const SeqBounds seq = seq_bounds(p, b);
  const int n0 = (blockIdx.x / Tile::kDimSplit) * Tile::kBlockN;
  const int d0 = (blockIdx.x % Tile::kDimSplit) * Tile::kOutDim;  // this workgroup's head-dim slice
  if (n0 >= seq.len_k) return;
  const int lane = threadIdx.x % kWaveSize;
  const int lk = lane % kMfmaM, lh = lane / kMfmaM;
  const int j = n0 + (threadIdx.x / kWaveSize) * kMfmaM + lk;  // this lane's key
  const bool key_valid = j < seq.len_k;
  const int group = p.nheads / p.nheads_k;

  const uint16_t* gK = head_row(p.k, p.k_strides, b, seq.k_start, hk);
  const uint16_t* gV = head_row(p.v, p.v_strides, b, seq.k_start, hk);
  u16x4 rK[Tile::kDimSteps], rV[Tile::kDimSteps];  // B operands of S and dP, resident
#pragma unroll
  for (int s = 0; s < Tile::kDimSteps; ++s) {
    rK[s] = rV[s] = u16x4{0, 0, 0, 0};
    if (key_valid && s * kMfmaK < p.headdim) {
      rK[s] = load<u16x4>(gK + j * p.k_strides.row_stride + s * kMfmaK + 4 * lh);
      rV[s] = load<u16x4>(gV + j * p.v_strides.row_stride + s * kMfmaK + 4 * lh);
    }
  }

  // Output rows, addressed now and moved to VGPRs (opaque), where the loop
  // below leaves room: otherwise their uniform parts pin SGPRs across it.
  uint16_t* const gdK = opaque(head_row(bp.dk, bp.dk_strides, b, seq.k_start + j, hk));
  uint16_t* const gdV = opaque(head_row(bp.dv, bp.dv_strides, b, seq.k_start + j, hk));

  // The queries that see the block's keys: Note [portattn visible keys] (block_range.h).
  const MaskRule rule = MaskRule::of(seq, p.window_left, p.window_right);
  const int diag = rule.diag;
  const IndexRange queries = rule.query_range(n0, min(n0 + Tile::kBlockN, seq.len_k) - 1);

  DropoutLane dropout(p, b, hk * group);  // bh is set per query head below
  f32x16 acc_dk[Tile::kOutTiles], acc_dv[Tile::kOutTiles];
#pragma unroll
  for (int u = 0; u < Tile::kOutTiles; ++u) acc_dk[u] = acc_dv[u] = f32x16{};

  const int m_first = (queries.begin / Tile::kBlockQ) * Tile::kBlockQ;
  TileInFlight<Tile::kBlockQ, Tile::kHeadDim, Tile::kThreads> next_q, next_do;
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
      if (!Tile::kPrefetch) fetch(m0);
      next_q.deposit(sQ, nullptr);
      next_do.deposit(sdO, nullptr);
      if (threadIdx.x < Tile::kBlockQ) {
        const int row = m0 + threadIdx.x;
        sLse[threadIdx.x] = lse_log2_or_inf(p, seq, b, h, row);
        sRowdot[threadIdx.x] = row < seq.len_q ? rowdot[row] : 0.f;
      }
      __syncthreads();
      if (Tile::kPrefetch && m0 + Tile::kBlockQ < queries.end) fetch(m0 + Tile::kBlockQ);

      // Register r of tile t is query i = m0 + 4lh + c, c = 32t + 8(r/4) + r%4;
      // every test below is c against per-lane bounds (no per-element branches,
      // whose lane masks would cost two SGPRs each).
      const int lane_query0 = m0 + 4 * lh;
      const int rel_diag = lane_query0 + diag - j;  // i + diag - j at c = 0
      // The queries that see key j (rule.visible), as offsets c from lane_query0.
      const int c_lo = rule.window_right >= 0 ? j - diag - rule.window_right - lane_query0 : INT_MIN;
      const int c_hi = key_valid ? min(rule.window_left >= 0 ? j - diag + rule.window_left - lane_query0 : INT_MAX,
                                       seq.len_q - 1 - lane_query0)
                                 : -1;

      u16x4 rP[Tile::kQueryTiles * 4], rdS[Tile::kQueryTiles * 4];  // B operands, 4 queries per group
#pragma unroll
      for (int t = 0; t < Tile::kQueryTiles; ++t) {
        f32x16 acc_s, acc_dp;
        scores_and_grads<Tile::kIsBf16>(acc_s, acc_dp, sQ, sdO, Tile::kStride, t * kMfmaM + lk, lh, rK, rV);
        // Philox draws 4 keys of one query per call and this lane walks queries,
        // so one call per element: a rolled loop keeps its registers few.
        uint32_t kept = 0xFFFFu;  // bit r: element r survives dropout
        if (dropout.on) {
          kept = 0;
#pragma unroll 1
          for (int r = 0; r < 16; ++r) {
            const int i = lane_query0 + t * kMfmaM + 8 * (r / 4) + r % 4;
            kept |= dropout.keep1(i, j) << r;
          }
        }
#pragma unroll
        for (int g = 0; g < 4; ++g) {
          float pd[4], ds[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = 4 * g + e;
            const int c = t * kMfmaM + 8 * g + e;
            const int row = 4 * lh + c;  // query index inside the block
            float dtanh;
            const bool visible = (c >= c_lo) & (c <= c_hi);
            const float prob = probability(acc_s[r], opt, rel_diag + c, sLse[row], visible, dtanh);
            const float keep_scale = (kept >> r) & 1u ? dropout.scale : 0.f;
            pd[e] = prob * keep_scale;
            ds[e] = prob * (acc_dp[r] * keep_scale - sRowdot[row]) * dtanh;
          }
          rP[t * 4 + g] = pack4<Tile::kIsBf16>(pd[0], pd[1], pd[2], pd[3]);
          rdS[t * 4 + g] = pack4<Tile::kIsBf16>(ds[0], ds[1], ds[2], ds[3]);
        }
      }

#pragma unroll
      for (int u = 0; u < Tile::kOutTiles; ++u) {
#pragma unroll
        for (int s = 0; s < Tile::kQuerySteps; s += kStepsPerMfma) {
          const int q0 = s * kMfmaK + 4 * lh, col = d0 + u * kMfmaM + lk;
          acc_dv[u] = T::mfma(operand_down_column(sdO, Tile::kStride, q0, col), operand_at(rP, s), acc_dv[u]);
          acc_dk[u] = T::mfma(operand_down_column(sQ, Tile::kStride, q0, col), operand_at(rdS, s), acc_dk[u]);
        }
      }
    }
  }

  if (!key_valid) return;
  store_row<Tile::kIsBf16>(gdK, acc_dk, d0, lh, p.headdim, p.softmax_scale);
  store_row<Tile::kIsBf16>(gdV, acc_dv, d0, lh, p.headdim, 1.f);
}

template <class DqTile, class DkdvTile>
hipError_t launch_bwd(const PortattnBwdParams& p) {
  return launch_bwd_kernels<DqTile, DkdvTile>(p, bwd_dq_kernel<DqTile>, bwd_dkdv_kernel<DkdvTile>);
}

}  // namespace PORTATTN_ROCM_ARCH_NS
}  // namespace rocm
}  // namespace portattn
