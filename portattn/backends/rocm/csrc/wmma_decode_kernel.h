// Split-KV decode on RDNA matrix cores (wave32 WMMA: gfx1100 RDNA3, gfx1201
// RDNA4): few query rows against many keys, read in place from a contiguous
// cache, a paged cache or packed (varlen) sequences. The CDNA decode's design
// (decode_kernel.h, Note [portattn decode] in common/params.h) with its shared
// pieces: common/decode_sequence.h's sequence, page and key-range rules,
// decode_common.h's key addressing, block-table containment scan, split combine
// and cache append, common/online_softmax.h; only the matrix instruction, its
// lane layout (Note [portattn WMMA layout] in rdna.h) and the data path differ.
//
// Tile configuration (WmmaDecodeTile): a workgroup owns 16 packed query rows
// (row = query * group + head-in-group) of one (sequence, KV head), one key
// split and, at D = 256, one half of the head dim (kDimSplit); 4 waves take
// 16 different keys each of every 64-key stage, so a wave's score tile is one
// WMMA tile, computed transposed as in the RDNA forward:
//   S^T (16 keys x 16 rows)  = K (16 x D) . Q^T (D x 16)       D/16 WMMAs
//   O^T (D' x 16 rows)      += V^T (D' x 16) . P^T (16 x 16)    D'/16 WMMAs
// (D' = D / kDimSplit), P^T built from the score registers by rows_as_b.
//
// Why K and V go through LDS here (the CDNA decode reads them straight into
// MFMA operand order): a gfx11 WMMA operand holds the whole 16-deep step in
// both half-waves, so one wave's 16 keys of K, of V and the Q operands would
// take D/2 VGPRs each, beside D'/2 of O^T (fp32, wave32) -- 512 at D = 256 of
// the 256 a wave can address. Staged in LDS, only the operands of one product
// step are live. The workgroup copies a stage with 16-byte reads (one
// block-table lookup per row, so any page size works) into K row-major and
// V^T (its D' columns) transposed, rows padded by 8 elements so every operand
// read is one 16-byte aligned read; Q is staged once. With kPrefetch the next
// stage's reads are in flight in registers while this one computes. After the
// key loop the same LDS holds the waves' merge: waves 1-3 leave LSE-weighted
// O there (fp32, rows padded by 4 floats), wave 0 adds its own and writes out
// (one split) or the fp32 partials. At D = 256 the two workgroups of a
// (rows, split) each read all of K (S is recomputed) and their half of V.
//
// Budget per variant (VGPRs per lane, of 1536 per SIMD lane and 256
// addressable per wave32; LDS <= 64 KiB per workgroup, 128 KiB per WGP, whose
// 4 SIMDs each run one wave of a workgroup). Numbers are data in variants.py
// (RDNA_CONFIGS), checked on the compiled code by tests/test_rocm_isa.py:
//   D    split  LDS bytes (stage / merge)  WMMA/stage  waves/SIMD (LDS allows)  VGPR budget  prefetch
//   64   1      20736 (20736 / 13312)      8           6 (6)                    <= 240       yes
//   128  1      40192 (40192 / 25600)      16          3 (3)                    <= 256       yes
//   256  2      60672 (60672 / 25600)      24          2 (2)                    <= 256       no (23-41 spills)
// Measured with clang-19 (VGPRs fp16 / bf16; SGPRs 94-96; no spills, no
// scratch): gfx1100 179 / 178, 241 / 241, 248 / 244; gfx1201 153 / 156,
// 244 / 247, 228 / 228 at D = 64, 128, 256. The combine: 33 VGPRs, the
// append: 16, no LDS.
//
// e4m3 caches (kFp8, Note [portattn fp8 kv cache] in common/params.h): each
// 16-byte piece of a stage is read as its 8 raw bytes (half the bytes and, with
// kPrefetch, half the in-flight registers) and widened to the 16-bit stage in LDS
// as it is deposited (fp8.h: exact), so the WMMA loop and the LDS budget are the
// 16-bit kernel's; k_descale[b, hk] is folded into the score scale and
// v_descale[b, hk] multiplies the output (or the split's partial output).
#pragma once
#include <limits.h>
#include <math.h>

