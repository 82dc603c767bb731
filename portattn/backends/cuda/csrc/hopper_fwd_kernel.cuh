// Hopper (sm_90a) forward attention: TMA tile loads, wgmma, warp specialization.
//
// First version of the project's Hopper path (issue #6). Forward only,
// fixed-length batches, fp16/bf16, head dims 64 and 128, non-causal or causal
// (bottom-right), LSE output, GQA/MQA. Everything else (varlen, windows,
// softcap, ALiBi, dropout, other head dims) stays on the sm80+ kernel
// (fwd_kernel.cuh); hopper_fwd_entry.cu refuses such calls with a message.
// NOT wired into dispatch: it is compiled only with PORTATTN_CUDA_HOPPER=1.
//
// CTA = 3 warpgroups (384 threads), one CTA per (128-row query block, head, batch):
//   warpgroup 0  producer: one thread issues every TMA copy (Q once, then K/V
//                blocks into a kStages-deep ring); setmaxnreg drops it to 24
//                registers so the consumers can have 240.
//   warpgroups 1, 2  consumers: 64 query rows each (the M of one wgmma). Per
//                key block: S = Q K^T (wgmma, both operands in shared memory),
//                mask, online softmax (backends/common/online_softmax.h), P to
//                fp16/bf16 registers, O += P V (wgmma, A = P from registers,
//                B = V from shared memory, transposed by the instruction).
//
// Shared memory: every tile is stored as column panels of 64 elements (128
// bytes per row, the widest row TMA's 128-byte swizzle allows), panel p at
// p * rows * 128 bytes, each written by one TMA copy with
// CU_TENSOR_MAP_SWIZZLE_128B. wgmma reads the same layout through its
// "128B swizzle" matrix descriptors (make_smem_desc below), so no data is
// rearranged between the copy engine and the tensor cores.
//
// Budget (kBlockM = kBlockN = 128):
//   hd64:  Q 16 KiB + 4 stages x (K 16 + V 16 KiB) = 144 KiB (+1 KiB alignment, barriers)
//   hd128: Q 32 KiB + 2 stages x (K 32 + V 32 KiB) = 160 KiB (+1 KiB)
//   consumer registers per thread: S 64 fp32 + O 32 (hd64) / 64 (hd128) fp32
//   + P 32 packed + softmax state; 240 allowed after setmaxnreg.
//
// Not yet here (see bench/results/hopper_notes.md): overlap of one block's
// softmax with the other warpgroup's / next block's wgmma (ping-pong,
// intra-warpgroup pipelining), a persistent scheduler, TMA store of O.
#pragma once
#include <cuda.h>  // CUtensorMap (a type only: the encoder comes from cudaGetDriverEntryPoint)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "../../common/online_softmax.h"
#include "../../common/params.h"
#include "ptx.cuh"

namespace portattn {
namespace hopper {

template <int kHeadDim>
struct HopperFwdTraits {
  static constexpr int kBlockM = 128;  // two consumer warpgroups x wgmma M (64)
  static constexpr int kBlockN = 128;  // S is 64 x 128 fp32 per warpgroup: 64 registers a thread
  // hd64 tiles are half the size, so twice the stages fit: deeper prefetch for free.
  static constexpr int kStages = kHeadDim <= 64 ? 4 : 2;
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kProducerRegs = 24;
  // 128 x 24 + 256 x 240 = 64512 <= 65536 registers of the SM.
  static constexpr int kConsumerRegs = 240;
  static constexpr int kPanel = 64;  // elements per 128-byte swizzled row
  static constexpr int kPanels = kHeadDim / kPanel;
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;
  static constexpr int kBarriers = 1 + 3 * kStages;  // Q, K full, V full, K/V empty
  static constexpr int kSmemBytes = kQBytes + 2 * kStages * kKVBytes + 8 * kBarriers +
                                    1024;  // slack to align the tiles to the 1 KiB swizzle atom
  static_assert(kHeadDim % kPanel == 0, "head dim must be a multiple of 64");
  static_assert(kSmemBytes <= 227 * 1024, "exceeds the sm90 shared-memory opt-in limit");
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <= 65536,
                "register split exceeds the register file");
};

// Scalars of one launch; the tensor maps travel as separate __grid_constant__ params.
struct HopperFwdArgs {
  void* out;
  PortattnTensor4 out_strides;
  float* lse;
  int64_t lse_batch_stride;
  int64_t lse_head_stride;
  int seqlen_q;
  int seqlen_k;
  int heads_per_kv;  // nheads / nheads_k
  float scale_log2;  // softmax_scale * log2(e)
};

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
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
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

#define PORTATTN_WGMMA_D128_REGS \
  "{" PORTATTN_WGMMA_REGS_0_31 "," \
  "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47," \
  "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63" "}"
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

// D (64 x 128) (+)= A (64 x 16, shared) * B (16 x 128, shared); both K-major
// (transpose flags 0). scale_d = 0 overwrites D. The asm text of fp16 and
// bf16 differs only in the type suffix.
#define PORTATTN_WGMMA_SS_N128(TY)                                                       \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                               \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " "              \
               PORTATTN_WGMMA_D128_REGS ", %64, %65, p, 1, 1, 0, 0;\n}\n"                \
               : PORTATTN_WGMMA_D128_OPERANDS(d)                                        \
               : "l"(desc_a), "l"(desc_b), "r"(scale_d))

