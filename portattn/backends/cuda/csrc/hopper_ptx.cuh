// PTX wrappers of the Hopper (sm_90a) path, shared by its forward and backward
// kernels: mbarriers, TMA bulk tensor copies, setmaxnreg and wgmma (with
// Note [portattn wgmma descriptors]). Nothing here knows about attention.
#pragma once
#include <cuda.h>  // CUtensorMap (a type only: the encoder comes from cudaGetDriverEntryPoint)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

#include "ptx.cuh"

namespace portattn {
namespace hopper {
namespace sm90 {

// ---- mbarriers ----------------------------------------------------------------

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Arrives once and raises the barrier's expected transaction bytes (the TMA
// copies that follow complete them).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Waits until the phase of parity `parity` has completed. A fresh barrier is
// in phase 0, so waiting for parity 1 returns at once (how the producer's
// first pass over the empty ring goes through).
#ifndef PORTATTN_MBAR_SUSPEND_NS
#define PORTATTN_MBAR_SUSPEND_NS 0
#endif
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    if constexpr (PORTATTN_MBAR_SUSPEND_NS > 0) {
      asm volatile(
          "{\n.reg .pred p;\n"
          "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3;\n"
          "selp.u32 %0, 1, 0, p;\n}\n"
          : "=r"(done)
          : "r"(bar), "r"(parity), "r"(PORTATTN_MBAR_SUSPEND_NS)
          : "memory");
    } else {
      asm volatile(
          "{\n.reg .pred p;\n"
          "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
          "selp.u32 %0, 1, 0, p;\n}\n"
          : "=r"(done)
          : "r"(bar), "r"(parity)
          : "memory");
    }
  } while (!done);
}

// ---- TMA ------------------------------------------------------------------------

// One box of a 4-d tensor map (coordinates innermost first: column, row, head,
// batch) into shared memory; completes `bytes` on the barrier. Rows past the
// tensor's end are filled with zeros and still counted.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                            int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// One box of shared memory (the tensor map's box, same swizzle as the loads) into
// a 4-d tensor at the coordinates; boxes past the tensor's end are clipped, so
// rows and columns outside it are not written. Tracked by this thread's bulk
// groups (bulk_commit_group / bulk_wait_group_read below).
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, uint32_t src, int c0, int c1, int c2,
                                             int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

__device__ __forceinline__ void prefetch_tensormap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// ---- register reallocation ------------------------------------------------------

template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// ---- wgmma ------------------------------------------------------------------------

// Note [portattn wgmma descriptors]
// A 64-bit shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format"):
//   bits  0-13  start address >> 4
//   bits 16-29  leading-dimension byte offset (LBO) >> 4
//   bits 32-45  stride-dimension byte offset (SBO) >> 4
//   bits 49-51  base offset (0: every swizzle atom starts 1 KiB aligned here)
//   bits 62-63  swizzle mode: 1 = 128B, 2 = 64B, 3 = 32B, 0 = none
// With the 128B swizzle the unit is an "atom" of 8 rows x 128 bytes (1 KiB)
// whose 16-byte chunks are XORed with the row index (row % 8), exactly the
// pattern TMA's CU_TENSOR_MAP_SWIZZLE_128B writes.
//  * K-major operands (Q as A, K as B of S = Q K^T; rows = M or N, the 128
//    contiguous bytes = 64 elements of the head dim): SBO = 1024 (next group
//    of 8 rows); LBO is unused because one k16 step (32 bytes) never leaves
//    the 128-byte row, so it is set to 1 by convention. Step kk along the head
//    dim: panel kk / 4 (+ rows * 128 bytes), and +32 bytes per k16 inside the
//    panel; the hardware applies the XOR to the final address, so a start
//    address that is not atom-aligned by 32/64/96 bytes is what it expects.
//  * MN-major operand (V as B of O += P V: K = keys are the rows, N = head dim
//    is contiguous; the instruction's transpose-B flag): the atom is 64 N
//    elements x 8 K rows; SBO = 1024 (next 8 keys), LBO = the panel stride
//    rows * 128 bytes (next 64 head-dim columns). Step kk along the keys:
//    +16 rows = +2048 bytes.
__device__ __forceinline__ uint64_t make_smem_desc(uint32_t addr, uint32_t lbo_bytes,
                                                   uint32_t sbo_bytes) {
  uint64_t desc = static_cast<uint64_t>((addr & 0x3FFFF) >> 4);
  desc |= static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFF) << 16;
  desc |= static_cast<uint64_t>((sbo_bytes >> 4) & 0x3FFF) << 32;
  desc |= static_cast<uint64_t>(1) << 62;
  return desc;
}

