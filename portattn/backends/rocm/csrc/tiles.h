// Data movement shared by the ROCm forward and backward kernels: sequence
// bounds, global -> LDS tile copies and MFMA operand reads from LDS.
//
// Tiles hold raw 16-bit patterns, rows padded by kLdsPad elements (8 bytes)
// so the 32 rows one MFMA operand reads fall on distinct bank pairs. Global
// reads are 16 bytes per lane, consecutive lanes on consecutive chunks of a
// row; rows past the sequence and columns past the head dim are stored as
// zeros, so padded products are exact zeros.
#pragma once
#include "../../common/params.h"
#include "cdna.h"

#ifndef PORTATTN_ROCM_ARCH_NS
#error "define PORTATTN_ROCM_ARCH_NS (the gfx target this translation unit is compiled for)"
#endif

namespace portattn {
namespace rocm {
namespace PORTATTN_ROCM_ARCH_NS {

constexpr int kLdsPad = 4;

struct SeqBounds {
  int q_start, k_start;  // first packed row of this sequence (0 unless varlen)
  int len_q, len_k;
};

__device__ __forceinline__ SeqBounds seq_bounds(const PortattnFwdParams& p, int b) {
  SeqBounds seq{0, 0, p.seqlen_q, p.seqlen_k};
  if (p.cu_seqlens_q != nullptr) {
    seq.q_start = p.cu_seqlens_q[b];
    seq.len_q = p.cu_seqlens_q[b + 1] - seq.q_start;
    seq.k_start = p.cu_seqlens_k[b];
    seq.len_k = p.cu_seqlens_k[b + 1] - seq.k_start;
  }
  if (p.seqused_k != nullptr) seq.len_k = p.seqused_k[b];
  return seq;
}

// Row-major stride of a kRows x kHeadDim tile, and of its transpose.
template <int kHeadDim>
constexpr int row_stride() {
  return kHeadDim + kLdsPad;
}
template <int kRows>
constexpr int transposed_stride() {
  return kRows + kLdsPad;
}

// Copies rows [row0, row0 + kRows) of one head (g points at row 0) into LDS:
// row-major into `lds_rows` and/or transposed (kHeadDim rows of kRows) into
// `lds_cols` (either may be null), reading global memory once.
template <int kRows, int kHeadDim, int kThreads>
__device__ __forceinline__ void load_tile_layouts(uint16_t* lds_rows, uint16_t* lds_cols, const uint16_t* g,
                                                  int64_t g_row_stride, int row0, int rows_valid, int headdim) {
  constexpr int kChunksPerRow = kHeadDim / 8;
  static_assert(kRows * kChunksPerRow % kThreads == 0, "every lane copies the same chunk count");
#pragma unroll
  for (int it = 0; it < kRows * kChunksPerRow / kThreads; ++it) {
    const int c = threadIdx.x + it * kThreads;
    const int n = c / kChunksPerRow;
    const int col = (c % kChunksPerRow) * 8;
    u32x4 chunk = {0u, 0u, 0u, 0u};
    if (row0 + n < rows_valid && col < headdim) chunk = load<u32x4>(g + (row0 + n) * g_row_stride + col);
    if (lds_cols != nullptr) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        lds_cols[(col + e) * transposed_stride<kRows>() + n] = static_cast<uint16_t>(chunk[e / 2] >> (16 * (e % 2)));
      }
    }
    if (lds_rows != nullptr) {
      uint16_t* row = lds_rows + n * row_stride<kHeadDim>() + col;
      store<u32x2>(row, u32x2{chunk.x, chunk.y});
      store<u32x2>(row + 4, u32x2{chunk.z, chunk.w});
    }
  }
}

template <int kRows, int kHeadDim, int kThreads, bool kTranspose>
__device__ __forceinline__ void load_tile(uint16_t* lds, const uint16_t* g, int64_t g_row_stride, int row0,
                                          int rows_valid, int headdim) {
  load_tile_layouts<kRows, kHeadDim, kThreads>(kTranspose ? nullptr : lds, kTranspose ? lds : nullptr, g,
                                               g_row_stride, row0, rows_valid, headdim);
}

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

template <bool kIsBf16>
__device__ __forceinline__ u16x4 pack4(float a, float b, float c, float d) {
  using T = Dtype<kIsBf16>;
  return u16x4{T::from_float(a), T::from_float(b), T::from_float(c), T::from_float(d)};
}

}  // namespace PORTATTN_ROCM_ARCH_NS
}  // namespace rocm
}  // namespace portattn