#include <type_traits>

#include "rdna.h"  // first: hip_runtime.h defines __forceinline__ for the common headers

#include "../../common/decode_sequence.h"
#include "../../common/online_softmax.h"
#include "../../common/params.h"
#include "decode_common.h"  // KeySource, contained_sequence, the split combine, the cache append
#include "fp8.h"
#include "tiles.h"

namespace portattn {
namespace rocm {
namespace PORTATTN_ROCM_ARCH_NS {

template <int kHeadDim_, int kStageKeys_, bool kIsBf16_, int kWavesPerSimd_, bool kPrefetch_>
struct WmmaDecodeTile {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kStageKeys = kStageKeys_;  // keys per workgroup per step
  static constexpr bool kIsBf16 = kIsBf16_;
  static constexpr int kWavesPerSimd = kWavesPerSimd_;
  static constexpr bool kPrefetch = kPrefetch_;  // next stage's reads in flight while computing

  static constexpr int kWaves = 4;
  static constexpr int kWaveLanes = kWave32;
  static constexpr int kThreads = kWaves * kWave32;
  static constexpr int kBlockM = kWmma;                  // packed query rows per workgroup
  static constexpr int kWaveKeys = kStageKeys / kWaves;  // one WMMA tile of keys per wave
  // O^T at D = 256 would be 128 VGPRs per lane (fp32, wave32): two workgroups
  // take half of its columns each, as in the RDNA forward.
  static constexpr int kDimSplit = kHeadDim > 128 ? 2 : 1;
  static constexpr int kOutDim = kHeadDim / kDimSplit;
  static constexpr int kDimSteps = kHeadDim / kWmma;  // WMMA steps of S^T = K Q^T
  static constexpr int kOutTiles = kOutDim / kWmma;   // O^T accumulators per wave
  static constexpr int kRowStride = row_stride<kHeadDim, kWmmaLdsPad>();          // sQ, sK
  static constexpr int kVtStride = transposed_stride<kStageKeys, kWmmaLdsPad>();  // sVt
  static constexpr int kQElems = kBlockM * kRowStride;
  static constexpr int kKElems = kStageKeys * kRowStride;
  static constexpr int kVtElems = kOutDim * kVtStride;
  static constexpr int kStageBytes = 2 * (kQElems + kKElems + kVtElems);
  static constexpr int kMergePitch = kOutDim + kLdsPad;  // fp32 per merge row
  static constexpr int kMergeFloats = (kWaves - 1) * kBlockM * kMergePitch;
  static constexpr int kMergeBytes = 4 * (kMergeFloats + kWaves * kBlockM);
  static constexpr int kLdsBytes = kStageBytes > kMergeBytes ? kStageBytes : kMergeBytes;
  static constexpr int kMfmaPerIter = kDimSteps + kOutTiles;

  static_assert(kWaveKeys == kWmma, "a wave takes one 16-key WMMA tile per stage");
  static_assert(kHeadDim % 64 == 0 && kHeadDim <= 256, "every lane copies whole 16-byte pieces of a stage");
  static_assert(kLdsBytes <= 65536, "one workgroup must fit 64 KiB of LDS");
  static_assert(kMergeFloats * 4 >= kQElems * 2, "sLse (the containment vote's word) lies past sQ");
};

// One stage's K rows (all D columns) and V rows (this workgroup's D' columns)
// in flight from global memory: `fetch` issues this lane's 16-byte reads,
// `deposit` writes K row-major and V transposed into LDS. Keys past the
// sequence and columns past the head dim are zeros (P is 0 there, but
// 0 * (stale NaN) is not). kFp8: a piece is 8 e4m3 bytes, widened in `deposit`.
template <class Tile, bool kFp8>
struct DecodeStageInFlight {
  using Elem = std::conditional_t<kFp8, uint8_t, uint16_t>;
  using Piece = std::conditional_t<kFp8, u32x2, u32x4>;
  static constexpr int kKPieces = Tile::kHeadDim / 8;  // 16-byte pieces per K row
  static constexpr int kVPieces = Tile::kOutDim / 8;
  static constexpr int kK = Tile::kStageKeys * kKPieces / Tile::kThreads;  // per lane
  static constexpr int kV = Tile::kStageKeys * kVPieces / Tile::kThreads;
  static_assert(Tile::kStageKeys * kVPieces % Tile::kThreads == 0, "every lane copies the same piece count");
  Piece k[kK], v[kV];

