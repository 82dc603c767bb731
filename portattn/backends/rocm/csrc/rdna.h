// RDNA matrix-core primitives (wave32 WMMA) for the ROCm kernels on RDNA3
// (gfx11) and RDNA4 (gfx12). The dtype conversions, vector types, load/store
// and in_vgpr are cdna.h's; PORTATTN_ROCM_WMMA_GEN (11 or 12, set by the
// generated instantiation source) selects the instruction forms and hides
// cdna.h's MFMA builtins, which RDNA lacks.
//
// Note [portattn WMMA layout]
// v_wmma_f32_16x16x16_{f16,bf16} computes D(16x16) += A(16x16) * B(16x16) per
// wave32. Lane l supplies A[l % 16][k(l, e)] and B[k(l, e)][l % 16] for its
// operand slots e and owns D[row(l, r)][l % 16] for r = 0..7:
//   gfx11: 16 slots, k(l, e) = e (the whole depth; lanes 16-31 repeat lanes
//          0-15), row(l, r) = 2r + l / 16;
//   gfx12: 8 slots, k(l, e) = 8 (l / 16) + e, row(l, r) = 8 (l / 16) + r.
// A product computed transposed (S^T = K Q^T) therefore leaves each lane one
// query (column l % 16) and 8 of a 16-key tile's keys, and a row's softmax
// statistics live in lanes l and l ^ 16. On gfx12 those 8 keys are exactly the
// lane's B slots of the next product (O^T += V^T P^T), as on CDNA; on gfx11 the
// lane needs all 16 and swaps its 8 with lane l ^ 16 (four 32-bit shuffles of
// packed pairs). The slots of a lane are consecutive in k, so every operand is
// one contiguous read (32 bytes on gfx11, 16 on gfx12).
#pragma once
#include "cdna.h"

#ifndef PORTATTN_ROCM_WMMA_GEN
#error "define PORTATTN_ROCM_WMMA_GEN (11 or 12) before including rdna.h"
#endif

namespace portattn {
namespace rocm {

typedef float f32x8 __attribute__((ext_vector_type(8)));
typedef _Float16 f16x8 __attribute__((ext_vector_type(8)));
typedef _Float16 f16x16 __attribute__((ext_vector_type(16)));
typedef short i16x8 __attribute__((ext_vector_type(8)));
typedef short i16x16 __attribute__((ext_vector_type(16)));
typedef uint16_t u16x8 __attribute__((ext_vector_type(8)));
typedef uint16_t u16x16 __attribute__((ext_vector_type(16)));

constexpr int kWave32 = 32;
constexpr int kWmma = 16;  // rows, columns and depth of one WMMA
constexpr int kWmmaLdsPad = 8;  // elements: 16-byte aligned LDS rows for 16-byte operand reads

template <int kGen>
struct WmmaLayout;

template <>
struct WmmaLayout<11> {
  static constexpr int kSlots = 16;
  static constexpr bool kRowsContiguous = false;  // a lane's D rows are 2r + l / 16
  using Operand = u16x16;
  static __device__ __forceinline__ int k_first(int lane) { return 0; }
  static __device__ __forceinline__ int row(int lane, int r) { return 2 * r + lane / 16; }
  static constexpr int row_step(int r) { return 2 * r; }  // row(lane, r) - row(lane, 0)
};

template <>
struct WmmaLayout<12> {
  static constexpr int kSlots = 8;
  static constexpr bool kRowsContiguous = true;  // a lane's D rows are 8 (l / 16) + r
  using Operand = u16x8;
  static __device__ __forceinline__ int k_first(int lane) { return 8 * (lane / 16); }
  static __device__ __forceinline__ int row(int lane, int r) { return 8 * (lane / 16) + r; }
  static constexpr int row_step(int r) { return r; }  // row(lane, r) - row(lane, 0)
};

template <int kGen, bool kIsBf16>
struct Wmma : WmmaLayout<kGen> {
  using Layout = WmmaLayout<kGen>;
  using Operand = typename Layout::Operand;
  using Layout::kSlots;

  static __device__ __forceinline__ f32x8 mma(Operand a, Operand b, f32x8 c) {
    if constexpr (kGen == 11 && !kIsBf16) {
      return __builtin_amdgcn_wmma_f32_16x16x16_f16_w32(__builtin_bit_cast(f16x16, a),
                                                        __builtin_bit_cast(f16x16, b), c);
    } else if constexpr (kGen == 11) {
      return __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32(__builtin_bit_cast(i16x16, a),
                                                         __builtin_bit_cast(i16x16, b), c);
    } else if constexpr (!kIsBf16) {
      return __builtin_amdgcn_wmma_f32_16x16x16_f16_w32_gfx12(__builtin_bit_cast(f16x8, a),
                                                              __builtin_bit_cast(f16x8, b), c);
    } else {
      return __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32_gfx12(__builtin_bit_cast(i16x8, a),
                                                               __builtin_bit_cast(i16x8, b), c);
    }
  }

  // The lane's slots read from a row-major array (LDS or global): `elems`
  // consecutive elements from `ptr`, zeros past `valid` (a multiple of 8 relative
  // to ptr, so each 16-byte piece is wholly in or out).
  static __device__ __forceinline__ Operand read(const uint16_t* ptr, int valid = kSlots) {
    u32x4 piece[kSlots / 8];
#pragma unroll
    for (int c = 0; c < kSlots / 8; ++c) {
      piece[c] = u32x4{0u, 0u, 0u, 0u};
      if (8 * c < valid) piece[c] = load<u32x4>(ptr + 8 * c);
    }
    return __builtin_bit_cast(Operand, piece);
  }

  // The B operand of a product contracting over the rows of an accumulator
  // tile (Note [portattn WMMA layout]): `x[r]` is D[row(lane, r)][lane % 16].
  static __device__ __forceinline__ Operand rows_as_b(const float (&x)[8]) {
    using T = Dtype<kIsBf16>;
    if constexpr (kGen == 12) {
      Operand b;
#pragma unroll
      for (int r = 0; r < 8; ++r) b[r] = T::from_float(x[r]);
      return b;
    } else {
      uint32_t own[4], other[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        own[j] = static_cast<uint32_t>(T::from_float(x[2 * j])) |
                 static_cast<uint32_t>(T::from_float(x[2 * j + 1])) << 16;
        other[j] = __shfl_xor(own[j], 16);
      }
      // Slot 2r + h is this lane's row r (h = lane / 16), slot 2r + 1 - h the partner's.
      const bool upper = (threadIdx.x % kWave32) >= 16;
      Operand b;
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        const uint16_t mine = static_cast<uint16_t>(own[r / 2] >> (16 * (r % 2)));
        const uint16_t theirs = static_cast<uint16_t>(other[r / 2] >> (16 * (r % 2)));
        b[2 * r] = upper ? theirs : mine;
        b[2 * r + 1] = upper ? mine : theirs;
      }
      return b;
    }
  }
};

// Row statistics of one query live in lanes l and l ^ 16 (Note [portattn WMMA layout]).
struct PairReduce {
  static __device__ __forceinline__ float max(float x) {
    const float other = __shfl_xor(x, 16);
    return x > other ? x : other;
  }
  static __device__ __forceinline__ float sum(float x) { return x + __shfl_xor(x, 16); }
};

}  // namespace rocm
}  // namespace portattn
