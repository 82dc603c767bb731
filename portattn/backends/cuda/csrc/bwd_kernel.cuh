// Backward attention kernels for sm80+ (mma.sync), FlashAttention-2 structure.
//
// Note [portattn cuda backward]
// Three launches (bwd_launch.cuh runs them):
//   1. bwd_preprocess: per query row, delta = rowsum(dO * O) in fp32, and the
//      saved LSE in log2 units (lse2) into the workspace next to it, so the
//      main kernel stages both with cp.async; a fully masked row's -inf
//      becomes +inf there, so its probabilities exp2(s - lse2) are exactly 0,
//      never NaN. It also clears the fp32 accumulators the main kernel adds into
//      (Note [portattn backward zeroing]).
//   2. bwd_kernel: one CTA per (key block, head, batch[, head-dim half]). K and
//      V of its key block stay in shared memory; the CTA walks the query blocks
//      that can see those keys (causal/window ranges skip the rest) and, per
//      query block, recomputes from Q, dO, lse2 and delta:
//        S^T  = K Q^T                 (keys are rows: each warp owns 16 keys)
//        P^T  = exp2(S^T * scale * log2e - lse2)      (+ softcap, ALiBi, mask)
//        dV  += (P^T * Z / (1 - p)) dO               (Z: the philox.h keep mask)
//        dP^T = V dO^T,  dP = dP * Z / (1 - p)
//        dS^T = P^T * (dP^T - delta)  [* (1 - tanh^2) with softcap]
//        dK  += dS^T Q                (dK and dV live in registers, fp32)
//        dQ  += dS K                  (dS^T goes through shared memory because
//                                      this product contracts over all warps'
//                                      keys; the result is added to an fp32
//                                      accumulator in global memory)
//      Working on S^T rather than S makes P^T and dS^T exactly the A fragments
//      of the dV and dK mma's once packed to 16 bits, so neither leaves
//      registers for those two products.
//   Large problems run these launches once per chunk of KV heads (with their
//   query heads), reusing one chunk-sized workspace: the fp32 dQ accumulator
//   is the backward's largest scratch (bwd_workspace_layout says when).
//   3. bwd_convert_dq (and, for GQA in the default mode, bwd_convert_dkv): scale
//      the fp32 accumulators by the softmax scale and cast to the output dtype.
//
// dQ accumulation (the only cross-CTA reduction):
//   default:        atomicAdd into one fp32 slice (float2 atomics on sm90).
//   deterministic:  grid.x is a fixed number of splits (det_splits in
//                   bwd_entry.cu); split s walks key blocks s, s + splits, ... in
//                   order and owns slice s of the accumulator alone (uncontended
//                   reductions from the same thread for the same element every
//                   time, so applied in program order), and the convert kernel
//                   sums the slices in index order. Cost: splits x the fp32 dQ
//                   size of workspace, and one extra read of it in the convert;
//                   measured 1.0-1.3x the default's time on an H100.
// GQA: dK/dV of a KV head are sums over the query heads of its group.
//   default:        CTA per query head, fp32 atomics into a (B, Sk, Hk, D)
//                   accumulator, then bwd_convert_dkv.
//   deterministic:  CTA per KV head, looping over the group's query heads in
//                   order, so dK/dV stay in registers and need no workspace.
// Head dims above 128 are split in two halves of the dK/dV/dQ columns over
// grid.z (S and dP still contract over the full head dim, so those two
// products are computed twice: 1.4x the FLOPs of an unsplit kernel, in
// exchange for dK + dV accumulators of at most 128 registers per thread).
#pragma once
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "../../common/block_range.h"
#include "../../common/dq_swizzle.h"
#include "../../common/online_softmax.h"
#include "../../common/params.h"
#include "../../common/philox.h"
#include "../../common/seq_bounds.h"
#include "ptx.cuh"

namespace portattn {
namespace cuda {

// Block shape of the main kernel: kBlockN keys per CTA (16 per warp), kBlockM
// queries per step, kStages shared-memory buffers for Q/dO/LSE/delta (2 lets
// the next query block stream in during the whole step; 1 overlaps it with
// the dQ product only). The per-head-dim choices and their shared-memory
// needs are in bwd_launch.cuh.
template <int kHeadDim_, int kBlockN_, int kBlockM_, int kStages_>
struct BwdTileConfig {
  static constexpr bool kWide = false;  // bwd_kernel; BwdWideConfig (bwd_wide_kernel.cuh): bwd_wide_kernel
  static constexpr bool kPlainOnly = false;  // see BwdWideConfig
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kStages = kStages_;
  static constexpr int kWarps = kBlockN / 16;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kDSplit = kHeadDim > 128 ? 2 : 1;
  static constexpr int kDOut = kHeadDim / kDSplit;  // dK/dV/dQ columns per CTA
  // Two CTAs per SM where the accumulators fit in 128 registers per thread (head dim 32:
  // dK + dV 32, S^T + dP^T 64). At 172 registers one 8-warp CTA per SM left the short
  // sequences of head dims 16-32 latency-bound (bench/results/latest/short_seq.md). The
  // extras variant (softcap, ALiBi, dropout) would spill heavily under the cap: it keeps one.
  // Its 49 KB of shared memory (+1 KB reserved per CTA) fits twice in the 100 KB of the
  // smallest sm80+ parts (sm86/sm89/sm120). At hd 64 the cap spills 524 B and is 4-10%
  // slower on the H100 (docs/kernels-sm80.md).
  static constexpr bool kTwoCtasPerSm = kHeadDim <= 32;
  // dQ is produced in (kDqRows x kDqChunk) tiles, distributed over the warps: the
  // largest tile that still gives every warp one. 32 columns halve the reloads of the dS
  // fragment, 32 rows those of K, and a larger tile has more independent accumulators.
  static constexpr int kDqChunk =
      (kDOut % 32 == 0 && (kBlockM / 16) * (kDOut / 32) >= kWarps) ? 32 : 16;
  static constexpr int kDqRows =
      (kBlockM % 32 == 0 && (kBlockM / 32) * (kDOut / kDqChunk) >= kWarps) ? 32 : 16;

  using KVTile = ptx::SwizzledTile<kBlockN, kHeadDim>;
  using QTile = ptx::SwizzledTile<kBlockM, kHeadDim>;
  using DsTile = ptx::SwizzledTile<kBlockN, kBlockM>;
  static constexpr int kOffK = 0;
  static constexpr int kOffV = KVTile::kBytes;
  static constexpr int kOffQ = 2 * KVTile::kBytes;
  static constexpr int kOffDo = kOffQ + kStages * QTile::kBytes;
  static constexpr int kOffDs = kOffDo + kStages * QTile::kBytes;
  static constexpr int kOffLse = kOffDs + DsTile::kBytes;
  static constexpr int kOffDelta = kOffLse + kStages * kBlockM * 4;
  static constexpr int kSmemBytes = kOffDelta + kStages * kBlockM * 4;