  static __device__ __forceinline__ Piece piece(const Elem* g, const PortattnTensor4& strides,
                                                const KeySource<Elem>& src, int key, int col) {
    if (key >= src.seqlen_k || col >= src.headdim) return Piece{};
    return load<Piece>(g + src.at.offset(strides, src.cache_row, src.key_base + key) + col);
  }

  // A piece's 8 values as 16-bit patterns (two per word).
  static __device__ __forceinline__ u32x4 widened(const Piece& x) {
    if constexpr (kFp8) {
      return fp8::e4m3x8_to<Tile::kIsBf16>(x);
    } else {
      return x;
    }
  }

  __device__ __forceinline__ void fetch_k(const KeySource<Elem>& src, int key0) {
#pragma unroll
    for (int it = 0; it < kK; ++it) {
      const int c = threadIdx.x + it * Tile::kThreads;
      k[it] = piece(src.gK, src.k_strides, src, key0 + c / kKPieces, 8 * (c % kKPieces));
    }
  }

  __device__ __forceinline__ void fetch_v(const KeySource<Elem>& src, int key0, int d0) {
#pragma unroll
    for (int it = 0; it < kV; ++it) {
      const int c = threadIdx.x + it * Tile::kThreads;
      v[it] = piece(src.gV, src.v_strides, src, key0 + c / kVPieces, d0 + 8 * (c % kVPieces));
    }
  }

  __device__ __forceinline__ void deposit_k(uint16_t* sK) const {
#pragma unroll
    for (int it = 0; it < kK; ++it) {
      const int c = threadIdx.x + it * Tile::kThreads;
      store<u32x4>(sK + (c / kKPieces) * Tile::kRowStride + 8 * (c % kKPieces), widened(k[it]));
    }
  }

  __device__ __forceinline__ void deposit_v(uint16_t* sVt) const {
#pragma unroll
    for (int it = 0; it < kV; ++it) {
      const int c = threadIdx.x + it * Tile::kThreads;
      const int key = c / kVPieces, col = 8 * (c % kVPieces);
      const u32x4 words = widened(v[it]);
#pragma unroll
      for (int e = 0; e < 8; ++e)
        sVt[(col + e) * Tile::kVtStride + key] = static_cast<uint16_t>(words[e / 2] >> (16 * (e % 2)));
    }
  }

  __device__ __forceinline__ void fetch(const KeySource<Elem>& src, int key0, int d0) {
    fetch_k(src, key0);
    fetch_v(src, key0, d0);
  }