template <typename Elem>
__device__ __forceinline__ void wgmma_ss_n128(float (&d)[2][32], uint64_t desc_a, uint64_t desc_b,
                                              int scale_d) {
  if constexpr (std::is_same<Elem, __nv_bfloat16>::value) {
    PORTATTN_WGMMA_SS_N128("bf16");
  } else {
    PORTATTN_WGMMA_SS_N128("f16");
  }
}

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

template <typename Elem, int kCols>
__device__ __forceinline__ void wgmma_rs(float (&d)[2][kCols], const uint32_t (&a)[4],
                                         uint64_t desc_b) {
  constexpr bool kBf16 = std::is_same<Elem, __nv_bfloat16>::value;
  static_assert(kCols == 16 || kCols == 32, "wgmma_rs is instantiated for N = 64 and 128");
  if constexpr (kCols == 16) {
    if constexpr (kBf16) { PORTATTN_WGMMA_RS_N64("bf16"); } else { PORTATTN_WGMMA_RS_N64("f16"); }
  } else {
    if constexpr (kBf16) { PORTATTN_WGMMA_RS_N128("bf16"); } else { PORTATTN_WGMMA_RS_N128("f16"); }
  }
}

// Row max / sum over the 4 threads (one quad) that share a row of the fragment.
struct QuadReduce {
  static __device__ __forceinline__ float max(float x) { return ptx::quad_allreduce_max(x); }
  static __device__ __forceinline__ float sum(float x) { return ptx::quad_allreduce_sum(x); }
};

}  // namespace sm90

// ---- the kernel ---------------------------------------------------------------------