// The descriptor of the matrix `bytes` further on in shared memory (same LBO, SBO and
// swizzle): make_smem_desc(addr + bytes, ...) whenever both addresses lie in the CTA's
// shared memory. Why a low-word add is exact: shared-memory addresses are below 2^18
// (228 KiB on sm_90), so (addr & 0x3FFFF) >> 4 is addr >> 4 and the start-address field
// holds it without the mask; (addr + bytes) >> 4 = (addr >> 4) + (bytes >> 4) for 16-byte
// multiples, and the sum stays below 2^14, so nothing carries into the LBO field at bit
// 16. The high word (SBO, swizzle) is the base's: one 32-bit add a descriptor, which a
// kernel whose bases are warp-uniform keeps in uniform registers (the backward's consumers:
// Note [portattn hopper backward descriptors] in hopper_bwd_kernel.cuh).
__device__ __forceinline__ uint64_t smem_desc_advance(uint64_t desc, uint32_t bytes) {
  const uint32_t lo = static_cast<uint32_t>(desc) + (bytes >> 4);
  return (desc & 0xFFFFFFFF00000000ull) | lo;
}
// make_smem_desc(addr + bytes, lbo_bytes, sbo) from base = make_smem_desc(addr, 0, sbo): the
// same low-word add, with the LBO field (empty in base) added in too.
__device__ __forceinline__ uint64_t smem_desc_at(uint64_t base, uint32_t bytes, uint32_t lbo_bytes) {
  const uint32_t lo = static_cast<uint32_t>(base) + (bytes >> 4) + (((lbo_bytes >> 4) & 0x3FFFu) << 16);
  return (base & 0xFFFFFFFF00000000ull) | lo;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving reads/writes of accumulator registers across
// the asynchronous wgmma region (the asm statements alone do not order them).
template <int kRows, int kCols>
__device__ __forceinline__ void fence_operands(float (&d)[kRows][kCols]) {
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int c = 0; c < kCols; ++c) asm volatile("" : "+f"(d[r][c])::"memory");
}

// Accumulator fragment of wgmma m64nN (fp32), as the mma.m16n8 C fragment
// repeated over N / 8 column chunks j: warp w of the warpgroup owns rows
// 16w..16w+15; with lane = 4g + q, register 4j + 2r + e holds
// (row 16w + g + 8r, column 8j + 2q + e). The arrays here are d[r][2j + e], the
// shape online_softmax.h works on (2 rows per thread, 4 threads per row); the
// operand lists below map one onto the other.
#define PORTATTN_WGMMA_REGS_0_31 \
  "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
  "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
#define PORTATTN_WGMMA_D64_REGS "{" PORTATTN_WGMMA_REGS_0_31 "}"
#define PORTATTN_WGMMA_D64_OPERANDS(d) \
      "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[1][0]), "+f"(d[1][1]), \
      "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][2]), "+f"(d[1][3]), \
      "+f"(d[0][4]), "+f"(d[0][5]), "+f"(d[1][4]), "+f"(d[1][5]), \
      "+f"(d[0][6]), "+f"(d[0][7]), "+f"(d[1][6]), "+f"(d[1][7]), \
      "+f"(d[0][8]), "+f"(d[0][9]), "+f"(d[1][8]), "+f"(d[1][9]), \
      "+f"(d[0][10]), "+f"(d[0][11]), "+f"(d[1][10]), "+f"(d[1][11]), \
      "+f"(d[0][12]), "+f"(d[0][13]), "+f"(d[1][12]), "+f"(d[1][13]), \
      "+f"(d[0][14]), "+f"(d[0][15]), "+f"(d[1][14]), "+f"(d[1][15])

