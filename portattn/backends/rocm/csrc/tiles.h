// Data movement shared by the ROCm forward and backward kernels: global -> LDS
// tile copies and MFMA operand reads from LDS (sequence bounds: common/seq_bounds.h).
//
// Tiles hold raw 16-bit patterns, rows padded by kLdsPad elements (8 bytes)
// so the 32 rows one MFMA operand reads fall on distinct bank pairs. Global
// reads are 16 bytes per lane, consecutive lanes on consecutive chunks of a
// row; rows past the sequence and columns past the head dim are stored as
// zeros, so padded products are exact zeros.
#pragma once
#include "cdna.h"  // first: hip_runtime.h defines __forceinline__ for the common headers

#include "../../common/params.h"
#include "../../common/philox.h"
#include "../../common/block_range.h"  // MaskRule: which keys each query sees, block ranges, tile tests
#include "../../common/seq_bounds.h"  // SeqBounds / seq_bounds: every kernel's clamped sequence bounds

#ifndef PORTATTN_ROCM_ARCH_NS
#error "define PORTATTN_ROCM_ARCH_NS (the gfx target this translation unit is compiled for)"
#endif

namespace portattn {
namespace rocm {
namespace PORTATTN_ROCM_ARCH_NS {

constexpr int kLdsPad = 4;

// Row `row` of head `h` of sequence `b` in a (batch, seqlen, heads, headdim)
// tensor (varlen: row counts from the packed start, batch stride 0).
template <class T>
__device__ __forceinline__ T* head_row(T* base, const PortattnTensor4& strides, int b, int64_t row, int h) {
  return static_cast<T*>(base) + b * strides.batch_stride + row * strides.row_stride + h * strides.head_stride;
}

__device__ __forceinline__ const uint16_t* head_row(const void* base, const PortattnTensor4& strides, int b,
                                                    int64_t row, int h) {
  return head_row(static_cast<const uint16_t*>(base), strides, b, row, h);
}

__device__ __forceinline__ uint16_t* head_row(void* base, const PortattnTensor4& strides, int b, int64_t row,
                                              int h) {
  return head_row(static_cast<uint16_t*>(base), strides, b, row, h);
}

// Dropout of one (sequence, head) as a lane sees it (Note [portattn dropout
// mask]); the Philox key material is moved to VGPRs (in_vgpr) so its ten
// round keys, hoisted out of the key loop, do not exhaust the SGPRs.
struct DropoutLane {
  bool on;
  uint32_t threshold;
  float scale;  // 1 / (1 - p): applied to kept entries
  uint64_t seed, offset;
  int bh;  // b * nheads + h, Philox's third counter word

  __device__ __forceinline__ DropoutLane(const PortattnFwdParams& p, int b, int h)
      : on(p.dropout_p > 0.f),
        threshold(dropout_threshold(p.dropout_p)),
        scale(p.dropout_p > 0.f ? 1.f / (1.f - p.dropout_p) : 1.f),
        seed(p.dropout_p > 0.f ? in_vgpr(p.philox_seed) : 0),
        offset(p.dropout_p > 0.f ? in_vgpr(p.philox_offset) : 0),
        bh(b * p.nheads + h) {}

  // Keep bits (bit e = key j0 + e) of keys j0..j0+3 of query i, j0 % 4 == 0.
  __device__ __forceinline__ uint32_t keep4(int i, int j0) const {
    const Philox4 r = dropout_random4(seed, offset, bh, i, j0);
    return static_cast<uint32_t>(r.x >= threshold) | static_cast<uint32_t>(r.y >= threshold) << 1 |
           static_cast<uint32_t>(r.z >= threshold) << 2 | static_cast<uint32_t>(r.w >= threshold) << 3;
  }

  // Keep bit of the single entry (i, j), for lanes that walk queries.
  __device__ __forceinline__ uint32_t keep1(int i, int j) const {
    const Philox4 r = dropout_random4(seed, offset, bh, i, j & ~3);
    const uint32_t word = (j & 3) == 0 ? r.x : (j & 3) == 1 ? r.y : (j & 3) == 2 ? r.z : r.w;
    return word >= threshold ? 1u : 0u;
  }
};

// Row-major stride of a kRows x kHeadDim tile, and of its transpose. The RDNA
// kernels pad by 8 (kPad) so every row starts 16-byte aligned for their
// 16-byte operand reads.
template <int kHeadDim, int kPad = kLdsPad>
constexpr int row_stride() {
  return kHeadDim + kPad;
}
template <int kRows, int kPad = kLdsPad>
constexpr int transposed_stride() {
  return kRows + kPad;
}

// Rows [row0, row0 + kRows) of one head (g points at row 0), in flight from
// global memory to LDS: `fetch` issues this lane's 16-byte reads into
// registers, `deposit` writes them row-major into `lds_rows` and/or
// transposed into `lds_cols` (either may be null): the head-dim columns
// [cols_begin, cols_end) as rows of kRows, for a kernel that needs only its
// slice of the head dim transposed (multiples of 8, so a 16-byte chunk is
// wholly in or out).
// Between the two a kernel can compute on the previous tile, which hides the
// global-memory latency (software pipelining through registers).
template <int kRows, int kHeadDim, int kThreads, int kPad = kLdsPad>
struct TileInFlight {
  static constexpr int kChunksPerRow = kHeadDim / 8;
  static constexpr int kChunks = kRows * kChunksPerRow / kThreads;  // per lane
  static_assert(kRows * kChunksPerRow % kThreads == 0, "every lane copies the same chunk count");
  u32x4 chunk[kChunks];