  static_assert(kHeadDim % 32 == 0 && kHeadDim <= 256, "instantiated head dims are multiples of 32");
  static_assert(kBlockN % 16 == 0 && kBlockM % 16 == 0 && kBlockM >= 32, "mma tile multiples");
  static_assert(kDOut % 16 == 0, "dK/dV columns are read by ldmatrix.x4 in 16-column steps");
  static_assert(kStages == 1 || kStages == 2, "one or two Q/dO buffers");
  static_assert(kBlockM <= kThreads, "one thread per query row stages its LSE and delta");
};

// Kernel arguments: the C ABI params plus the workspace carve-up of
// bwd_launch.cuh (BwdWorkspace).
struct BwdArgs {
  PortattnBwdParams p;
  // This launch's chunk of heads: query heads [head0, head0 + heads), KV heads
  // [head0 / group, + heads_k). The workspace arrays cover the chunk only.
  int head0, heads, heads_k;
  float* delta;     // (B, heads, ws_rows) rowsum(dO * O)
  float* lse2;      // (B, heads, ws_rows) the LSE in log2 units, +inf for fully masked rows
  float* dq_accum;  // [slices] x (B, heads, ws_rows, acc_head_dim) fp32 (blocked: dq_blocked)
  // Rows per (batch, head) of the workspace arrays (BwdWorkspace::ws_rows): Sq_max, rounded up to
  // a multiple of 8 for the blocked dQ, so that every head's rows start on a whole 8-row block.
  int ws_rows;
  float* dk_accum;  // (B, Sk_max, heads_k, acc_head_dim) fp32, GQA default mode only
  float* dv_accum;
  // Elements per row of the fp32 accumulators (dQ, and dK/dV for GQA): f.headdim on the
  // sm80+ path; the kernel's head dim when the Hopper backward serves a smaller head dim
  // padded (hopper_bwd_acc_head_dim below). The convert kernels read the first f.headdim.
  int acc_head_dim;
  int64_t dq_slice;  // elements per dq_accum slice
  int splits;        // deterministic: grid.x; default: unused
  // Deterministic mode of the Hopper backward (Note [portattn hopper ordered dQ]):
  // per (batch, chunk head, 64-query block of Sq_max) the count of key blocks whose
  // dQ has been added; null for every other launch.
  int* dq_order;
  // The Hopper backward's bulk dQ adds (Note [portattn hopper bulk dQ]): dq_accum's
  // rows hold their 16-byte chunks swizzled (dq_chunk_swizzle); false everywhere else.
  bool dq_swizzled;
  // The sm80+ kernels' blocked dQ layout (Note [portattn sm80 blocked dQ]); false for the Hopper
  // backward (ordered_dq in run_bwd_sequence).
  bool dq_blocked;
  // The workspace bytes the main kernel adds into (the dq_order counts and the fp32
  // accumulators; a multiple of 16, 16-byte aligned), which bwd_preprocess zeroes
  // (Note [portattn backward zeroing]); zero_bytes = 0: cleared by the caller instead.
  void* zero_begin;
  int64_t zero_bytes;
};

// dq_chunk_key / dq_chunk_swizzle (the bulk dQ rows' layout): common/dq_swizzle.h.

// The accumulator row pitch (elements) of the Hopper backward at `head_dim`: its kernel's
// head dim, the first of 64, 128, 192, 256 at or above it (96 runs on the hd128 kernel; Note
// [portattn hopper padded head dims], backward part, in hopper_fwd_launch.cuh). The kernel adds whole
// kHeadDim-wide rows (one bulk copy per 64-row tile, rows swizzled by 16-byte chunk), so the
// workspace is laid out with that pitch; one rule here for the size Python allocates
// (portattn_cuda_hopper_bwd_workspace_bytes) and the launch (run_hopper_bwd checks that its
// kHeadDim equals it, so a table entry that broke the rule fails instead of overrunning).
__host__ __device__ constexpr int hopper_bwd_acc_head_dim(int head_dim) {
  return head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : head_dim <= 192 ? 192 : 256;
}

// The deterministic Hopper backward orders its dQ adds per query block of this
// many rows (its kBlockM; Note [portattn hopper ordered dQ]): BwdArgs::dq_order
// holds one count per such block.
constexpr int kDqOrderRows = 64;

// Row of the (B, chunk heads, ws_rows) workspace arrays; varlen rows are padded
// to the longest sequence, so the layout needs nothing but the params (and
// seq_bounds caps every sequence at Sq_max <= ws_rows, so no row reaches its neighbour's).
__device__ __forceinline__ int64_t ws_row(const BwdArgs& args, int batch, int head, int i) {
  return (static_cast<int64_t>(batch) * args.heads + head - args.head0) * args.ws_rows + i;
}

// The heads of a main-kernel CTA (grid.y): deterministic, a KV head walking
// its group's query heads in order; default, one query head.
struct BwdHeads {
  int head_k, head_first, heads;
};

__device__ __forceinline__ BwdHeads bwd_heads(const BwdArgs& args, bool det, int group) {
  const int y = static_cast<int>(blockIdx.y);
  const int head_k = det ? args.head0 / group + y : (args.head0 + y) / group;
  return BwdHeads{head_k, det ? head_k * group : args.head0 + y, det ? group : 1};
}

// ---- 1. preprocess ------------------------------------------------------------

// 2^lanes_log2 lanes per query row, each covering 8 columns (the smallest power of two
// that covers the head dim, bwd_preprocess_lanes_log2), so a warp handles 32 / lanes rows:
// with one row per warp, head dim 16 left 30 lanes idle and this kernel took 1.7x the
// time of cuDNN's at batch 512, seqlen 300 (bench/results/latest/short_seq.md).
__host__ __device__ inline int bwd_preprocess_lanes_log2(int headdim) {
  int log2 = 0;
  while ((8 << log2) < headdim && log2 < 5) ++log2;
  return log2;
}

// Note [portattn backward zeroing]
// The accumulators the main kernel adds into must start at zero. Each CTA of this kernel clears
// an equal slice of those bytes with 16-byte stores, issued before its loads, instead of a
// cudaMemsetAsync pass over the workspace before it (41 us for hd128's 128 MiB dQ accumulator at
// 16k tokens, next to this kernel's 55 us). On an H100 the memset and this kernel take 96-99 us a
// step, the fused kernel 92-94 us (archive:2026-11-26-4b8e76b-s21/c9). It moves the same bytes at
// ~2.9 TB/s, so what it saves is a launch and a few microseconds, not bandwidth. The slices cover
// the whole region whatever its layout (swizzled dQ rows, GQA's dK / dV, the ordered mode's counts);
// delta and lse2, which this kernel writes, lie before it (bwd_workspace_layout).
__device__ __forceinline__ void bwd_zero_slice(const BwdArgs& args) {
  const int64_t vectors = args.zero_bytes / 16;
  const int64_t ctas = static_cast<int64_t>(gridDim.x) * gridDim.y * gridDim.z;
  const int64_t cta = blockIdx.x + static_cast<int64_t>(gridDim.x) * (blockIdx.y + static_cast<int64_t>(gridDim.y) * blockIdx.z);
  const int64_t per_cta = (vectors + ctas - 1) / ctas;
  const int64_t begin = cta * per_cta;
  const int64_t end = begin + per_cta < vectors ? begin + per_cta : vectors;
  uint4* zero = static_cast<uint4*>(args.zero_begin);
  for (int64_t v = begin + threadIdx.x; v < end; v += blockDim.x) zero[v] = make_uint4(0u, 0u, 0u, 0u);
}

template <typename Elem>
__global__ void __launch_bounds__(256) bwd_preprocess(const BwdArgs args, int lanes_log2) {
  const PortattnFwdParams& f = args.p.fwd;
  if (args.zero_bytes > 0) bwd_zero_slice(args);
  const int lanes = 1 << lanes_log2;
  const int lane = threadIdx.x % 32;
  const int rows_per_block = (blockDim.x / 32) << (5 - lanes_log2);
  const int i = blockIdx.x * rows_per_block + static_cast<int>(threadIdx.x) / lanes;
  const int head = args.head0 + blockIdx.y;
  const int batch = blockIdx.z;
  const SeqBounds s = seq_bounds(f, batch);  // clamped to the tensors (seq_bounds.h)
  const bool valid = i < s.len_q;  // no early return: every lane takes part in the shuffles
  const int64_t row = s.q_start + i;
  float acc = 0.f;
  const int col = (lane % lanes) * 8;
  if (valid && col < f.headdim) {
    const Elem* o = static_cast<const Elem*>(f.out) + batch * f.out_strides.batch_stride +
                    row * f.out_strides.row_stride + head * f.out_strides.head_stride + col;
    const Elem* d = static_cast<const Elem*>(args.p.dout) + batch * args.p.dout_strides.batch_stride +
                    row * args.p.dout_strides.row_stride + head * args.p.dout_strides.head_stride + col;
    const uint4 ov = *reinterpret_cast<const uint4*>(o);
    const uint4 dv = *reinterpret_cast<const uint4*>(d);
    const Elem* oe = reinterpret_cast<const Elem*>(&ov);
    const Elem* de = reinterpret_cast<const Elem*>(&dv);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc += static_cast<float>(oe[e]) * static_cast<float>(de[e]);
  }
  for (int mask = lanes / 2; mask > 0; mask /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, mask);
  if (valid && lane % lanes == 0) {
    const int64_t ws = ws_row(args, batch, head, i);
    args.delta[ws] = acc;
    const float lse = f.lse[batch * f.lse_batch_stride + head * f.lse_head_stride + row];
    args.lse2[ws] = lse == softmax::neg_inf() ? __builtin_huge_valf() : lse * softmax::kLog2e;
  }
}

// ---- 2. main kernel -------------------------------------------------------------

// Issue cp.async for a (kRows x kCols) tile; rows >= valid_rows and columns >=
// valid_cols are zero-filled (invalid lanes read from `base`, which is in bounds).
//
// The threads walk the tile panel by panel (SwizzledTile: kPanel-column panels, each kRows
// rows), a thread keeping one 16-byte column chunk of a panel row: a pass covers kRowsPerPass
// panel rows. Where passes stay in whole swizzle periods (8 rows) and fit the panels evenly,
// a thread's global and shared addresses are computed once and every pass adds compile-time
// offsets (plus one 64-bit multiple of the row stride per distinct row offset). The general
// path below recomputes row and column per chunk, with a 64-bit row * stride each: ~170 of the
// ~1350 instructions a warp issued per step of the hd256 wide backward (ncu and SASS, H200),
// which this path removes.
template <class Tile, int kRows, int kCols, int kThreads, typename Elem>
__device__ __forceinline__ void bwd_load_tile(uint32_t smem, const Elem* base, int64_t row_stride,
                                              int valid_rows, int valid_cols) {
  constexpr int kCpr = Tile::kChunksPerPanelRow;
  constexpr int kPanelRows = Tile::kPanels * kRows;  // panel rows in the tile
  constexpr int kRowsPerPass = kThreads / kCpr;
  constexpr bool kPanelWalk = kThreads % kCpr == 0 && kRowsPerPass % 8 == 0 &&
                              (kRows % kRowsPerPass == 0 || kRowsPerPass % kRows == 0);
  if constexpr (kPanelWalk) {
    constexpr int kPasses = (kPanelRows + kRowsPerPass - 1) / kRowsPerPass;
    const int rp = static_cast<int>(threadIdx.x) / kCpr;  // this thread's panel row in a pass
    const int c = static_cast<int>(threadIdx.x) % kCpr;
    const int row = rp % kRows;  // rp < kRows where passes split a panel
    const int panel = rp / kRows;
    const int col = panel * Tile::kPanel + c * 8;
    const Elem* src = base + row * row_stride + col;
    const uint32_t dst = smem + Tile::offset(row, col);
    if (valid_rows >= kRows && valid_cols >= kCols) {  // the whole tile: no predicates (uniform)
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        const int r_off = (pass * kRowsPerPass) % kRows;
        const int p_off = (pass * kRowsPerPass) / kRows;
        if (kPanelRows % kRowsPerPass != 0 && panel + p_off >= Tile::kPanels) continue;
        ptx::cp_async_16(dst + (p_off * kRows + r_off) * Tile::kPanelRowBytes,
                         src + r_off * row_stride + p_off * Tile::kPanel);
      }
      return;
    }
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int r_off = (pass * kRowsPerPass) % kRows;  // compile-time once unrolled
      const int p_off = (pass * kRowsPerPass) / kRows;
      if (kPanelRows % kRowsPerPass != 0 && panel + p_off >= Tile::kPanels) continue;  // the last pass's tail
      const bool valid = row + r_off < valid_rows && col + p_off * Tile::kPanel < valid_cols;
      const Elem* at = src + r_off * row_stride + p_off * Tile::kPanel;
      ptx::cp_async_16(dst + (p_off * kRows + r_off) * Tile::kPanelRowBytes, valid ? at : base, valid);
    }
    return;
  }
  constexpr int kChunksPerRow = kCols / 8;
  constexpr int kTotal = kRows * kChunksPerRow;
  constexpr int kIters = (kTotal + kThreads - 1) / kThreads;
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int index = it * kThreads + static_cast<int>(threadIdx.x);
    if (kTotal % kThreads == 0 || index < kTotal) {
      const int row = index / kChunksPerRow;
      const int col = (index % kChunksPerRow) * 8;
      const bool valid = row < valid_rows && col < valid_cols;
      const Elem* src = valid ? base + row * row_stride + col : base;
      ptx::cp_async_16(smem + Tile::offset(row, col), src, valid);
    }
  }
}