// Registers and operands past the first 32, written once: N = 128 extends N = 64, and N = 176
// and N = 256 extend N = 128 by the same column chunks in the same order.
#define PORTATTN_WGMMA_REGS_32_63 \
  "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47," \
  "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
#define PORTATTN_WGMMA_REGS_64_87 \
  "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79," \
  "%80,%81,%82,%83,%84,%85,%86,%87"
#define PORTATTN_WGMMA_REGS_88_127 \
  "%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103," \
  "%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119," \
  "%120,%121,%122,%123,%124,%125,%126,%127"
#define PORTATTN_WGMMA_D128_REGS "{" PORTATTN_WGMMA_REGS_0_31 "," PORTATTN_WGMMA_REGS_32_63 "}"
#define PORTATTN_WGMMA_D128_OPERANDS(d) \
      PORTATTN_WGMMA_D64_OPERANDS(d), \
      "+f"(d[0][16]), "+f"(d[0][17]), "+f"(d[1][16]), "+f"(d[1][17]), \
      "+f"(d[0][18]), "+f"(d[0][19]), "+f"(d[1][18]), "+f"(d[1][19]), \
      "+f"(d[0][20]), "+f"(d[0][21]), "+f"(d[1][20]), "+f"(d[1][21]), \
      "+f"(d[0][22]), "+f"(d[0][23]), "+f"(d[1][22]), "+f"(d[1][23]), \
      "+f"(d[0][24]), "+f"(d[0][25]), "+f"(d[1][24]), "+f"(d[1][25]), \
      "+f"(d[0][26]), "+f"(d[0][27]), "+f"(d[1][26]), "+f"(d[1][27]), \
      "+f"(d[0][28]), "+f"(d[0][29]), "+f"(d[1][28]), "+f"(d[1][29]), \
      "+f"(d[0][30]), "+f"(d[0][31]), "+f"(d[1][30]), "+f"(d[1][31])

// N = 80 (40 fp32 a thread: the hd256 forward's S = Q K^T, Note [portattn hopper hd256]) and
// N = 256 (128 a thread: its O += P V); same fragment, more column chunks.
#define PORTATTN_WGMMA_D80_REGS "{" PORTATTN_WGMMA_REGS_0_31 "," "%32,%33,%34,%35,%36,%37,%38,%39" "}"
#define PORTATTN_WGMMA_D80_OPERANDS(d) \
      PORTATTN_WGMMA_D64_OPERANDS(d), \
      "+f"(d[0][16]), "+f"(d[0][17]), "+f"(d[1][16]), "+f"(d[1][17]), \
      "+f"(d[0][18]), "+f"(d[0][19]), "+f"(d[1][18]), "+f"(d[1][19])

// N = 112 (56 fp32 a thread: the hd192 forward's S = Q K^T, Note [portattn hopper hd192]) and
// N = 192 (96 a thread: its O += P V).
#define PORTATTN_WGMMA_D112_REGS \
  "{" PORTATTN_WGMMA_REGS_0_31 "," \
  "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55" "}"
#define PORTATTN_WGMMA_D112_OPERANDS(d) \
      PORTATTN_WGMMA_D80_OPERANDS(d), \
      "+f"(d[0][20]), "+f"(d[0][21]), "+f"(d[1][20]), "+f"(d[1][21]), \
      "+f"(d[0][22]), "+f"(d[0][23]), "+f"(d[1][22]), "+f"(d[1][23]), \
      "+f"(d[0][24]), "+f"(d[0][25]), "+f"(d[1][24]), "+f"(d[1][25]), \
      "+f"(d[0][26]), "+f"(d[0][27]), "+f"(d[1][26]), "+f"(d[1][27])