  __device__ __forceinline__ void fetch(const uint16_t* g, int64_t g_row_stride, int row0, int rows_valid,
                                        int headdim) {
#pragma unroll
    for (int it = 0; it < kChunks; ++it) {
      const int c = threadIdx.x + it * kThreads;
      const int n = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
      chunk[it] = u32x4{0u, 0u, 0u, 0u};
      if (row0 + n < rows_valid && col < headdim) chunk[it] = load<u32x4>(g + (row0 + n) * g_row_stride + col);
    }
  }

  __device__ __forceinline__ void deposit(uint16_t* lds_rows, uint16_t* lds_cols, int cols_begin = 0,
                                          int cols_end = kHeadDim) const {
#pragma unroll
    for (int it = 0; it < kChunks; ++it) {
      const int c = threadIdx.x + it * kThreads;
      const int n = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
      if (lds_cols != nullptr && col >= cols_begin && col < cols_end) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          lds_cols[(col - cols_begin + e) * transposed_stride<kRows, kPad>() + n] =
              static_cast<uint16_t>(chunk[it][e / 2] >> (16 * (e % 2)));
        }
      }
      if (lds_rows != nullptr) {
        uint16_t* row = lds_rows + n * row_stride<kHeadDim, kPad>() + col;
        store<u32x2>(row, u32x2{chunk[it].x, chunk[it].y});
        store<u32x2>(row + 4, u32x2{chunk[it].z, chunk[it].w});
      }
    }
  }
};

// The K and V rows of a kernel's key blocks, streamed into LDS: `stage`
// brackets the block's deposit with the two barriers of single-buffered LDS
// and, with kPrefetch, issues the next block's reads right after, so they are
// in flight while the caller computes on this block.
template <int kBlockN, int kHeadDim, int kThreads, bool kPrefetch, int kPad = kLdsPad>
struct KeyBlockStream {
  const uint16_t* g_k;
  const uint16_t* g_v;
  const PortattnFwdParams& p;
  int len_k, j_end;
  TileInFlight<kBlockN, kHeadDim, kThreads, kPad> k, v;

  __device__ __forceinline__ void fetch(int n0) {
    k.fetch(g_k, p.k_strides.row_stride, n0, len_k, p.headdim);
    v.fetch(g_v, p.v_strides.row_stride, n0, len_k, p.headdim);
  }

  __device__ __forceinline__ void start(int n_first) {
    if (kPrefetch && n_first < j_end) fetch(n_first);
  }

  // k_cols / v_cols take the head-dim columns [cols_begin, cols_end) (TileInFlight::deposit).
  __device__ __forceinline__ void stage(int n0, uint16_t* k_rows, uint16_t* k_cols, uint16_t* v_rows,
                                        uint16_t* v_cols, int cols_begin = 0, int cols_end = kHeadDim) {
    __syncthreads();  // the previous block's LDS reads are done
    if (!kPrefetch) fetch(n0);
    k.deposit(k_rows, k_cols, cols_begin, cols_end);
    v.deposit(v_rows, v_cols, cols_begin, cols_end);
    __syncthreads();
    if (kPrefetch && n0 + kBlockN < j_end) fetch(n0 + kBlockN);
  }
};

// MFMA operand fragments from a row-major LDS tile (Note [portattn MFMA layout]):
// 4 consecutive elements along a row (one 8-byte read) ...
__device__ __forceinline__ u16x4 frag_along_row(const uint16_t* lds, int stride, int row, int col0) {
  return load<u16x4>(lds + row * stride + col0);
}

// ... or down a column, for the transposed operand without a transposed copy.
__device__ __forceinline__ u16x4 frag_down_column(const uint16_t* lds, int stride, int row0, int col) {
  return u16x4{lds[row0 * stride + col], lds[(row0 + 1) * stride + col], lds[(row0 + 2) * stride + col],
               lds[(row0 + 3) * stride + col]};
}

// One MFMA instruction's operand (kStepsPerMfma steps; Note [portattn MFMA
// double depth] in cdna.h): the step at col0 / row0 and, on CDNA4, the next
// 8-deep step 8 elements on.
__device__ __forceinline__ MfmaOperand operand_along_row(const uint16_t* lds, int stride, int row, int col0) {
#if defined(PORTATTN_ROCM_CDNA4)
  return operand_of(frag_along_row(lds, stride, row, col0), frag_along_row(lds, stride, row, col0 + kMfmaK));
#else
  return frag_along_row(lds, stride, row, col0);
#endif
}

__device__ __forceinline__ MfmaOperand operand_down_column(const uint16_t* lds, int stride, int row0, int col) {
#if defined(PORTATTN_ROCM_CDNA4)
  return operand_of(frag_down_column(lds, stride, row0, col), frag_down_column(lds, stride, row0 + kMfmaK, col));
#else
  return frag_down_column(lds, stride, row0, col);
#endif
}

template <bool kIsBf16>
__device__ __forceinline__ u16x4 pack4(float a, float b, float c, float d) {
  using T = Dtype<kIsBf16>;
  return u16x4{T::from_float(a), T::from_float(b), T::from_float(c), T::from_float(d)};
}

}  // namespace PORTATTN_ROCM_ARCH_NS
}  // namespace rocm
}  // namespace portattn