__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t value) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(value));
}

// Adds (v0, v1) to two adjacent fp32 accumulator elements with a reduction
// (fire and forget: no round trip to wait for). In the deterministic mode the
// element's slice belongs to one CTA and the same thread adds to it every
// time, so the additions reach memory in program order (same-address
// coherence) and the sum is reproducible; in the default mode CTAs race and
// the order varies. (A plain load-add-store made the deterministic mode 1.7x
// slower than the default on an H100: the load latency is exposed.)
__device__ __forceinline__ void accum_add2(float* ptr, float v0, float v1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(ptr), make_float2(v0, v1));
#else
  atomicAdd(ptr, v0);
  atomicAdd(ptr + 1, v1);
#endif
}

// Note [portattn sm80 blocked dQ]
// The sm80+ kernels' fp32 dQ accumulator (BwdArgs::dq_blocked) is stored in blocks of 8 rows x 8
// columns, 256 contiguous bytes each: element (R, c) of accumulator row R (ws_row) at
//   (R / 8) * 8 * pitch + (c / 8) * 64 + (R % 8) * 8 + c % 8
// (dq_blocked_offset; pitch = the row's floats, a multiple of 8; each head's rows are padded to
// a multiple of 8, BwdArgs::ws_rows, so a head's first row starts a block). One reduction instruction of an mma C fragment (lane
// g, q: rows g of an 8-row half, columns 2q, 2q + 1 of an n8 tile) then covers one such block,
// 2 cache lines, where row-major rows made it 8 lines of 32 bytes: ncu showed the row-major
// reductions stalling the issue on the LSU queue (lg_throttle 0.47 cycles an instruction at hd128
// against FlashAttention-2's 0.01, with the same L2 reduction sectors); a timing build with this
// access pattern took the main kernel from 6.87 to 6.35 ms (hd128, 4k keys, H200), and this layout
// measured forward+backward 1.02-1.04x at hd64, 1.05-1.06x at 128, 1.13-1.14x at 256
// (docs/kernels-sm80.md). The convert kernel reads a row's 8-column chunk as 32 contiguous bytes.
// The Hopper backward keeps its own row layout (Note [portattn hopper bulk dQ]).
// dq_tile_add's immediate-offset path needs the step's first row at a multiple of 8: the padded
// head pitch makes every step's (m0 is a multiple of kBlockM) whatever seqlen_q is. With the exact
// pitch, calls whose seqlen_q (max_seqlen_q for varlen) was not a multiple of 8 added most heads'
// tiles through the bounds-tested path: 0.96-0.97x forward+backward at hd128, seqlen 4095 against
// 4096 (docs/kernels-sm80.md). The padding costs at most 7 rows a head of delta, lse2 and dQ.
__host__ __device__ __forceinline__ int64_t dq_blocked_offset(int64_t row, int col, int pitch) {
  return (row >> 3) * 8 * pitch + (col >> 3) * 64 + (row & 7) * 8 + (col & 7);
}