// N = 176 (88 fp32 a thread): the hd128 forward's 176-key blocks (Note [portattn hopper 176-key
// blocks], hopper_fwd_kernel.cuh).
#define PORTATTN_WGMMA_D176_REGS \
  "{" PORTATTN_WGMMA_REGS_0_31 "," PORTATTN_WGMMA_REGS_32_63 "," PORTATTN_WGMMA_REGS_64_87 "}"
#define PORTATTN_WGMMA_D176_OPERANDS(d) \
      PORTATTN_WGMMA_D128_OPERANDS(d), \
      "+f"(d[0][32]), "+f"(d[0][33]), "+f"(d[1][32]), "+f"(d[1][33]), \
      "+f"(d[0][34]), "+f"(d[0][35]), "+f"(d[1][34]), "+f"(d[1][35]), \
      "+f"(d[0][36]), "+f"(d[0][37]), "+f"(d[1][36]), "+f"(d[1][37]), \
      "+f"(d[0][38]), "+f"(d[0][39]), "+f"(d[1][38]), "+f"(d[1][39]), \
      "+f"(d[0][40]), "+f"(d[0][41]), "+f"(d[1][40]), "+f"(d[1][41]), \
      "+f"(d[0][42]), "+f"(d[0][43]), "+f"(d[1][42]), "+f"(d[1][43])

#define PORTATTN_WGMMA_D192_REGS \
  "{" PORTATTN_WGMMA_REGS_0_31 "," PORTATTN_WGMMA_REGS_32_63 "," PORTATTN_WGMMA_REGS_64_87 "," \
  "%88,%89,%90,%91,%92,%93,%94,%95" "}"
#define PORTATTN_WGMMA_D192_OPERANDS(d) \
      PORTATTN_WGMMA_D176_OPERANDS(d), \
      "+f"(d[0][44]), "+f"(d[0][45]), "+f"(d[1][44]), "+f"(d[1][45]), \
      "+f"(d[0][46]), "+f"(d[0][47]), "+f"(d[1][46]), "+f"(d[1][47])

#define PORTATTN_WGMMA_D256_REGS \
  "{" PORTATTN_WGMMA_REGS_0_31 "," PORTATTN_WGMMA_REGS_32_63 "," PORTATTN_WGMMA_REGS_64_87 "," \
  PORTATTN_WGMMA_REGS_88_127 "}"
#define PORTATTN_WGMMA_D256_OPERANDS(d) \
      PORTATTN_WGMMA_D176_OPERANDS(d), \
      "+f"(d[0][44]), "+f"(d[0][45]), "+f"(d[1][44]), "+f"(d[1][45]), \
      "+f"(d[0][46]), "+f"(d[0][47]), "+f"(d[1][46]), "+f"(d[1][47]), \
      "+f"(d[0][48]), "+f"(d[0][49]), "+f"(d[1][48]), "+f"(d[1][49]), \
      "+f"(d[0][50]), "+f"(d[0][51]), "+f"(d[1][50]), "+f"(d[1][51]), \
      "+f"(d[0][52]), "+f"(d[0][53]), "+f"(d[1][52]), "+f"(d[1][53]), \
      "+f"(d[0][54]), "+f"(d[0][55]), "+f"(d[1][54]), "+f"(d[1][55]), \
      "+f"(d[0][56]), "+f"(d[0][57]), "+f"(d[1][56]), "+f"(d[1][57]), \
      "+f"(d[0][58]), "+f"(d[0][59]), "+f"(d[1][58]), "+f"(d[1][59]), \
      "+f"(d[0][60]), "+f"(d[0][61]), "+f"(d[1][60]), "+f"(d[1][61]), \
      "+f"(d[0][62]), "+f"(d[0][63]), "+f"(d[1][62]), "+f"(d[1][63])