template <int kHeadDim, typename Elem, bool kCausal>
__global__ void __launch_bounds__(HopperFwdTraits<kHeadDim>::kThreads, 1)
    hopper_fwd_kernel(const __grid_constant__ CUtensorMap tm_q,
                      const __grid_constant__ CUtensorMap tm_k,
                      const __grid_constant__ CUtensorMap tm_v, const HopperFwdArgs args) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Traits = HopperFwdTraits<kHeadDim>;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages;
  constexpr int kPanelBytesQ = kBlockM * 128;
  constexpr int kPanelBytesKV = kBlockN * 128;
  constexpr int kSCols = kBlockN / 4;   // S fragment columns per thread row
  constexpr int kOCols = kHeadDim / 4;  // O fragment columns per thread row

  extern __shared__ uint8_t smem_raw[];
  // Swizzle atoms must start 1 KiB aligned for base offset 0 in the descriptors.
  const uint32_t smem_base = (ptx::smem_addr(smem_raw) + 1023u) & ~1023u;
  const uint32_t s_q = smem_base;
  const uint32_t s_k = s_q + Traits::kQBytes;                    // kStages x kKVBytes
  const uint32_t s_v = s_k + kStages * Traits::kKVBytes;         // kStages x kKVBytes
  const uint32_t bars = s_v + kStages * Traits::kKVBytes;
  const uint32_t bar_q = bars;
  auto bar_k_full = [&](int s) { return bars + 8u * (1 + s); };
  auto bar_v_full = [&](int s) { return bars + 8u * (1 + kStages + s); };
  auto bar_empty = [&](int s) { return bars + 8u * (1 + 2 * kStages + s); };

  // Heaviest causal blocks (last query rows) first: they finish with the rest.
  const int m_block = kCausal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const int seqlen_q = args.seqlen_q;
  const int seqlen_k = args.seqlen_k;
  int n_blocks = (seqlen_k + kBlockN - 1) / kBlockN;
  if (kCausal) {
    // Key j is visible to query i when j <= i + seqlen_k - seqlen_q.
    const int last_row = min((m_block + 1) * kBlockM, seqlen_q) - 1;
    const int last_key = last_row + seqlen_k - seqlen_q;
    n_blocks = last_key < 0 ? 0 : min(n_blocks, last_key / kBlockN + 1);
  }

  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    sm90::mbar_init(bar_q, 1);
    for (int s = 0; s < kStages; ++s) {
      sm90::mbar_init(bar_k_full(s), 1);
      sm90::mbar_init(bar_v_full(s), 1);
      sm90::mbar_init(bar_empty(s), Traits::kConsumers * 4);  // one arrival per consumer warp
    }
    // Make the initialised barriers visible to the copy engine (async proxy).
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  }
  __syncthreads();

  if (warpgroup == 0) {
    // ---- producer ----
    sm90::setmaxnreg_dec<Traits::kProducerRegs>();
    if (threadIdx.x == 0 && n_blocks > 0) {
      sm90::prefetch_tensormap(&tm_q);
      sm90::prefetch_tensormap(&tm_k);
      sm90::prefetch_tensormap(&tm_v);
      const int head_k = head / args.heads_per_kv;
      sm90::mbar_arrive_expect_tx(bar_q, Traits::kQBytes);
#pragma unroll
      for (int p = 0; p < Traits::kPanels; ++p)
        sm90::tma_load_4d(s_q + p * kPanelBytesQ, &tm_q, bar_q, p * Traits::kPanel,
                          m_block * kBlockM, head, batch);
      for (int it = 0; it < n_blocks; ++it) {
        const int stage = it % kStages;
        const uint32_t round = it / kStages;
        const int n_block = n_blocks - 1 - it;
        sm90::mbar_wait(bar_empty(stage), (round & 1u) ^ 1u);
        sm90::mbar_arrive_expect_tx(bar_k_full(stage), Traits::kKVBytes);
#pragma unroll
        for (int p = 0; p < Traits::kPanels; ++p)
          sm90::tma_load_4d(s_k + stage * Traits::kKVBytes + p * kPanelBytesKV, &tm_k,
                            bar_k_full(stage), p * Traits::kPanel, n_block * kBlockN, head_k, batch);
        sm90::mbar_arrive_expect_tx(bar_v_full(stage), Traits::kKVBytes);
#pragma unroll
        for (int p = 0; p < Traits::kPanels; ++p)
          sm90::tma_load_4d(s_v + stage * Traits::kKVBytes + p * kPanelBytesKV, &tm_v,
                            bar_v_full(stage), p * Traits::kPanel, n_block * kBlockN, head_k, batch);
      }
    }
  } else {
    // ---- consumers ----
    sm90::setmaxnreg_inc<Traits::kConsumerRegs>();
    const int wg = warpgroup - 1;
    const int tid = threadIdx.x % 128;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int g = lane / 4;
    const int q4 = lane % 4;
    // Row of fragment row r (0/1) is row0 + 8r.
    const int row0 = m_block * kBlockM + wg * 64 + warp * 16 + g;

    float o[2][kOCols];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int c = 0; c < kOCols; ++c) o[r][c] = 0.f;
    softmax::RowState<2> state;
    state.init();

    if (n_blocks > 0) sm90::mbar_wait(bar_q, 0);
    // This warpgroup's 64 rows of each Q panel start wg * 64 * 128 bytes in.
    const uint32_t s_q_wg = s_q + wg * 64 * 128;
    for (int it = 0; it < n_blocks; ++it) {
      const int stage = it % kStages;
      const uint32_t parity = (it / kStages) & 1u;
      const int n_block = n_blocks - 1 - it;
      const uint32_t s_k_stage = s_k + stage * Traits::kKVBytes;
      const uint32_t s_v_stage = s_v + stage * Traits::kKVBytes;

      float s[2][kSCols];
      sm90::mbar_wait(bar_k_full(stage), parity);
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        const uint32_t offset = (kk % 4) * 32;  // k16 step inside the 128-byte panel row
        const uint64_t desc_q =
            sm90::make_smem_desc(s_q_wg + (kk / 4) * kPanelBytesQ + offset, 16, 1024);
        const uint64_t desc_k =
            sm90::make_smem_desc(s_k_stage + (kk / 4) * kPanelBytesKV + offset, 16, 1024);
        sm90::wgmma_ss_n128<Elem>(s, desc_q, desc_k, kk > 0 ? 1 : 0);
      }
      sm90::wgmma_commit();
      sm90::wgmma_wait<0>();
      sm90::fence_operands(s);

      // Mask keys past seqlen_k (TMA zero-filled them) and, for causal, keys
      // after each row's diagonal; only the blocks that straddle either edge.
      const int col_base = n_block * kBlockN;
      const bool edge = col_base + kBlockN > seqlen_k ||
                        (kCausal && col_base + kBlockN - 1 > m_block * kBlockM + seqlen_k - seqlen_q);
      if (edge) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int limit = kCausal ? min(seqlen_k, row0 + 8 * r + seqlen_k - seqlen_q + 1) : seqlen_k;