// Adds a warp's dQ tile (kRowTiles m16 tiles x kChunkTiles n8 tiles, rows from 16 * kRowTiles * tm,
// columns from col0) into the blocked fp32 accumulator dq (Note [portattn sm80 blocked dQ]; pitch
// headdim) at accumulator row row0 (the step's first query, a multiple of 8). Interior tiles (every
// row inside the sequence, headdim == kHeadDim) take the pitch as a constant, so each
// reduction is one instruction at an immediate offset from one address; boundary tiles test each
// row and column.
template <int kHeadDim, int kRowTiles, int kChunkTiles>
__device__ __forceinline__ void dq_tile_add(float* dq, int64_t row0, const float (&acc)[kRowTiles][kChunkTiles][4],
                                            int tm, int col0, int g, int q2, bool interior, int headdim, int rows) {
  if (interior) {
    float* at = dq + ((row0 >> 3) + tm * kRowTiles * 2) * 8 * kHeadDim + (col0 >> 3) * 64 + g * 8 + q2;
#pragma unroll
    for (int r = 0; r < kRowTiles; ++r)
#pragma unroll
      for (int t = 0; t < kChunkTiles; ++t) {
        accum_add2(at + (2 * r) * 8 * kHeadDim + t * 64, acc[r][t][0], acc[r][t][1]);
        accum_add2(at + (2 * r + 1) * 8 * kHeadDim + t * 64, acc[r][t][2], acc[r][t][3]);
      }
    return;
  }
  const int row_first = tm * kRowTiles * 16 + g;
#pragma unroll
  for (int r = 0; r < kRowTiles; ++r)
#pragma unroll
    for (int t = 0; t < kChunkTiles; ++t) {
      const int col = col0 + t * 8 + q2;
      if (col >= headdim) continue;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = row_first + r * 16 + h * 8;
        if (i < rows) accum_add2(dq + dq_blocked_offset(row0 + i, col, headdim), acc[r][t][2 * h], acc[r][t][2 * h + 1]);
      }
    }
}

// C fragments of two adjacent n8 tiles (fp32) -> one m16 x k16 A fragment.
template <typename Elem>
__device__ __forceinline__ void pack_a(uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
  a[0] = ptx::ElemTraits<Elem>::pack(lo[0], lo[1]);
  a[1] = ptx::ElemTraits<Elem>::pack(lo[2], lo[3]);
  a[2] = ptx::ElemTraits<Elem>::pack(hi[0], hi[1]);
  a[3] = ptx::ElemTraits<Elem>::pack(hi[2], hi[3]);
}

// acc (16 x kCols) += a (16 x 16) * tile[k0 : k0 + 16, col0 : col0 + kCols], where the
// shared tile is row-major in k (Q, dO, K as stored): ldmatrix.trans makes it the B operand.
// `frag` is the lane's part of the address (lane_rows_first below); k0 and col0 are
// compile-time after unrolling wherever the head dim is unsplit, so each ldmatrix costs
// at most one LOP3 and an immediate (ptx.cuh, SwizzledTile).
template <class Tile, int kCols, typename Elem>
__device__ __forceinline__ void mma_a_tile(float (&acc)[kCols / 8][4], const uint32_t (&a)[4],
                                           uint32_t tile, uint32_t frag, int k0, int col0) {
#pragma unroll
  for (int dp = 0; dp < kCols / 16; ++dp) {
    const int chunk = col0 / 8 + dp * 2;
    uint32_t b[4];
    ptx::ldmatrix_x4_trans(b, tile + ((frag ^ Tile::chunk_xor(chunk)) + Tile::fixed(k0, chunk)));
    ptx::mma_16816<Elem>(acc[2 * dp][0], acc[2 * dp][1], acc[2 * dp][2], acc[2 * dp][3], a, b[0], b[1]);
    ptx::mma_16816<Elem>(acc[2 * dp + 1][0], acc[2 * dp + 1][1], acc[2 * dp + 1][2],
                         acc[2 * dp + 1][3], a, b[2], b[3]);
  }
}

// Lane parts of the two ldmatrix.x4 address patterns over a 16 x 16 block (row r0 + lane
// bits, 16-byte chunk c0 + lane bit; ptx.cuh, SwizzledTile::lane):
//   rows first: matrices (rows 0-7, chunk 0), (rows 8-15, chunk 0), (0-7, 1), (8-15, 1):
//     the A operand of a row-major tile (K, V for S^T, dP^T), and the B operand of a
//     tile row-major in k through .trans (mma_a_tile);
//   chunks first: (rows 0-7, chunk 0), (0-7, 1), (8-15, 0), (8-15, 1): the B operand of a
//     tile row-major in n (Q, dO for S^T, dP^T), and dS^T through .trans as the A of dQ.
template <class Tile>
__device__ __forceinline__ uint32_t lane_rows_first(int lane) {
  return Tile::lane(lane % 16, lane / 16);
}
template <class Tile>
__device__ __forceinline__ uint32_t lane_chunks_first(int lane) {
  return Tile::lane((lane / 16) * 8 + lane % 8, (lane / 8) % 2);
}

// ---- the pieces of a query-block step both backward kernels run (bwd_kernel, and
// bwd_wide_kernel in bwd_wide_kernel.cuh) ----------------------------------------------