// D (64 x N) += A (64 x 16 from registers: per warp, the mma.m16n8k16 A
// fragment of its 16 rows) * B (16 x N, shared, MN-major: transpose-B = 1).
#define PORTATTN_WGMMA_RS_N64(TY)                                                        \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                               \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " "               \
               PORTATTN_WGMMA_D64_REGS ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"   \
               : PORTATTN_WGMMA_D64_OPERANDS(d)                                         \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1))
#define PORTATTN_WGMMA_RS_N128(TY)                                                       \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                               \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " "              \
               PORTATTN_WGMMA_D128_REGS ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"  \
               : PORTATTN_WGMMA_D128_OPERANDS(d)                                        \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1))

#define PORTATTN_WGMMA_RS_N192(TY)                                                       \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %101, 0;\n"                              \
               "wgmma.mma_async.sync.aligned.m64n192k16.f32." TY "." TY " "              \
               PORTATTN_WGMMA_D192_REGS ", {%96, %97, %98, %99}, %100, p, 1, 1, 1;\n}\n" \
               : PORTATTN_WGMMA_D192_OPERANDS(d)                                        \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1))

#define PORTATTN_WGMMA_RS_N256(TY)                                                       \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"                              \
               "wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " "              \
               PORTATTN_WGMMA_D256_REGS ", {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n" \
               : PORTATTN_WGMMA_D256_OPERANDS(d)                                        \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1))

template <typename Elem, int kCols>
__device__ __forceinline__ void wgmma_rs(float (&d)[2][kCols], const uint32_t (&a)[4],
                                         uint64_t desc_b) {
  constexpr bool kBf16 = std::is_same<Elem, __nv_bfloat16>::value;
  static_assert(kCols == 16 || kCols == 32 || kCols == 48 || kCols == 64,
                "wgmma_rs is instantiated for N = 64, 128, 192 and 256");
  if constexpr (kCols == 16) {
    if constexpr (kBf16) { PORTATTN_WGMMA_RS_N64("bf16"); } else { PORTATTN_WGMMA_RS_N64("f16"); }
  } else if constexpr (kCols == 32) {
    if constexpr (kBf16) { PORTATTN_WGMMA_RS_N128("bf16"); } else { PORTATTN_WGMMA_RS_N128("f16"); }
  } else if constexpr (kCols == 48) {
    if constexpr (kBf16) { PORTATTN_WGMMA_RS_N192("bf16"); } else { PORTATTN_WGMMA_RS_N192("f16"); }
  } else {
    if constexpr (kBf16) { PORTATTN_WGMMA_RS_N256("bf16"); } else { PORTATTN_WGMMA_RS_N256("f16"); }
  }
}

// D (64 x 64) (+)= A (64 x 16 from registers) * B (16 x 64, shared, K-major: the
// backward's S^T = K Q^T with K's fragment held in registers). scale_d = 0 overwrites D.
template <typename Elem>
__device__ __forceinline__ void wgmma_rs_kmajor_n64(float (&d)[2][16], const uint32_t (&a)[4], uint64_t desc_b,
                                                    int scale_d) {
  if constexpr (std::is_same<Elem, __nv_bfloat16>::value) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " PORTATTN_WGMMA_D64_REGS
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                 : PORTATTN_WGMMA_D64_OPERANDS(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " PORTATTN_WGMMA_D64_REGS
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                 : PORTATTN_WGMMA_D64_OPERANDS(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
  }
}

__device__ __forceinline__ uint32_t ld_shared_b32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}

// The 4 x 4 transpose of packed pairs across a quad: on entry lane q4 of the quad holds, for
// four 8-column chunks j of one fragment row, its pair of columns 2 q4, 2 q4 + 1 (v[j]); on
// exit it holds chunk q4 whole, its columns in order (8 consecutive 16-bit elements, one
// 16-byte store). Two shuffle rounds of two values each; every lane of the warp must call it.
__device__ __forceinline__ void quad_transpose_pairs(uint32_t (&v)[4], int q4) {
  // Round 1, partner q4 ^ 1: even lanes keep chunks 0 and 2, odd lanes 1 and 3.
  const bool odd = (q4 & 1) != 0;
  uint32_t send0 = odd ? v[0] : v[1], send1 = odd ? v[2] : v[3];
  uint32_t got0 = __shfl_xor_sync(0xffffffffu, send0, 1), got1 = __shfl_xor_sync(0xffffffffu, send1, 1);
  if (odd) { v[0] = got0; v[2] = got1; } else { v[1] = got0; v[3] = got1; }
  // Round 2, partner q4 ^ 2: lanes 0-1 keep the first two values, lanes 2-3 the last two.
  const bool upper = (q4 & 2) != 0;
  send0 = upper ? v[0] : v[2];
  send1 = upper ? v[1] : v[3];
  got0 = __shfl_xor_sync(0xffffffffu, send0, 2);
  got1 = __shfl_xor_sync(0xffffffffu, send1, 2);
  if (upper) { v[0] = got0; v[1] = got1; } else { v[2] = got0; v[3] = got1; }
}

// The launch's dynamic shared memory in bytes (%dynamic_smem_size): a value neither the compiler
// nor ptxas can know, so a branch on it is a real basic-block boundary (Note [portattn hopper
// softmax under P V], hopper_fwd_kernel.cuh). Not volatile: the read may be hoisted and shared.
__device__ __forceinline__ uint32_t dynamic_smem_bytes() {
  uint32_t bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
  return bytes;
}

// Row max / sum over the 4 threads (one quad) that share a row of the fragment.
struct QuadReduce {
  static __device__ __forceinline__ float max(float x) { return ptx::quad_allreduce_max(x); }
  static __device__ __forceinline__ float sum(float x) { return ptx::quad_allreduce_sum(x); }
  // Across the warp (Note [portattn lazy rescale]: the branch it decides is the warp's).
  static __device__ __forceinline__ bool any(bool x) { return __any_sync(0xffffffffu, x) != 0; }
};


// ---- backward additions (hopper_bwd_kernel.cuh) -------------------------------------

// 64 x 32 accumulator (16 fp32 per thread): the first four column chunks of the
// fragment described above.
#define PORTATTN_WGMMA_D32_REGS \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}"
#define PORTATTN_WGMMA_D32_OPERANDS(d) \
      "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[1][0]), "+f"(d[1][1]), \
      "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][2]), "+f"(d[1][3]), \
      "+f"(d[0][4]), "+f"(d[0][5]), "+f"(d[1][4]), "+f"(d[1][5]), \
      "+f"(d[0][6]), "+f"(d[0][7]), "+f"(d[1][6]), "+f"(d[1][7])