#pragma unroll
          for (int c = 0; c < kSCols; ++c) {
            const int col = col_base + (c / 2) * 8 + 2 * q4 + (c % 2);
            if (col >= limit) s[r][c] = softmax::neg_inf();
          }
        }
      }
      if (it == 0) {
        softmax::online_softmax_step<true, 2, kSCols, kOCols, sm90::QuadReduce>(s, o, state,
                                                                             args.scale_log2);
      } else {
        softmax::online_softmax_step<false, 2, kSCols, kOCols, sm90::QuadReduce>(s, o, state,
                                                                              args.scale_log2);
      }

      // P as the A fragment of k16 step kk: columns 16kk..16kk+15 = chunks 2kk, 2kk+1.
      uint32_t p[kBlockN / 16][4];
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        p[kk][0] = ptx::ElemTraits<Elem>::pack(s[0][4 * kk + 0], s[0][4 * kk + 1]);
        p[kk][1] = ptx::ElemTraits<Elem>::pack(s[1][4 * kk + 0], s[1][4 * kk + 1]);
        p[kk][2] = ptx::ElemTraits<Elem>::pack(s[0][4 * kk + 2], s[0][4 * kk + 3]);
        p[kk][3] = ptx::ElemTraits<Elem>::pack(s[1][4 * kk + 2], s[1][4 * kk + 3]);
      }

      sm90::mbar_wait(bar_v_full(stage), parity);
      sm90::fence_operands(o);
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        const uint64_t desc_v = sm90::make_smem_desc(s_v_stage + kk * 16 * 128, kPanelBytesKV, 1024);
        sm90::wgmma_rs<Elem>(o, p[kk], desc_v);
      }
      sm90::wgmma_commit();
      sm90::wgmma_wait<0>();
      sm90::fence_operands(o);
      // This warp no longer reads the stage (its wgmma completed).
      __syncwarp();
      if (lane == 0) sm90::mbar_arrive(bar_empty(stage));
    }

    float lse[2];
    softmax::online_softmax_finalize<2, kOCols, sm90::QuadReduce>(o, state, args.scale_log2, 1.f, lse);

    Elem* out = static_cast<Elem*>(args.out) + batch * args.out_strides.batch_stride +
                head * args.out_strides.head_stride;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + 8 * r;
      if (row >= seqlen_q) continue;
      Elem* out_row = out + static_cast<int64_t>(row) * args.out_strides.row_stride;
#pragma unroll
      for (int c = 0; c < kOCols; c += 2) {
        const int col = (c / 2) * 8 + 2 * q4;
        *reinterpret_cast<uint32_t*>(out_row + col) = ptx::ElemTraits<Elem>::pack(o[r][c], o[r][c + 1]);
      }
      if (args.lse != nullptr && q4 == 0)
        args.lse[batch * args.lse_batch_stride + head * args.lse_head_stride + row] = lse[r];
    }
  }
#endif
}

}  // namespace hopper
}  // namespace portattn