// Q, dO (kBlockM rows from m0 of `head`), LSE and delta of a step into `stage`, all by cp.async
// (rows past the sequence zero-filled: the masked path never reads them). The LSE comes from the
// workspace copy in log2 units that bwd_preprocess wrote, next to delta: with plain loads of the
// caller's LSE and the conversion here, the warps that staged these rows waited on global memory
// at the top of every step (ncu: long_scoreboard stalls), and a second address computation cost
// spills.
template <class Cfg, typename Elem>
__device__ __forceinline__ void bwd_load_step(const BwdArgs& args, uint32_t smem, int stage, int batch, int head,
                                              int m0, const SeqBounds& s, int headdim) {
  using QTile = typename Cfg::QTile;
  constexpr int kBlockM = Cfg::kBlockM;
  const PortattnFwdParams& f = args.p.fwd;
  const Elem* gQ = static_cast<const Elem*>(f.q) + batch * f.q_strides.batch_stride +
                   static_cast<int64_t>(s.q_start + m0) * f.q_strides.row_stride + head * f.q_strides.head_stride;
  const Elem* gDo = static_cast<const Elem*>(args.p.dout) + batch * args.p.dout_strides.batch_stride +
                    static_cast<int64_t>(s.q_start + m0) * args.p.dout_strides.row_stride +
                    head * args.p.dout_strides.head_stride;
  bwd_load_tile<QTile, kBlockM, Cfg::kHeadDim, Cfg::kThreads>(smem + Cfg::kOffQ + stage * QTile::kBytes, gQ,
                                                               f.q_strides.row_stride, s.len_q - m0, headdim);
  bwd_load_tile<QTile, kBlockM, Cfg::kHeadDim, Cfg::kThreads>(smem + Cfg::kOffDo + stage * QTile::kBytes, gDo,
                                                               args.p.dout_strides.row_stride, s.len_q - m0, headdim);
  const int r = threadIdx.x;  // kBlockM <= kThreads (both configs assert it)
  if (r < kBlockM) {
    const bool valid = m0 + r < s.len_q;
    const int64_t ws = ws_row(args, batch, head, m0) + (valid ? r : 0);
    ptx::cp_async_4(smem + Cfg::kOffLse + (stage * kBlockM + r) * 4, args.lse2 + ws, valid);
    ptx::cp_async_4(smem + Cfg::kOffDelta + (stage * kBlockM + r) * 4, args.delta + ws, valid);
  }
  ptx::cp_async_commit();
}

// S^T = K Q^T and dP^T = V dO^T for one warp: kMt row tiles of 16 keys (kv_rows: the lane part of
// the first's rows) x kCols queries (q_chunks: the lane part of its first query), contracted over
// the head dim; each B fragment of Q / dO is loaded once for the kMt tiles.
template <class KVTile, class QTile, int kHeadDim, int kMt, int kCols, typename Elem>
__device__ __forceinline__ void bwd_st_dpt_rows(float (&acc_s)[kMt][kCols / 8][4], float (&acc_dp)[kMt][kCols / 8][4],
                                                uint32_t sK, uint32_t sV, uint32_t sQ, uint32_t sDo, uint32_t kv_rows,
                                                uint32_t q_chunks) {
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
    for (int t = 0; t < kCols / 8; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_s[mt][t][e] = acc_dp[mt][t][e] = 0.f;
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
    uint32_t a_k[kMt][4], a_v[kMt][4];
    const uint32_t a_lane = kv_rows ^ KVTile::chunk_xor(kk * 2);
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt) {
      ptx::ldmatrix_x4(a_k[mt], sK + (a_lane + KVTile::fixed(mt * 16, kk * 2)));
      ptx::ldmatrix_x4(a_v[mt], sV + (a_lane + KVTile::fixed(mt * 16, kk * 2)));
    }
    const uint32_t b_lane = q_chunks ^ QTile::chunk_xor(kk * 2);
#pragma unroll
    for (int np = 0; np < kCols / 16; ++np) {
      uint32_t b[4];
      ptx::ldmatrix_x4(b, sQ + (b_lane + QTile::fixed(np * 16, kk * 2)));
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) {
        ptx::mma_16816<Elem>(acc_s[mt][2 * np][0], acc_s[mt][2 * np][1], acc_s[mt][2 * np][2], acc_s[mt][2 * np][3],
                             a_k[mt], b[0], b[1]);
        ptx::mma_16816<Elem>(acc_s[mt][2 * np + 1][0], acc_s[mt][2 * np + 1][1], acc_s[mt][2 * np + 1][2],
                             acc_s[mt][2 * np + 1][3], a_k[mt], b[2], b[3]);
      }
      ptx::ldmatrix_x4(b, sDo + (b_lane + QTile::fixed(np * 16, kk * 2)));
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) {
        ptx::mma_16816<Elem>(acc_dp[mt][2 * np][0], acc_dp[mt][2 * np][1], acc_dp[mt][2 * np][2],
                             acc_dp[mt][2 * np][3], a_v[mt], b[0], b[1]);
        ptx::mma_16816<Elem>(acc_dp[mt][2 * np + 1][0], acc_dp[mt][2 * np + 1][1], acc_dp[mt][2 * np + 1][2],
                             acc_dp[mt][2 * np + 1][3], a_v[mt], b[2], b[3]);
      }
    }
  }
}

// The per-element constants of P and dS, set once per kernel.
struct BwdPointwise {
  float scale_log2, softcap, inv_softcap, keep_scale;
  uint32_t threshold;
  uint64_t philox_seed, philox_offset;
};

template <bool kExtras>
__device__ __forceinline__ BwdPointwise bwd_pointwise(const PortattnFwdParams& f) {
  BwdPointwise pw;
  pw.scale_log2 = f.softmax_scale * softmax::kLog2e;
  pw.softcap = f.softcap;
  pw.inv_softcap = pw.softcap > 0.f ? 1.f / pw.softcap : 0.f;
  pw.keep_scale = f.dropout_p > 0.f ? 1.f / (1.f - f.dropout_p) : 1.f;
  pw.threshold = f.dropout_p > 0.f ? dropout_threshold(f.dropout_p) : 0u;
  pw.philox_seed = kExtras && pw.threshold != 0u ? philox_seed_of(f) : 0;
  pw.philox_offset = kExtras && pw.threshold != 0u ? philox_offset_of(f) : 0;
  return pw;
}

// P^T (dropped, for dV) into acc_s and dS^T into acc_dp, in place, for a warp's S^T / dP^T
// fragments: this thread's keys key0 and key0 + 8, its queries m0 + col0 + t * 8 + q2 (+1);
// lse2 / delta are the step's rows in shared memory. Same float operations as the forward
// (fwd_kernel.cuh), so P matches the saved LSE as closely as possible.
template <bool kExtras, int kTiles>
__device__ __forceinline__ void bwd_p_ds(float (&acc_s)[kTiles][4], float (&acc_dp)[kTiles][4],
                                         const PortattnFwdParams& f, const BwdPointwise& pw, const MaskRule& rule,
                                         bool needs_mask, int batch, int head, int m0, int col0, int key0, int q2,
                                         const float* lse2, const float* delta) {
  if (!kExtras && !needs_mask) {
#pragma unroll
    for (int t = 0; t < kTiles; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = col0 + t * 8 + q2 + (e & 1);
        const float prob = softmax::exp2_fast(acc_s[t][e] * pw.scale_log2 - lse2[c]);
        acc_s[t][e] = prob;
        acc_dp[t][e] = prob * (acc_dp[t][e] - delta[c]);
      }
    return;
  }
  const float alibi_slope =
      kExtras && f.alibi_slopes != nullptr ? f.alibi_slopes[batch * f.alibi_batch_stride + head] : 0.f;
  const int bh = batch * f.nheads + head;
#pragma unroll
  for (int t = 0; t < kTiles; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int c = col0 + t * 8 + q2 + (e & 1);
      const int i = m0 + c;
      const int j = key0 + (e / 2) * 8;
      float x = acc_s[t][e] * f.softmax_scale;
      float tanh_x = 0.f;
      if (kExtras && pw.softcap > 0.f) {
        tanh_x = tanhf(x * pw.inv_softcap);
        x = pw.softcap * tanh_x;
      }
      if (kExtras) x -= alibi_slope * fabsf(static_cast<float>(i + rule.diag - j));
      bool visible = true;
      if (needs_mask) visible = rule.visible(i, j);
      const float prob = visible ? softmax::exp2_fast(x * softmax::kLog2e - lse2[c]) : 0.f;
      float dprob = acc_dp[t][e];
      float kept = prob;
      if (kExtras && pw.threshold != 0u) {
        const Philox4 rnd = dropout_random4(pw.philox_seed, pw.philox_offset, bh, i, j & ~3);
        // Selects, not an indexed array: a run-time index would put it in local memory.
        const uint32_t r = (j & 2) ? ((j & 1) ? rnd.w : rnd.z) : ((j & 1) ? rnd.y : rnd.x);
        const bool keep = r >= pw.threshold;
        kept = keep ? prob * pw.keep_scale : 0.f;
        dprob = keep ? dprob * pw.keep_scale : 0.f;
      }
      float ds = prob * (dprob - delta[c]);
      if (kExtras && pw.softcap > 0.f) ds *= 1.f - tanh_x * tanh_x;
      acc_s[t][e] = kept;
      acc_dp[t][e] = ds;
    }
}

