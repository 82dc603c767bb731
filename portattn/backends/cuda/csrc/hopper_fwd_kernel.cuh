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
#include "hopper_ptx.cuh"
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
