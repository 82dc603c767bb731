// CDNA data movement and matrix-core primitives for the ROCm kernels (the
// dtype conversions, vector types and helpers are also RDNA's: rdna.h).
//
// Everything vendor-specific on the AMD side lives here: the MFMA builtin per
// dtype, bf16/fp16 conversions on raw 16-bit patterns, 8- and 16-byte vector
// types for coalesced global loads and conflict-light LDS accesses, and the
// wave64 cross-half reduction the online-softmax header asks for.
//
// Note [portattn MFMA layout]
// v_mfma_f32_32x32x8{f16,bf16_1k} (gfx90a) / v_mfma_f32_32x32x8_{f16,bf16}
// (gfx942, same builtins) computes D(32x32) += A(32x8) * B(8x32) per wave64:
//   lane l supplies A[l % 32][4 * (l / 32) + 0..3] and B[4 * (l / 32) + 0..3][l % 32]
//   and owns D[8 * (r / 4) + 4 * (l / 32) + r % 4][l % 32] for r = 0..15.
// Registers r = 4s..4s+3 of D therefore hold exactly the B operand of the
// s-th 8-deep step of a following MFMA: a product computed transposed
// (S^T = K Q^T) feeds O^T += V^T P^T with no cross-lane traffic, and each
// lane owns one query row (column l % 32), so its softmax statistics need a
// single exchange between lanes l and l ^ 32.
//
// The decode kernel (decode_kernel.h) uses the 16-row shape instead:
// v_mfma_f32_16x16x16{f16,bf16_1k} (gfx90a) / v_mfma_f32_16x16x16_{f16,bf16}
// (gfx942) computes D(16x16) += A(16x16) * B(16x16) per wave64:
//   lane l supplies A[l % 16][4 * (l / 16) + 0..3] and B[4 * (l / 16) + 0..3][l % 16]
//   and owns D[4 * (l / 16) + r][l % 16] for r = 0..3,
// so again D's four registers are the B operand of a following product, and a
// row of the transposed product (one query) lives in lanes l % 16 + 16 g.
//
// Note [portattn MFMA double depth]
// CDNA4 (gfx950) adds v_mfma_f32_32x32x16_{f16,bf16} and
// v_mfma_f32_16x16x32_{f16,bf16}: the M x N tile and D layout of the shapes
// above at twice the depth, 8 16-bit elements per lane and operand (AMD
// Instinct CDNA4 ISA reference guide, "Dense matrix layouts" of the MFMA
// chapter: A[i][k] is item k % 8 of lane i + M (k / 8), B[k][j] item k % 8 of
// lane j + N (k / 8), M = N = 32 or 16). One of them does the work of two of
// the shallower instructions in the 8 passes a 32x32x8 takes on CDNA3, which is
// CDNA4's doubled 16-bit rate per CU and clock (docs/rocm.md, "CDNA4").
// The kernels never rearrange data for it: with kStepsPerMfma = 2 a lane
// concatenates its operands of two consecutive shallow steps (steps 2p and
// 2p + 1, 4 + 4 elements) into one 8-element operand. Which depth index an
// (lane, item) slot stands for then differs from the ISA's numbering, but A
// and B go through the same relabelling and the depth is summed over, so the
// product is the same; what matters is only that A and B use one slot ->
// depth map, which the ISA's layout gives. So the D registers of a product
// still feed the next one's B operand without cross-lane traffic (registers
// 8p..8p+7 of a 32x32 score tile are keys 16p + 4(l / 32) + {0..3, 8..11}),
// and LDS operand reads stay 8-byte reads at the same addresses.
// With kStepsPerMfma = 1 (gfx90a, gfx942) the loops are the shallow-step ones.
#pragma once
#if defined(PORTATTN_ROCM_EMULATE)
// tests/rocm_emulation: the kernels on the CPU, one thread per lane, MFMA and
// cross-lane operations emulated with the layout above (logic tests only).
#include PORTATTN_ROCM_EMULATE
#else
#include <hip/hip_runtime.h>
#endif
#include <stdint.h>

#if defined(PORTATTN_ROCM52_HEADERS_LLVM20) && defined(__HIP_DEVICE_COMPILE__)
// Debian's ROCm 5.2 headers implement __syncthreads (and the fences) with the
// OpenCL device-library function __atomic_work_item_fence, which clang-22's
// device-library link no longer brings in (lld: undefined hidden symbol).
// build.py defines the macro for that compiler only; a ROCm install's hipcc
// uses its own headers.
extern "C" __device__ __attribute__((weak)) void __atomic_work_item_fence(__cl_mem_fence_flags, __memory_order,
                                                                        __memory_scope scope) {
  if (scope == __memory_scope_work_group) {
    __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, "workgroup");
  } else if (scope == __memory_scope_device) {
    __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, "agent");
  } else {
    __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, "");
  }
}
#endif