// kExtras: softcap, ALiBi or dropout present (their per-element work and
// registers stay out of the common path, as in the forward). `deterministic`
// is a runtime flag (uniform per launch): it changes the grid mapping, not
// the math, so it costs no extra instantiation.
template <class Cfg, typename Elem, bool kExtras>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kTwoCtasPerSm && !kExtras ? 2 : 1) bwd_kernel(const BwdArgs args) {
  constexpr int kHeadDim = Cfg::kHeadDim;
  constexpr int kBlockN = Cfg::kBlockN;
  constexpr int kBlockM = Cfg::kBlockM;
  constexpr int kStages = Cfg::kStages;
  constexpr int kWarps = Cfg::kWarps;
  constexpr int kThreads = Cfg::kThreads;
  constexpr int kDOut = Cfg::kDOut;
  constexpr int kDqChunk = Cfg::kDqChunk;
  constexpr int kDqRows = Cfg::kDqRows;
  constexpr int kSTiles = kBlockM / 8;  // n8 tiles of S^T per warp (16 keys x kBlockM queries)
  constexpr int kOTiles = kDOut / 8;    // n8 tiles of the dK/dV rows per warp
  using KVTile = typename Cfg::KVTile;
  using QTile = typename Cfg::QTile;
  using DsTile = typename Cfg::DsTile;

  const PortattnBwdParams& p = args.p;
  const PortattnFwdParams& f = p.fwd;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t smem = ptx::smem_addr(smem_raw);
  const uint32_t sK = smem + Cfg::kOffK;
  const uint32_t sV = smem + Cfg::kOffV;
  const uint32_t sDs = smem + Cfg::kOffDs;
  float* sLse = reinterpret_cast<float*>(smem_raw + Cfg::kOffLse);
  float* sDelta = reinterpret_cast<float*>(smem_raw + Cfg::kOffDelta);

  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int g = lane / 4;        // fragment row within an m16 tile (and +8)
  const int q2 = 2 * (lane % 4);  // fragment column pair within an n8 tile
  const int half = blockIdx.z % Cfg::kDSplit;
  const int batch = blockIdx.z / Cfg::kDSplit;
  // First dK/dV/dQ column of this CTA; a compile-time 0 when the head dim is not split, so
  // every shared-memory address below folds to a register and an immediate.
  const int col_base = Cfg::kDSplit == 1 ? 0 : half * kDOut;
  const bool det = p.deterministic != 0;
  const int group = f.nheads / f.nheads_k;
  const BwdHeads cta_heads = bwd_heads(args, det, group);
  const int head_k = cta_heads.head_k;
  const int head_first = cta_heads.head_first;
  const int heads = cta_heads.heads;
  const bool gqa_atomic = !det && group > 1;

  const SeqBounds s = seq_bounds(f, batch);  // clamped to the tensors (seq_bounds.h)
  const int n_blocks = (s.len_k + kBlockN - 1) / kBlockN;
  const MaskRule rule = MaskRule::of(s, f.window_left, f.window_right);  // block_range.h
  const int headdim = f.headdim;

  const BwdPointwise pw = bwd_pointwise<kExtras>(f);

  const Elem* gK = static_cast<const Elem*>(f.k) + batch * f.k_strides.batch_stride +
                   static_cast<int64_t>(s.k_start) * f.k_strides.row_stride +
                   head_k * f.k_strides.head_stride;
  const Elem* gV = static_cast<const Elem*>(f.v) + batch * f.v_strides.batch_stride +
                   static_cast<int64_t>(s.k_start) * f.v_strides.row_stride +
                   head_k * f.v_strides.head_stride;

  // Lane parts of the shared-memory addresses (lane_rows_first / lane_chunks_first):
  // computed once, so that each ldmatrix in the unrolled loops costs at most a LOP3.
  const uint32_t kv_rows = lane_rows_first<KVTile>(lane) + warp * 16 * KVTile::kPanelRowBytes;  // this warp's keys
  const uint32_t kv_t = lane_rows_first<KVTile>(lane);
  const uint32_t q_rows = lane_rows_first<QTile>(lane);
  const uint32_t q_chunks = lane_chunks_first<QTile>(lane);
  const uint32_t ds_chunks = lane_chunks_first<DsTile>(lane);
  // dS^T stores: this thread's row (warp * 16 + g) at column halves 0 and 8, plus its
  // column pair's byte offset (bits below the 16-byte chunk, untouched by the swizzle).
  const uint32_t ds_store[2] = {DsTile::lane(warp * 16 + g, 0) + q2 * 2, DsTile::lane(warp * 16 + g, 1) + q2 * 2};

  const int n_first = blockIdx.x;
  const int n_step = det ? args.splits : n_blocks;  // default: one key block per CTA
  float* dq_slice = args.dq_accum + (det ? blockIdx.x * args.dq_slice : 0);

  for (int n_block = n_first; n_block < n_blocks; n_block += n_step) {
    const int n0 = n_block * kBlockN;
    const int n_valid = min(kBlockN, s.len_k - n0);
    // The query blocks that see any key of this block.
    const IndexRange query_blocks = MaskRule::blocks_of(rule.query_range(n0, n0 + n_valid - 1), kBlockM);
    const int m_begin = query_blocks.begin;
    const int m_blocks = query_blocks.size();
    const int iters = heads * m_blocks;

    // Q/dO/LSE/delta of step `it` (head head_first + it / m_blocks) into `stage`.
    auto load_step = [&](int it, int stage) {
      const int head = heads == 1 ? head_first : head_first + it / m_blocks;
      const int m0 = (m_begin + (heads == 1 ? it : it % m_blocks)) * kBlockM;
      bwd_load_step<Cfg, Elem>(args, smem, stage, batch, head, m0, s, headdim);
    };

    // K and V only for a block some query sees. A block no query sees (its
    // window range is empty) must not issue them: nothing below would wait for
    // those copies, and in the deterministic mode the CTA's next key block
    // reuses sK/sV. cp.async copies are unordered until a wait, so the
    // unwaited copies of the empty block could land after the next block's
    // and leave it computing with the wrong keys/values (issue 12 item 7:
    // dQ/dK/dV differing between reruns depending on cache state). The
    // epilogue writes that block's zero dK/dV without reading K or V.
    if (iters > 0) {
      bwd_load_tile<KVTile, kBlockN, kHeadDim, kThreads>(sK, gK + n0 * f.k_strides.row_stride,
                                                         f.k_strides.row_stride, n_valid, headdim);
      bwd_load_tile<KVTile, kBlockN, kHeadDim, kThreads>(sV, gV + n0 * f.v_strides.row_stride,
                                                         f.v_strides.row_stride, n_valid, headdim);
      ptx::cp_async_commit();
      load_step(0, 0);
    }

    float acc_dk[kOTiles][4], acc_dv[kOTiles][4];
#pragma unroll
    for (int t = 0; t < kOTiles; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_dk[t][e] = acc_dv[t][e] = 0.f;

    for (int it = 0; it < iters; ++it) {
      const int stage = kStages == 2 ? it % 2 : 0;
      const int head = heads == 1 ? head_first : head_first + it / m_blocks;
      const int m0 = (m_begin + (heads == 1 ? it : it % m_blocks)) * kBlockM;
      const uint32_t sQ = smem + Cfg::kOffQ + stage * QTile::kBytes;
      const uint32_t sDo = smem + Cfg::kOffDo + stage * QTile::kBytes;
      const float* lse2 = sLse + stage * kBlockM;
      const float* delta = sDelta + stage * kBlockM;

      ptx::cp_async_wait<0>();
      __syncthreads();  // this step's tiles visible; every warp is done with the previous step
      if (kStages == 2 && it + 1 < iters) load_step(it + 1, (it + 1) % 2);

      // ---- S^T = K Q^T and dP^T = V dO^T (this warp: 16 keys x kBlockM queries)
      float acc_s[kSTiles][4], acc_dp[kSTiles][4];
      using SRows = float[1][kSTiles][4];  // one row tile: this warp's 16 keys
      bwd_st_dpt_rows<KVTile, QTile, kHeadDim, 1, kBlockM, Elem>(reinterpret_cast<SRows&>(acc_s),
                                                                 reinterpret_cast<SRows&>(acc_dp), sK, sV, sQ, sDo,
                                                                 kv_rows, q_chunks);

      // ---- P^T (dropped, for dV) into acc_s and dS^T into acc_dp -------------
      const bool needs_mask =
          m0 + kBlockM > s.len_q || !rule.tile_fully_visible(m0, m0 + kBlockM - 1, n0, n0 + kBlockN - 1);
      const int key0 = n0 + warp * 16 + g;  // this thread's keys: key0 and key0 + 8
      bwd_p_ds<kExtras, kSTiles>(acc_s, acc_dp, f, pw, rule, needs_mask, batch, head, m0, 0, key0, q2, lse2, delta);

      // ---- dV += P^T dO ; dS^T -> shared ; dK += dS^T Q ------------------------
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk) {
        uint32_t a[4];
        pack_a<Elem>(a, acc_s[2 * kk], acc_s[2 * kk + 1]);
        mma_a_tile<QTile, kDOut, Elem>(acc_dv, a, sDo, q_rows, kk * 16, col_base);
      }
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk) {
        uint32_t a[4];
        pack_a<Elem>(a, acc_dp[2 * kk], acc_dp[2 * kk + 1]);
        // a[0..3] = rows (g, g + 8) x column halves (0, 8) of this warp's 16 x 16 block.
        const uint32_t lo = sDs + ((ds_store[0] ^ DsTile::chunk_xor(kk * 2)) + DsTile::fixed(0, kk * 2));
        const uint32_t hi = sDs + ((ds_store[1] ^ DsTile::chunk_xor(kk * 2)) + DsTile::fixed(0, kk * 2));
        st_shared_b32(lo, a[0]);
        st_shared_b32(lo + 8 * DsTile::kPanelRowBytes, a[1]);
        st_shared_b32(hi, a[2]);
        st_shared_b32(hi + 8 * DsTile::kPanelRowBytes, a[3]);
        mma_a_tile<QTile, kDOut, Elem>(acc_dk, a, sQ, q_rows, kk * 16, col_base);
      }

      __syncthreads();  // dS^T complete; every warp is done reading Q, dO, LSE, delta of this step
      if (kStages == 1 && it + 1 < iters) load_step(it + 1, 0);

      // ---- dQ += dS K (kBlockM x kDOut, in kDqRows x kDqChunk tiles over the warps)
      // Each warp loads all of a key step's fragments before its MMAs, and a tile has
      // (kDqRows / 16) x (kDqChunk / 8) independent accumulators, so consecutive MMAs
      // rarely wait on each other (ncu: "wait" was the second stall reason with 16-row tiles).
      constexpr int kRowTiles = kDqRows / 16;
      constexpr int kTilesM = kBlockM / kDqRows;
      constexpr int kTiles = kTilesM * (kDOut / kDqChunk);
      // Pitch headdim: args.acc_head_dim is f.headdim on this path (run_bwd), kept out of the
      // kernel so its registers stay as measured.
      const int64_t dq_row0 = ws_row(args, batch, head, m0);
      // Interior tiles (all rows inside the sequence, the head dim unpadded) add without bounds
      // tests; the boundary ones test each row and column. dq_row0 is a multiple of 8 (ws_rows is,
      // and so is m0), as the interior path needs (Note [portattn sm80 blocked dQ]).
      const bool dq_interior = m0 + kBlockM <= s.len_q && headdim == kHeadDim;
      for (int tile = warp; tile < kTiles; tile += kWarps) {
        const int tm = tile % kTilesM;
        const int col0 = col_base + (tile / kTilesM) * kDqChunk;
        float acc[kRowTiles][kDqChunk / 8][4];
#pragma unroll
        for (int r = 0; r < kRowTiles; ++r)
#pragma unroll
          for (int t = 0; t < kDqChunk / 8; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[r][t][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) {
          uint32_t a[kRowTiles][4];
#pragma unroll
          for (int r = 0; r < kRowTiles; ++r) {
            const int chunk = (tm * kRowTiles + r) * 2;  // dS^T columns are query rows
            ptx::ldmatrix_x4_trans(a[r], sDs + ((ds_chunks ^ DsTile::chunk_xor(chunk)) + DsTile::fixed(kk * 16, chunk)));
          }
#pragma unroll
          for (int r = 0; r < kRowTiles; ++r) mma_a_tile<KVTile, kDqChunk, Elem>(acc[r], a[r], sK, kv_t, kk * 16, col0);
        }
        dq_tile_add<kHeadDim, kRowTiles, kDqChunk / 8>(dq_slice, dq_row0, acc, tm, col0, g, q2, dq_interior, headdim,
                                                       s.len_q - m0);
      }
    }

    // ---- epilogue: dK (scaled) and dV of this warp's 16 keys -------------------
    const int key_row = warp * 16 + g;  // and key_row + 8
    if (gqa_atomic) {
      const int64_t stride = static_cast<int64_t>(args.heads_k) * headdim;
      const int64_t base = (static_cast<int64_t>(batch) * f.seqlen_k + n0) * stride +
                           static_cast<int64_t>(head_k - args.head0 / group) * headdim;
#pragma unroll
      for (int t = 0; t < kOTiles; ++t) {
        const int col = col_base + t * 8 + q2;
        if (col >= headdim) continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = key_row + h * 8;
          if (r >= n_valid) continue;
          const int64_t off = base + r * stride + col;
          accum_add2(args.dk_accum + off, acc_dk[t][2 * h] * f.softmax_scale,
                     acc_dk[t][2 * h + 1] * f.softmax_scale);
          accum_add2(args.dv_accum + off, acc_dv[t][2 * h], acc_dv[t][2 * h + 1]);
        }
      }
    } else {
      Elem* gDk = static_cast<Elem*>(p.dk) + batch * p.dk_strides.batch_stride +
                  static_cast<int64_t>(s.k_start + n0) * p.dk_strides.row_stride +
                  head_k * p.dk_strides.head_stride;
      Elem* gDv = static_cast<Elem*>(p.dv) + batch * p.dv_strides.batch_stride +
                  static_cast<int64_t>(s.k_start + n0) * p.dv_strides.row_stride +
                  head_k * p.dv_strides.head_stride;
#pragma unroll
      for (int t = 0; t < kOTiles; ++t) {
        const int col = col_base + t * 8 + q2;
        if (col >= headdim) continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = key_row + h * 8;
          if (r >= n_valid) continue;
          *reinterpret_cast<uint32_t*>(gDk + r * p.dk_strides.row_stride + col) =
              ptx::ElemTraits<Elem>::pack(acc_dk[t][2 * h] * f.softmax_scale,
                                          acc_dk[t][2 * h + 1] * f.softmax_scale);
          *reinterpret_cast<uint32_t*>(gDv + r * p.dv_strides.row_stride + col) =
              ptx::ElemTraits<Elem>::pack(acc_dv[t][2 * h], acc_dv[t][2 * h + 1]);
        }
      }
    }
    // Invariant: no cp.async of this block is still in flight here (the last
    // step waited for all, an empty block issued none); the wait makes that
    // hold by construction (a no-op in the common case, once per key block).
    ptx::cp_async_wait<0>();
    __syncthreads();  // every warp is done with K/V before the next key block overwrites them
  }
}