  // Into LDS: what fetch read (kPrefetch), or K then V read now, so only one of
  // them is in registers at a time (at D = 256 both would be 96 VGPRs a lane).
  __device__ __forceinline__ void deposit(const KeySource<Elem>& src, int key0, int d0, uint16_t* sK,
                                          uint16_t* sVt) {
    if (!Tile::kPrefetch) fetch_k(src, key0);
    deposit_k(sK);
    if (!Tile::kPrefetch) fetch_v(src, key0, d0);
    deposit_v(sVt);
  }
};

// kFp8: k and v hold e4m3 bytes (the docblock's last paragraph).
template <class Tile, bool kFp8>
__global__ void PORTATTN_LAUNCH_BOUNDS(Tile::kThreads, Tile::kWavesPerSimd)
    decode_kernel(const PortattnDecodeParams p) {
  using Elem = std::conditional_t<kFp8, uint8_t, uint16_t>;
  using W = Wmma<PORTATTN_ROCM_WMMA_GEN, Tile::kIsBf16>;
  using Operand = typename W::Operand;
  using T = Dtype<Tile::kIsBf16>;
  constexpr int kOutCols = Tile::kOutTiles * 8;  // O^T registers per lane
  // Q, K and V^T during the key loop; then the waves' merge (weighted O of waves 1.., LSE of all).
  __shared__ __attribute__((aligned(16))) uint16_t sLds[Tile::kLdsBytes / 2];
  uint16_t* const sQ = sLds;
  uint16_t* const sK = sQ + Tile::kQElems;
  uint16_t* const sVt = sK + Tile::kKElems;
  float* const sMerge = reinterpret_cast<float*>(sLds);
  float* const sLse = sMerge + Tile::kMergeFloats;

  const int split = blockIdx.x / Tile::kDimSplit;
  const int d0 = (blockIdx.x % Tile::kDimSplit) * Tile::kOutDim;  // this workgroup's O columns
  const int b = blockIdx.z;
  const int group = p.nheads / p.nheads_k;
  const int m_tiles = (p.seqlen_q * group + Tile::kBlockM - 1) / Tile::kBlockM;
  const int hk = blockIdx.y / m_tiles;
  const int row0 = (blockIdx.y % m_tiles) * Tile::kBlockM;

  // Out-of-range cache_seqlens / leftpad / batch_idx / page numbers: an empty sequence,
  // reported once (Note [portattn decode errors]).
  // The vote's word is sLse's first, which nothing touches before the key loop's first barrier.
  const decode::Sequence seq =
      contained_sequence<Tile::kThreads>(p, b, blockIdx.x == 0 && blockIdx.y == 0, reinterpret_cast<int*>(sLse));
  const int rows = seq.seqlen_q * group;
  if (row0 >= rows) return;  // a shorter varlen sequence: nothing of it here (the combine skips it too)
  const decode::KeyRange range = decode::KeyRange::of(p, seq, row0, Tile::kBlockM, group, Tile::kStageKeys, split);

  const int wave = threadIdx.x / kWave32;
  const int lane = threadIdx.x % kWave32;
  const int lq = lane % kWmma;      // this lane's packed row: the S^T / O^T column it owns
  const int k0 = W::k_first(lane);  // first depth index of this lane's operand slots
  const int packed = row0 + lq;
  const bool row_valid = packed < rows;
  const int packed_safe = row_valid ? packed : rows - 1;  // padding rows compute a copy, never stored
  const int i = packed_safe / group;                       // query within the sequence
  const int h = hk * group + packed_safe % group;

  // Q's 16 packed rows, once (zeros past the rows and the head dim); the first
  // stage's barrier publishes them.
  const int64_t q_batch = p.cu_seqlens_q != nullptr ? 0 : b * p.q_strides.batch_stride;
#pragma unroll
  for (int it = 0; it < Tile::kBlockM * Tile::kHeadDim / 8 / Tile::kThreads; ++it) {
    const int c = threadIdx.x + it * Tile::kThreads;
    const int r = c / (Tile::kHeadDim / 8), col = 8 * (c % (Tile::kHeadDim / 8));
    u32x4 chunk{0u, 0u, 0u, 0u};
    if (row0 + r < rows && col < p.headdim) {
      const int qi = (row0 + r) / group, qh = hk * group + (row0 + r) % group;
      chunk = load<u32x4>(static_cast<const uint16_t*>(p.q) + q_batch +
                          static_cast<int64_t>(seq.q_start + qi) * p.q_strides.row_stride +
                          qh * p.q_strides.head_stride + col);
    }
    store<u32x4>(sQ + r * Tile::kRowStride + col, chunk);
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

  f32x8 acc_o[Tile::kOutTiles];
#pragma unroll
  for (int u = 0; u < Tile::kOutTiles; ++u) acc_o[u] = f32x8{};
  softmax::RowState<1> state;
  state.init();

  const int wave_key0 = wave * Tile::kWaveKeys;  // this wave's keys within a stage
  const uint16_t* sQ_row = sQ + lq * Tile::kRowStride + k0;
  const uint16_t* sK_row = sK + (wave_key0 + lq) * Tile::kRowStride + k0;
  DecodeStageInFlight<Tile, kFp8> kv;
  if (Tile::kPrefetch && range.begin < range.end) kv.fetch(src, range.begin * Tile::kStageKeys, d0);

  for (int stage = range.begin; stage < range.end; ++stage) {
    const int stage_key0 = stage * Tile::kStageKeys;
    __syncthreads();  // the previous stage's LDS reads are done
    kv.deposit(src, stage_key0, d0, sK, sVt);
    __syncthreads();
    if (Tile::kPrefetch && stage + 1 < range.end) kv.fetch(src, stage_key0 + Tile::kStageKeys, d0);

    // Both operands from LDS: a loop unrolled by 2, so the compiler does not issue every
    // step's reads at once (2 x 8 VGPRs a step on gfx11), as in the RDNA forward.
    f32x8 acc_s = f32x8{};
#pragma unroll 2
    for (int s = 0; s < Tile::kDimSteps; ++s)
      acc_s = W::mma(W::read(sK_row + s * kWmma), W::read(sQ_row + s * kWmma), acc_s);

    // Register r is key j = stage_key0 + wave_key0 + row(lane, r) of row i (log2 units after this).
    const bool all_visible = range.all_visible(p, seq, stage_key0, Tile::kStageKeys);
    const int lane_key0 = stage_key0 + wave_key0 + W::row(lane, 0);
    float rS[1][8];
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      const int j = lane_key0 + W::row_step(r);
      float x = acc_s[r] * score_scale;
      if (use_softcap) x = p.softcap * tanhf(x / p.softcap);
      if (use_alibi) x -= slope * fabsf(static_cast<float>(aligned_key - j));
      x *= softmax::kLog2e;
      if (!all_visible && (j < keys.lo || j > keys.hi)) x = softmax::neg_inf();
      rS[0][r] = x;
    }

    float rO[1][kOutCols];
#pragma unroll
    for (int u = 0; u < Tile::kOutTiles; ++u)
#pragma unroll
      for (int r = 0; r < 8; ++r) rO[0][u * 8 + r] = acc_o[u][r];
    softmax::online_softmax_step<false, 1, 8, kOutCols, PairReduce>(rS, rO, state, 1.f);
#pragma unroll
    for (int u = 0; u < Tile::kOutTiles; ++u)
#pragma unroll
      for (int r = 0; r < 8; ++r) acc_o[u][r] = rO[0][u * 8 + r];

    const Operand rP = W::rows_as_b(rS[0]);
#pragma unroll
    for (int u = 0; u < Tile::kOutTiles; ++u)
      acc_o[u] = W::mma(W::read(sVt + (u * kWmma + lq) * Tile::kVtStride + wave_key0 + k0), rP, acc_o[u]);
  }

  // Register r of O^T tile u is column d0 + 16 u + row(lane, r) of row i.
  float rO[1][kOutCols];
#pragma unroll
  for (int u = 0; u < Tile::kOutTiles; ++u)
#pragma unroll
    for (int r = 0; r < 8; ++r) rO[0][u * 8 + r] = acc_o[u][r];
  float lse[1];
  softmax::online_softmax_finalize<1, kOutCols, PairReduce>(rO, state, 1.f, 1.f, lse);

  // ---- merge the waves' (O, LSE): the same LSE-weighted sum the split combine does ----
  __syncthreads();  // every wave's last operand read is done: the merge reuses the stage buffers
  if (lane < kWmma) sLse[wave * Tile::kBlockM + lq] = lse[0];
  __syncthreads();
  float m = softmax::neg_inf();
#pragma unroll
  for (int w = 0; w < Tile::kWaves; ++w) m = fmaxf(m, sLse[w * Tile::kBlockM + lq]);
  float total_lse = softmax::neg_inf();
  if (m != softmax::neg_inf()) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < Tile::kWaves; ++w) sum += expf(sLse[w * Tile::kBlockM + lq] - m);
    total_lse = m + logf(sum);
  }
  // exp(-inf - finite) = 0 for a wave that saw no visible key.
  const float weight = total_lse == softmax::neg_inf() ? 0.f : expf(lse[0] - total_lse);
  if (wave > 0) {
    float* dst = sMerge + ((wave - 1) * Tile::kBlockM + lq) * Tile::kMergePitch;
#pragma unroll
    for (int u = 0; u < Tile::kOutTiles; ++u)
#pragma unroll
      for (int r = 0; r < 8; ++r) dst[u * kWmma + W::row(lane, r)] = weight * rO[0][u * 8 + r];
  }
  __syncthreads();
  if (wave != 0 || !row_valid) return;