namespace portattn {
namespace rocm {

typedef float f32x16 __attribute__((ext_vector_type(16)));
typedef float f32x4 __attribute__((ext_vector_type(4)));
typedef _Float16 f16x4 __attribute__((ext_vector_type(4)));
typedef short i16x4 __attribute__((ext_vector_type(4)));
typedef uint16_t u16x4 __attribute__((ext_vector_type(4)));
typedef uint32_t u32x2 __attribute__((ext_vector_type(2)));
typedef uint32_t u32x4 __attribute__((ext_vector_type(4)));
typedef uint16_t u16x8 __attribute__((ext_vector_type(8)));

// 8-deep (32x32) or 16-deep (16x16) MFMA steps one instruction takes (Note
// [portattn MFMA double depth]); PORTATTN_ROCM_CDNA4 is defined by the
// generated gfx950 sources (variants.py).
#if defined(PORTATTN_ROCM_CDNA4)
constexpr int kStepsPerMfma = 2;
constexpr int kLdsBytesPerCu = 163840;  // 160 KiB, all of it addressable by one workgroup
typedef u16x8 MfmaOperand;
typedef _Float16 f16x8 __attribute__((ext_vector_type(8)));
typedef __bf16 bf16x8 __attribute__((ext_vector_type(8)));
#else
constexpr int kStepsPerMfma = 1;
constexpr int kLdsBytesPerCu = 65536;
typedef u16x4 MfmaOperand;
#endif

// One double-depth operand from a lane's operands of two consecutive shallow steps.
__device__ __forceinline__ u16x8 operand_of(u16x4 step0, u16x4 step1) {
  return __builtin_shufflevector(step0, step1, 0, 1, 2, 3, 4, 5, 6, 7);
}
// ... from an array of per-step operands, steps s..s + kStepsPerMfma - 1.
template <int kSteps>
__device__ __forceinline__ MfmaOperand operand_at(const u16x4 (&steps)[kSteps], int s) {
#if defined(PORTATTN_ROCM_CDNA4)
  return operand_of(steps[s], steps[s + 1]);
#else
  return steps[s];
#endif
}

// A kernel's fixed workgroup size and the occupancy (waves per SIMD) the
// register allocator must preserve. The CPU emulation defines it away.
#ifndef PORTATTN_LAUNCH_BOUNDS
#define PORTATTN_LAUNCH_BOUNDS(threads, waves_per_simd)                 \
  __attribute__((amdgpu_flat_work_group_size(threads, threads), \
                 amdgpu_waves_per_eu(waves_per_simd)))
#endif

constexpr int kWaveSize = 64;
constexpr int kMfmaM = 32;  // rows and columns of one MFMA tile
constexpr int kMfmaK = 8;   // depth of one MFMA step
constexpr int kMfma16 = 16;  // rows, columns and depth of the 16x16x16 shape

// A dtype is two conversions and one matrix instruction; tiles store the raw
// 16-bit patterns so loads and LDS traffic are dtype-agnostic.
template <bool kIsBf16>
struct Dtype;

template <>
struct Dtype<false> {
  static __device__ __forceinline__ float to_float(uint16_t bits) {
    return static_cast<float>(__builtin_bit_cast(_Float16, bits));
  }
  static __device__ __forceinline__ uint16_t from_float(float x) {
    return __builtin_bit_cast(uint16_t, static_cast<_Float16>(x));
  }
#if !defined(PORTATTN_ROCM_WMMA_GEN)  // RDNA has no MFMA: the builtins do not exist there
  static __device__ __forceinline__ f32x16 mfma(u16x4 a, u16x4 b, f32x16 c) {
    return __builtin_amdgcn_mfma_f32_32x32x8f16(__builtin_bit_cast(f16x4, a),
                                               __builtin_bit_cast(f16x4, b), c, 0, 0, 0);
  }
  static __device__ __forceinline__ f32x4 mfma16(u16x4 a, u16x4 b, f32x4 c) {
    return __builtin_amdgcn_mfma_f32_16x16x16f16(__builtin_bit_cast(f16x4, a),
                                                __builtin_bit_cast(f16x4, b), c, 0, 0, 0);
  }
#endif
#if defined(PORTATTN_ROCM_CDNA4)
  static __device__ __forceinline__ f32x16 mfma(u16x8 a, u16x8 b, f32x16 c) {
    return __builtin_amdgcn_mfma_f32_32x32x16_f16(__builtin_bit_cast(f16x8, a),
                                                 __builtin_bit_cast(f16x8, b), c, 0, 0, 0);
  }
  static __device__ __forceinline__ f32x4 mfma16(u16x8 a, u16x8 b, f32x4 c) {
    return __builtin_amdgcn_mfma_f32_16x16x32_f16(__builtin_bit_cast(f16x8, a),
                                                 __builtin_bit_cast(f16x8, b), c, 0, 0, 0);
  }
#endif
};

template <>
struct Dtype<true> {
  static __device__ __forceinline__ float to_float(uint16_t bits) {
    return __builtin_bit_cast(float, static_cast<uint32_t>(bits) << 16);
  }
  // Round to nearest even, as torch does; NaN stays a quiet NaN.
  static __device__ __forceinline__ uint16_t from_float(float x) {
    const uint32_t u = __builtin_bit_cast(uint32_t, x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
#if !defined(PORTATTN_ROCM_WMMA_GEN)
  static __device__ __forceinline__ f32x16 mfma(u16x4 a, u16x4 b, f32x16 c) {
    return __builtin_amdgcn_mfma_f32_32x32x8bf16_1k(__builtin_bit_cast(i16x4, a),
                                                   __builtin_bit_cast(i16x4, b), c, 0, 0, 0);
  }
  static __device__ __forceinline__ f32x4 mfma16(u16x4 a, u16x4 b, f32x4 c) {
    return __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(__builtin_bit_cast(i16x4, a),
                                                    __builtin_bit_cast(i16x4, b), c, 0, 0, 0);
  }
#endif
#if defined(PORTATTN_ROCM_CDNA4)
  static __device__ __forceinline__ f32x16 mfma(u16x8 a, u16x8 b, f32x16 c) {
    return __builtin_amdgcn_mfma_f32_32x32x16_bf16(__builtin_bit_cast(bf16x8, a),
                                                  __builtin_bit_cast(bf16x8, b), c, 0, 0, 0);
  }
  static __device__ __forceinline__ f32x4 mfma16(u16x8 a, u16x8 b, f32x4 c) {
    return __builtin_amdgcn_mfma_f32_16x16x32_bf16(__builtin_bit_cast(bf16x8, a),
                                                  __builtin_bit_cast(bf16x8, b), c, 0, 0, 0);
  }
#endif
};

// Row statistics of one query live in lanes l and l ^ 32 (Note [portattn MFMA layout]).
struct HalfWaveReduce {
  static __device__ __forceinline__ float max(float x) {
    const float other = __shfl_xor(x, 32);
    return x > other ? x : other;
  }
  static __device__ __forceinline__ float sum(float x) { return x + __shfl_xor(x, 32); }
};

// Row statistics of one query of the 16x16x16 layout live in lanes l % 16 + 16 g.
struct QuarterWaveReduce {
  static __device__ __forceinline__ float max(float x) {
    float other = __shfl_xor(x, 16);
    x = x > other ? x : other;
    other = __shfl_xor(x, 32);
    return x > other ? x : other;
  }
  static __device__ __forceinline__ float sum(float x) {
    x += __shfl_xor(x, 16);
    return x + __shfl_xor(x, 32);
  }
};

// Moves a wave-uniform value into a VGPR. The compiler keeps uniform values
// (and everything derived from them, e.g. Philox's ten round keys, hoisted out
// of the key loop) in SGPRs, of which a wave has only ~100; at 1-2 waves per
// SIMD VGPRs are the plentiful file, so the dropout key schedule lives there.
__device__ __forceinline__ uint32_t in_vgpr(uint32_t x) {
#if defined(__HIP_DEVICE_COMPILE__)
  uint32_t y;
  asm volatile("v_mov_b32 %0, %1" : "=v"(y) : "s"(x));
  return y;
#else
  return x;
#endif
}

__device__ __forceinline__ uint64_t in_vgpr(uint64_t x) {
  return (static_cast<uint64_t>(in_vgpr(static_cast<uint32_t>(x >> 32))) << 32) |
         in_vgpr(static_cast<uint32_t>(x));
}

// Makes `value` opaque to the optimiser at this point, so loads through it
// are not hoisted out of the enclosing loop (which would keep them resident
// in registers, exactly what the caller is avoiding).
template <class T>
__device__ __forceinline__ T opaque(T value) {
#if defined(__HIP_DEVICE_COMPILE__)
  asm volatile("" : "+v"(value));
#endif
  return value;
}

template <class T>
__device__ __forceinline__ T load(const void* ptr) {
  return *reinterpret_cast<const T*>(ptr);
}

template <class T>
__device__ __forceinline__ void store(void* ptr, const T& value) {
  *reinterpret_cast<T*>(ptr) = value;
}

}  // namespace rocm
}  // namespace portattn