// ---- 3. converts ------------------------------------------------------------------

// dq[b, i, h, :] = scale * sum over slices of dq_accum (slice order fixed).
// One thread per 8 columns of one (b, i, h) row.
template <typename Elem>
__global__ void __launch_bounds__(256) bwd_convert_dq(const BwdArgs args, int slices) {
  const PortattnFwdParams& f = args.p.fwd;
  const int chunks = f.headdim / 8;
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int batch = blockIdx.y;
  const int chunk = index % chunks;
  const int64_t rest = index / chunks;
  const int head = args.head0 + static_cast<int>(rest % args.heads);
  const int i = static_cast<int>(rest / args.heads);
  const SeqBounds s = seq_bounds(f, batch);  // clamped to the tensors (seq_bounds.h)
  if (i >= s.len_q) return;
  const int64_t row = ws_row(args, batch, head, i);
  const float* src = args.dq_accum + (args.dq_blocked ? dq_blocked_offset(row, chunk * 8, args.acc_head_dim)
                                                      : row * args.acc_head_dim);
  // This thread's two 16-byte chunks (swizzled in the Hopper bulk mode). A padded row
  // (acc_head_dim > f.headdim: 128 floats = 32 chunks at hd96) is read in its first
  // f.headdim / 4 chunks only: the swizzle XORs the chunk index with a key < 8, so it
  // maps each aligned group of 8 chunks onto itself, and a padded f.headdim is a multiple
  // of 32 floats = 8 chunks (run_hopper_bwd checks it): the chunks read hold exactly the
  // columns below f.headdim, never the padding's zeros.
  // Blocked (the sm80+ kernels, Note [portattn sm80 blocked dQ]): the chunk's 8 floats are
  // contiguous at src.
  const int lo_at = args.dq_blocked ? 0 : (args.dq_swizzled ? dq_chunk_swizzle(i, chunk * 32) : chunk * 32) / 4;
  const int hi_at = args.dq_blocked ? 4 : (args.dq_swizzled ? dq_chunk_swizzle(i, chunk * 32 + 16) : chunk * 32 + 16) / 4;
  float acc[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] = 0.f;
  for (int slice = 0; slice < slices; ++slice) {
    const float4 lo = *reinterpret_cast<const float4*>(src + slice * args.dq_slice + lo_at);
    const float4 hi = *reinterpret_cast<const float4*>(src + slice * args.dq_slice + hi_at);
    acc[0] += lo.x, acc[1] += lo.y, acc[2] += lo.z, acc[3] += lo.w;
    acc[4] += hi.x, acc[5] += hi.y, acc[6] += hi.z, acc[7] += hi.w;
  }
  const float scale = f.softmax_scale;
  uint4 out;
  out.x = ptx::ElemTraits<Elem>::pack(acc[0] * scale, acc[1] * scale);
  out.y = ptx::ElemTraits<Elem>::pack(acc[2] * scale, acc[3] * scale);
  out.z = ptx::ElemTraits<Elem>::pack(acc[4] * scale, acc[5] * scale);
  out.w = ptx::ElemTraits<Elem>::pack(acc[6] * scale, acc[7] * scale);
  Elem* dst = static_cast<Elem*>(args.p.dq) + batch * args.p.dq_strides.batch_stride +
              static_cast<int64_t>(s.q_start + i) * args.p.dq_strides.row_stride +
              head * args.p.dq_strides.head_stride + chunk * 8;
  *reinterpret_cast<uint4*>(dst) = out;
}

