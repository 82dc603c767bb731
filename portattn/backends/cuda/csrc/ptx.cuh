// Thin wrappers over the sm80+ PTX the attention kernels are built from.
//
// Decision (issue #3): raw PTX rather than CuTe. The kernels need four
// instructions (mma.sync.m16n8k16, ldmatrix[.trans], cp.async with zero fill,
// and the XOR swizzle that makes ldmatrix conflict-free); written out they
// are a page of code, compile quickly and keep the register fragments as
// plain arrays that the vendor-neutral online-softmax math
// (backends/common/online_softmax.h) can read. A Hopper wgmma/TMA path will
// live in its own files.
//
// Fragment conventions (PTX ISA, "Matrix Fragments for mma.m16n8k16"), with
// lane = threadIdx.x % 32, g = lane / 4, q = lane % 4:
//   A (16x16, row-major)  a[0]=(g, 2q..2q+1)  a[1]=(g+8, 2q..)  a[2]=(g, 8+2q..)  a[3]=(g+8, 8+2q..)
//   B (16x8,  "col")      b[0]=(k=2q..2q+1, n=g)  b[1]=(k=8+2q.., n=g)
//   C (16x8,  fp32)       c[0..1]=(g, 2q..2q+1)  c[2..3]=(g+8, 2q..2q+1)
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace portattn {
namespace ptx {

// ---- element types --------------------------------------------------------

template <typename Elem>
struct ElemTraits;

template <>
struct ElemTraits<__half> {
  static constexpr const char* kName = "f16";
  // Two fp32 values packed into one 32-bit register of two halves (low = first).
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

template <>
struct ElemTraits<__nv_bfloat16> {
  static constexpr const char* kName = "bf16";
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

// ---- tensor-core mma --------------------------------------------------------

// D = A * B + D, fp32 accumulators; the four accumulators are passed by
// reference so callers can keep them in whatever array shape suits the math.
template <typename Elem>
__device__ __forceinline__ void mma_16816(float& d0, float& d1, float& d2, float& d3,
                                          const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<__half>(float& d0, float& d1, float& d2, float& d3,
                                                  const uint32_t (&a)[4], uint32_t b0,
                                                  uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float& d0, float& d1, float& d2,
                                                         float& d3, const uint32_t (&a)[4],
                                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- ldmatrix ---------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// Four 8x8 b16 matrices; lane l supplies the row address of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Transposed: what a row-major (k, n) tile needs to become an mma B operand.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}

// ---- cp.async ---------------------------------------------------------------

// 16-byte global->shared copy that bypasses L1 (.cg). When `valid` is false
// nothing is read (src-size 0) and the destination is zero-filled, which is
// how out-of-range rows and head-dim tails become harmless zeros; callers
// still pass an address inside the allocation.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}

// The same for a chunk known to be in bounds: no source size, so an immediate offset of the
// source address folds into the instruction.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}

// 4-byte variant (.ca: the only cache mode for copies under 16 bytes), for per-row
// scalars such as the backward's LSE and delta.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait until at most `kPending` committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// ---- swizzled shared-memory tiles ------------------------------------------

// A (rows x kCols) tile of 16-bit elements, stored as column panels of
// kPanel elements (128 B when the head dim is a multiple of 64, else 64 B).
// Within a panel the 16-byte chunk index is XORed with bits of the row so the
// eight row addresses of one ldmatrix (same logical chunk, eight consecutive
// rows) land in eight different bank groups: with 128 B rows the chunk is
// XORed with row % 8; with 64 B rows two rows share a 128 B bank line, so the
// chunk is XORed with (row / 2) % 4.
//
// Addressing is split so that unrolled loops cost no registers: for a row
// R + r (R a multiple of 8, known at compile time; r from the lane) and a
// chunk C + c (C even and compile-time; c in {0, 1} from the lane), the
// swizzle bits depend on r only and XOR is linear, so
//     offset = fixed(R, C) + (lane(r, c) ^ chunk_xor(C))
// where `lane` is computed once per thread and the rest folds into the
// instruction's immediate or one LOP3.
template <int kRows, int kCols>
struct SwizzledTile {
  static constexpr int kPanel = (kCols % 64 == 0) ? 64 : 32;
  static constexpr int kChunksPerPanelRow = kPanel / 8;
  static constexpr int kPanelRowBytes = kPanel * 2;
  static constexpr int kPanels = kCols / kPanel;
  static constexpr int kChunksPerRow = kCols / 8;
  static constexpr int kChunks = kRows * kCols / 8;
  static constexpr int kBytes = kRows * kCols * 2;
  static_assert(kCols % 32 == 0, "tile width must be a multiple of 32 elements");
  static_assert(kRows % 8 == 0, "tile height must be a multiple of 8 rows");

  static __host__ __device__ __forceinline__ int xor_bits(int row) {
    return kPanel == 64 ? (row & 7) : ((row >> 1) & 3);
  }
  // Lane part of the offset: row r (any; only r's low bits enter the swizzle)
  // and chunk offset c within the panel row.
  static __host__ __device__ __forceinline__ uint32_t lane(int r, int c) {
    return static_cast<uint32_t>(r * kPanelRowBytes + ((c ^ xor_bits(r)) * 16));
  }
  // Compile-time parts for row base R (multiple of 8) and chunk base C (even).
  static __host__ __device__ constexpr uint32_t fixed(int R, int C) {
    return static_cast<uint32_t>((C / kChunksPerPanelRow) * kRows * kPanelRowBytes + R * kPanelRowBytes);
  }
  static __host__ __device__ constexpr uint32_t chunk_xor(int C) {
    return static_cast<uint32_t>((C % kChunksPerPanelRow) * 16);
  }
  // Byte offset of element `col` (a multiple of 8) of `row`, for one-off use.
  static __host__ __device__ __forceinline__ uint32_t offset(int row, int col) {
    const int chunk = col / 8;
    return static_cast<uint32_t>(
        ((chunk / kChunksPerPanelRow) * kRows + row) * kPanelRowBytes +
        (((chunk % kChunksPerPanelRow) ^ xor_bits(row)) * 16));
  }
};

// ---- small numeric helpers ---------------------------------------------------

__device__ __forceinline__ float quad_allreduce_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
  return x;
}

__device__ __forceinline__ float quad_allreduce_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x;
}

}  // namespace ptx
}  // namespace portattn