// D (64 x N) (+)= A (64 x 16) * B (16 x N), both from shared memory, with the
// instruction's transpose flags: 0 = K-major (Q, K as S = Q K^T reads them),
// 1 = MN-major (legal for 16-bit types only; the backward's dS^T as A and K
// as B of dQ = dS K). N = 4 * kCols (32, 64, 80, 112, 128 or 176). scale_d = 0 overwrites D.
// The forward's S = Q K^T uses it too (N = kBlockN: 128, 176, or 112 at hd192 and 80 at hd256).
// A, B, S, TA, TB: the operand numbers of desc_a, desc_b, scale_d and the two flags.
#define PORTATTN_WGMMA_SS(N, TY, REGS, OPERANDS, A, B, S, TA, TB)                          \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" S ", 0;\n"                             \
               "wgmma.mma_async.sync.aligned.m64n" N "k16.f32." TY "." TY " " REGS         \
               ", %" A ", %" B ", p, 1, 1, %" TA ", %" TB ";\n}\n"                         \
               : OPERANDS(d)                                                                 \
               : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB))

template <typename Elem, int kTransA, int kTransB, int kCols>
__device__ __forceinline__ void wgmma_ss(float (&d)[2][kCols], uint64_t desc_a, uint64_t desc_b,
                                         int scale_d) {
  constexpr bool kBf16 = std::is_same<Elem, __nv_bfloat16>::value;
  static_assert(kCols == 8 || kCols == 16 || kCols == 20 || kCols == 28 || kCols == 32 || kCols == 44,
                "wgmma_ss is instantiated for N = 32, 64, 80, 112, 128, 176");
  if constexpr (kCols == 8) {
    if constexpr (kBf16) {
      PORTATTN_WGMMA_SS("32", "bf16", PORTATTN_WGMMA_D32_REGS, PORTATTN_WGMMA_D32_OPERANDS, "16", "17", "18", "19", "20");
    } else {
      PORTATTN_WGMMA_SS("32", "f16", PORTATTN_WGMMA_D32_REGS, PORTATTN_WGMMA_D32_OPERANDS, "16", "17", "18", "19", "20");
    }
  } else if constexpr (kCols == 16) {
    if constexpr (kBf16) {
      PORTATTN_WGMMA_SS("64", "bf16", PORTATTN_WGMMA_D64_REGS, PORTATTN_WGMMA_D64_OPERANDS, "32", "33", "34", "35", "36");
    } else {
      PORTATTN_WGMMA_SS("64", "f16", PORTATTN_WGMMA_D64_REGS, PORTATTN_WGMMA_D64_OPERANDS, "32", "33", "34", "35", "36");
    }
  } else if constexpr (kCols == 20) {
    if constexpr (kBf16) {
      PORTATTN_WGMMA_SS("80", "bf16", PORTATTN_WGMMA_D80_REGS, PORTATTN_WGMMA_D80_OPERANDS, "40", "41", "42", "43", "44");
    } else {
      PORTATTN_WGMMA_SS("80", "f16", PORTATTN_WGMMA_D80_REGS, PORTATTN_WGMMA_D80_OPERANDS, "40", "41", "42", "43", "44");
    }
  } else if constexpr (kCols == 28) {
    if constexpr (kBf16) {
      PORTATTN_WGMMA_SS("112", "bf16", PORTATTN_WGMMA_D112_REGS, PORTATTN_WGMMA_D112_OPERANDS, "56", "57", "58", "59", "60");
    } else {
      PORTATTN_WGMMA_SS("112", "f16", PORTATTN_WGMMA_D112_REGS, PORTATTN_WGMMA_D112_OPERANDS, "56", "57", "58", "59", "60");
    }
  } else if constexpr (kCols == 44) {
    if constexpr (kBf16) {
      PORTATTN_WGMMA_SS("176", "bf16", PORTATTN_WGMMA_D176_REGS, PORTATTN_WGMMA_D176_OPERANDS, "88", "89", "90", "91", "92");
    } else {
      PORTATTN_WGMMA_SS("176", "f16", PORTATTN_WGMMA_D176_REGS, PORTATTN_WGMMA_D176_OPERANDS, "88", "89", "90", "91", "92");
    }
  } else {
    if constexpr (kBf16) {
      PORTATTN_WGMMA_SS("128", "bf16", PORTATTN_WGMMA_D128_REGS, PORTATTN_WGMMA_D128_OPERANDS, "64", "65", "66", "67", "68");
    } else {
      PORTATTN_WGMMA_SS("128", "f16", PORTATTN_WGMMA_D128_REGS, PORTATTN_WGMMA_D128_OPERANDS, "64", "65", "66", "67", "68");
    }
  }
}