// GQA default mode: dk/dv[b, j, hk, :] from the fp32 accumulators (dK already
// carries the softmax scale).
template <typename Elem>
__global__ void __launch_bounds__(256) bwd_convert_dkv(const BwdArgs args) {
  const PortattnFwdParams& f = args.p.fwd;
  const int chunks = f.headdim / 8;
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int batch = blockIdx.y;
  const int chunk = index % chunks;
  const int64_t rest = index / chunks;
  const int local_k = static_cast<int>(rest % args.heads_k);
  const int head_k = args.head0 / (f.nheads / f.nheads_k) + local_k;
  const int j = static_cast<int>(rest / args.heads_k);
  const SeqBounds s = seq_bounds(f, batch);  // clamped to the tensors (seq_bounds.h)
  if (j >= s.len_k) return;
  const int64_t src = ((static_cast<int64_t>(batch) * f.seqlen_k + j) * args.heads_k + local_k) *
                          args.acc_head_dim + chunk * 8;
  const int64_t row = s.k_start + j;
  Elem* dk = static_cast<Elem*>(args.p.dk) + batch * args.p.dk_strides.batch_stride +
             row * args.p.dk_strides.row_stride + head_k * args.p.dk_strides.head_stride + chunk * 8;
  Elem* dv = static_cast<Elem*>(args.p.dv) + batch * args.p.dv_strides.batch_stride +
             row * args.p.dv_strides.row_stride + head_k * args.p.dv_strides.head_stride + chunk * 8;
  const float* accs[2] = {args.dk_accum + src, args.dv_accum + src};
  Elem* dsts[2] = {dk, dv};
#pragma unroll
  for (int which = 0; which < 2; ++which) {
    const float4 lo = *reinterpret_cast<const float4*>(accs[which]);
    const float4 hi = *reinterpret_cast<const float4*>(accs[which] + 4);
    uint4 out;
    out.x = ptx::ElemTraits<Elem>::pack(lo.x, lo.y);
    out.y = ptx::ElemTraits<Elem>::pack(lo.z, lo.w);
    out.z = ptx::ElemTraits<Elem>::pack(hi.x, hi.y);
    out.w = ptx::ElemTraits<Elem>::pack(hi.z, hi.w);
    *reinterpret_cast<uint4*>(dsts[which]) = out;
  }
}

}  // namespace cuda
}  // namespace portattn