  float out[kOutCols];
#pragma unroll
  for (int u = 0; u < Tile::kOutTiles; ++u) {
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      float x = weight * rO[0][u * 8 + r];
#pragma unroll
      for (int w = 1; w < Tile::kWaves; ++w)
        x += sMerge[((w - 1) * Tile::kBlockM + lq) * Tile::kMergePitch + u * kWmma + W::row(lane, r)];
      out[u * 8 + r] = kFp8 ? x * v_descale : x;
    }
  }

  const decode::OutputRow at{b, h, seq.q_start, i};
  const bool writes_lse = lane < kWmma && d0 == 0;  // one lane per row, one workgroup per head-dim split
  if (p.num_splits == 1) {
    uint16_t* gO = static_cast<uint16_t*>(p.out) + at.out_offset(p);
#pragma unroll
    for (int u = 0; u < Tile::kOutTiles; ++u) {
      if constexpr (W::kRowsContiguous) {
        // Columns d .. d + 7: one 16-byte store (headdim is a multiple of 8).
        const int d = d0 + u * kWmma + W::row(lane, 0);
        if (d < p.headdim) {
          u16x8 packed8;
#pragma unroll
          for (int r = 0; r < 8; ++r) packed8[r] = T::from_float(out[u * 8 + r]);
          store<u16x8>(gO + d, packed8);
        }
      } else {
#pragma unroll
        for (int r = 0; r < 8; ++r) {
          const int d = d0 + u * kWmma + W::row(lane, r);
          if (d < p.headdim) gO[d] = T::from_float(out[u * 8 + r]);
        }
      }
    }
    if (writes_lse && p.lse != nullptr) p.lse[at.lse_offset(p)] = total_lse;
  } else {
    const int64_t row_index = at.partial_row(p, split);
    float* gOp = p.o_partial + row_index * p.headdim;
#pragma unroll
    for (int u = 0; u < Tile::kOutTiles; ++u) {
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        const int d = d0 + u * kWmma + W::row(lane, r);
        if (d < p.headdim) gOp[d] = out[u * 8 + r];
      }
    }
    if (writes_lse) p.lse_partial[row_index] = total_lse;
  }
}

template <class Tile>
hipError_t launch_decode(const PortattnDecodeParams& p) {
  if (p.seqlen_q == 0 || p.batch == 0 || p.nheads == 0) return hipSuccess;
  const int group = p.nheads / p.nheads_k;
  const int m_tiles = (p.seqlen_q * group + Tile::kBlockM - 1) / Tile::kBlockM;
  const dim3 grid(p.num_splits * Tile::kDimSplit, p.nheads_k * m_tiles, p.batch);
  const hipStream_t stream = static_cast<hipStream_t>(p.stream);
  if (p.kv.cache_dtype == PORTATTN_CACHE_FP8_E4M3) {
    hipLaunchKernelGGL((decode_kernel<Tile, true>), grid, dim3(Tile::kThreads), 0, stream, p);
  } else {
    hipLaunchKernelGGL((decode_kernel<Tile, false>), grid, dim3(Tile::kThreads), 0, stream, p);
  }
  const hipError_t err = hipGetLastError();
  if (err != hipSuccess || p.num_splits == 1) return err;
  return launch_decode_combine<Tile>(p);
}

}  // namespace PORTATTN_ROCM_ARCH_NS
}  // namespace rocm
}  // namespace portattn