// The register A operand of an in-flight wgmma must keep its registers until
// wgmma.wait_group returns; this "rewrites" them after the wait so the
// compiler cannot hand them to other values in between.
template <int kSteps>
__device__ __forceinline__ void fence_fragment(uint32_t (&a)[kSteps][4]) {
#pragma unroll
  for (int s = 0; s < kSteps; ++s)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[s][e])::"memory");
}

// A wgmma accumulator (64 x 16 kSteps fp32, fragment above) as the register A
// operand of the next product: k16 step kk = columns 16kk..16kk+15, packed to
// 16 bits (the forward's P, the backward's P^T and dS^T).
template <typename Elem, int kSteps>
__device__ __forceinline__ void pack_a_fragment(uint32_t (&a)[kSteps][4], const float (&d)[2][4 * kSteps]) {
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    a[kk][0] = ptx::ElemTraits<Elem>::pack(d[0][4 * kk + 0], d[0][4 * kk + 1]);
    a[kk][1] = ptx::ElemTraits<Elem>::pack(d[1][4 * kk + 0], d[1][4 * kk + 1]);
    a[kk][2] = ptx::ElemTraits<Elem>::pack(d[0][4 * kk + 2], d[0][4 * kk + 3]);
    a[kk][3] = ptx::ElemTraits<Elem>::pack(d[1][4 * kk + 2], d[1][4 * kk + 3]);
  }
}

// Barrier over a subset of the CTA's warps (id 0 is __syncthreads').
// A count in global memory that orders work between CTAs (Note [portattn hopper
// ordered dQ]): one thread waits for it to reach `value` (acquire, GPU scope; the
// caller then releases its CTA's other threads by a barrier), and one thread
// moves it on once the CTA's writes are done (after a barrier: fence.acq_rel
// makes every write ordered before it by that barrier visible first, as a
// release of the whole CTA's work).
__device__ __forceinline__ void wait_count_equals(const int* count, int value) {
  int seen;
  do {
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(seen) : "l"(count) : "memory");
  } while (seen != value);
}

// As wait_count_equals, for counts that more than one adder moves on at a turn.
__device__ __forceinline__ void wait_count_at_least(const int* count, int value) {
  int seen;
  do {
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(seen) : "l"(count) : "memory");
  } while (seen < value);
}

__device__ __forceinline__ void count_up_release(int* count) {
  asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
  asm volatile("red.relaxed.gpu.global.add.s32 [%0], 1;\n" ::"l"(count) : "memory");
}

__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Arrives on a named barrier without waiting (the producer side of a
// bar.sync on the same id and count elsewhere).
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t value) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(value) : "memory");
}

// Four 8 x 8 b16 matrices from the warp's accumulator fragments into shared memory: register i
// of every lane is its pair of matrix i (row lane / 4, columns 2 (lane % 4) and + 1, the mma /
// wgmma accumulator layout once packed), and lanes 8i .. 8i + 7 give the addresses of matrix i's
// eight 16-byte rows.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}

// stmatrix_x4 with .trans: matrix i is stored transposed, lane 8i + c giving the address of the
// 16-byte memory row that holds its column c (the backward's dS^T fragment written as dS).
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

__device__ __forceinline__ void st_shared_v2_f32(uint32_t addr, float x, float y) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(x), "f"(y) : "memory");
}

// ---- bulk (non-tensor) async copies: the backward's dQ reduction ---------------------

// global[dst, dst + bytes) += shared[src, src + bytes), element-wise fp32 adds
// performed in L2 by the copy engine (async proxy). dst and src 16-byte
// aligned, bytes a multiple of 16. Tracked by this thread's bulk groups.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
               "r"(src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit_group() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// At most kPending of this thread's bulk groups still read their shared source.
template <int kPending>
__device__ __forceinline__ void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}
// At most kPending of this thread's bulk groups not yet complete (writes performed).
template <int kPending>
__device__ __forceinline__ void bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Orders this thread's generic-proxy shared-memory writes before later
// async-proxy reads (wgmma operands, TMA stores) of the same bytes.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// The same between generic-proxy and async-proxy accesses of global memory: the
// deterministic bulk dQ adds (bulk reductions, async proxy) and the dq_order counts
// (generic ld.acquire / red) that order them (Note [portattn hopper ordered dQ]).
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

}  // namespace sm90

}  // namespace hopper
}  // namespace portattn
