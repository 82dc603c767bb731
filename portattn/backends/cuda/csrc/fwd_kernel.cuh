// Forward attention kernel for sm80+ (mma.sync): one CTA computes a
// (kBlockM x head_dim) block of O for one (batch, head), streaming K and V in
// (kBlockN x head_dim) blocks through shared memory.
//
// Tile configuration (FwdTileConfig below; registers/spills from ptxas -v are
// in docs/kernels-sm80.md):
//   head dim <= 128: 4 warps, each owning 32 query rows (two m16 tiles), so one
//     K/V fragment read from shared memory feeds two mma's (shared-memory
//     bandwidth, not the tensor cores, is the limit with 16 rows per warp).
//     kBlockN = 128 for head dim <= 64, else 64 (S and O must fit in 255 regs;
//     sm_90: 255 registers, no spills at 96/128, 60-68 B at 32/64).
//   head dim > 128: 8 warps of 16 rows: O alone is head_dim / 2 fp32 registers.
//     The narrow shape's 64 x 64 tile with 4 warps of 16 rows (the same registers
//     a thread, half the rows a CTA) runs instead where two of its CTAs fit an SM
//     and it measured faster (Note [portattn sm80 narrow tiles above 128] in
//     fwd_launch.cuh), and where the 128-row tile does not fit the shared-memory
//     budget (head dims 224/256 on the 99 KiB parts; FwdConfigsFor below; Note
//     [portattn smem budget] in smem_budget.h).
//   Short sequences at head dim <= 64: 64 x 64 tiles, four CTAs an SM (Note
//   [portattn sm80 narrow tiles]; fwd_launch.cuh decides when).
//   The online softmax rescales O lazily (Note [portattn lazy rescale] in
//   online_softmax.h); with the FMNMX row max and no spill it gains
//   2-5% on the H100 (docs/kernels-sm80.md).
//   Shared memory: Q (kBlockM x D) + K (kBlockN x D) + V (kBlockN x D), bf16/fp16,
//   XOR-swizzled (ptx.cuh: SwizzledTile): 64 KB at D=128, 128 KB at D=256.
//
// Pipeline per key block n (blocks run from the last to the first, so the
// blocks that need masking come first and the steady state is branch-free;
// the narrow shape issues the first block's V with Q and K instead):
//     wait K(n); sync; issue V(n)            (V(n) streams in during S = Q K(n)^T)
//     S = Q K(n)^T
//     wait V(n); sync; issue K(n-1)          (K(n-1) streams in during softmax + P V)
//     mask/extras, online softmax, dropout, O += P V(n)
// P never leaves registers: the fp32 S accumulators of two n8 tiles are exactly
// the A fragment of the P*V mma once packed to 16 bits.
//
// Template parameters are only what changes the code's speed: the padded head
// dim, the element type, and kExtras (softcap, ALiBi or dropout present).
// Masking (sequence tails, causal, window) is a uniform per-block runtime
// branch taken only on boundary blocks. A head dim below the instantiated one
// is served by zero-filling the tail columns of Q, K and V in shared memory.
#pragma once
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include <type_traits>

#include "../../common/block_range.h"
#include "../../common/online_softmax.h"
#include "../../common/params.h"
#include "../../common/philox.h"
#include "../../common/seq_bounds.h"
#include "ptx.cuh"
#include "smem_budget.h"

namespace portattn {
namespace cuda {

// Note [portattn sm80 narrow tiles]
// kNarrow: 64-row query blocks (one m16 tile per warp) and 64-key blocks, for
// many short sequences at head dims <= 128 (fwd_launch.cuh decides when).
// Why: batch 512 x seqlen 50-300 is latency-bound, not throughput-bound: a
// 128 x 128 tile of a 100-key sequence is mostly padding (one key block, as
// long at seqlen 50 as at 100: docs/kernels-sm80.md), and
// the wide shape's S (64-128 fp32 a thread) holds an SM at two CTAs, eight
// warps, to hide each tile's load -> S -> softmax -> P V -> store chain. The
// narrow shape needs a quarter of the registers for S, so four CTAs fit an
// SM (five at head dim 32), and a 50-row sequence computes a 64 x 64 tile
// instead of 128 x 128. Measurements: docs/kernels-sm80.md.
// It gives up what the wide shape is for (one K/V fragment read feeding two
// mma's): long sequences keep the wide shape.
// Above head dim 128 the narrow shape is a 64 x 64 tile of 4 warps (FlashAttention-2's
// choice for head dim 256 on sm86/sm89 and sm90): a thread holds what it holds in the
// 8-warp wide tile (16 rows, 64 keys), so its registers are the same. It runs where the
// wide tile does not fit (FwdConfigsFor), whatever the length, and where two of its CTAs
// fit an SM for the calls where that measured faster (fwd_launch.cuh).
template <int kHeadDim_, bool kNarrow_ = false>
struct FwdTileConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kNarrow = kNarrow_;
  static constexpr int kWarps = (kHeadDim <= 128 || kNarrow) ? 4 : 8;
  static constexpr int kMTiles = (kHeadDim <= 128 && !kNarrow) ? 2 : 1;  // m16 tiles per warp
  static constexpr int kBlockM = kWarps * kMTiles * 16;
  // Head dim 64 at kBlockN = 64 measures within noise of 128 on the H100
  // (faster from 2k keys on, slower below; docs/kernels-sm80.md).
  static constexpr int kBlockN = (kHeadDim <= 64 && !kNarrow) ? 128 : 64;
  static constexpr int kThreads = kWarps * 32;
  // Two CTAs per SM hide each other's barriers; the 8-warp configs need all
  // 255 registers per thread and fit one CTA only. The narrow shape asks for
  // five at head dim 32 (93-95 registers, 0 spills; 6 spills 16-20 B), four
  // at 64 (128 registers; five spill 52-72 B) and three at 96-128 (168, 0
  // spills): measured on an H100, five against four at hd16/32 +13-16% from
  // 100 rows (archive:2026-11-26-49058fb/summary.md), at hd64 -10% to +4%.
  // Above head dim 128 the narrow tile needs all 255 registers (O alone is 64-128) and
  // 84-96 KiB of shared memory: one CTA an SM.
  static constexpr int kMinBlocksPerSm =
      kNarrow ? (kHeadDim <= 32 ? 5 : kHeadDim <= 64 ? 4 : kHeadDim <= 128 ? 3 : 1) : (kWarps == 4 ? 2 : 1);
  // The first key block's V requested with Q and K (Note [portattn sm80 narrow tiles]):
  // for the short-sequence tiles only; the small-budget tiles run long sequences, where it
  // buys nothing and its addresses cost registers.
  static constexpr bool kEarlyV = kNarrow && kHeadDim <= 128;
  // Wholly in-bounds K/V/Q tiles skip the loader's predicates (TileLoader) in the 4-warp tiles
  // except the short-sequence ones: forward 1.04-1.06x at hd64, 1.01-1.05x at 96, 1.06-1.09x at
  // 128, and 1.02-1.08x for the 64 x 64 tile above 128 (H200, 512-16k); the 8-warp tiles measured
  // 1.00-1.01x at hd192 and 0.985-0.99x at hd256 with them, and keep the predicated loads.
  static constexpr bool kWholeTileLoads = kWarps == 4 && !kEarlyV;
  // Q + K + V, 16-bit elements (FwdKernelTraits checks it against its tiles).
  static constexpr int kSmemBytes = (kBlockM + 2 * kBlockN) * kHeadDim * 2;
  static_assert(kHeadDim % 32 == 0 && kHeadDim <= 256, "instantiated head dims are multiples of 32");
  static_assert(kBlockN / 4 <= 32, "dropout keep bits of one row fit one 32-bit word");
};

template <int kHeadDim, typename Elem, bool kNarrow = false>
struct FwdKernelTraits : FwdTileConfig<kHeadDim, kNarrow> {
  using Config = FwdTileConfig<kHeadDim, kNarrow>;
  using QTile = ptx::SwizzledTile<Config::kBlockM, kHeadDim>;
  using KVTile = ptx::SwizzledTile<Config::kBlockN, kHeadDim>;
  static constexpr int kSmemBytes = QTile::kBytes + 2 * KVTile::kBytes;
  static_assert(kSmemBytes == Config::kSmemBytes, "the candidates' budget is the kernel's");
  // Per-thread register tiles: two rows (g, g + 8) per m16 tile; two columns
  // per n8 tile.
  static constexpr int kRows = Config::kMTiles * 2;
  static constexpr int kSCols = Config::kBlockN / 4;
  static constexpr int kOCols = kHeadDim / 4;
};

// The forward's tile candidates per head dim, fastest first (with_first_fitting in
// smem_budget.h picks by the budget; the short-sequence choice of the narrow shape at head
// dims <= 128 is narrow_pays' in fwd_launch.cuh, not a budget matter, and above 128
// narrow_pays_above_128 runs the narrow tile first where two CTAs of it fit an SM). Shared
// memory (bytes, Q + K + V):
//   hd 32-128  wide 128 x 128 / 128 x 64, 4 warps      24-64 KiB   every sm80+ part
//   hd 160     wide 128 x 64, 8 warps                  80 KiB      every sm80+ part
//   hd 192     wide 128 x 64, 8 warps                  96 KiB      every sm80+ part
//   hd 224     wide 128 x 64, 8 warps / narrow 64 x 64, 4 warps   112 / 84 KiB
//   hd 256     wide 128 x 64, 8 warps / narrow 64 x 64, 4 warps   128 / 96 KiB
// so the 99 KiB parts (sm86, sm89, sm120) run the narrow tile at 224 and 256, A100 (163 KiB)
// and H100 (227 KiB) the wide one when narrow_pays_above_128 does not pick the narrow one
// (narrow 64 x 64 at 160 / 192: 60 / 72 KiB).
template <int kHeadDim>
struct FwdConfigsFor {
  static constexpr bool kHasNarrow = kHeadDim > 192;
  using type = typename std::conditional<
      kHasNarrow, TileCandidates<FwdTileConfig<kHeadDim, false>, FwdTileConfig<kHeadDim, true>>,
      TileCandidates<FwdTileConfig<kHeadDim, false>>>::type;
};

// acc[2 mt .. 2 mt + 1][4 n16 .. 4 n16 + 3] += A(mt) * B, for the two n8 tiles
// of one 16-column block (b[0..1]: first n8 tile, b[2..3]: second); the
// register layout is the (row, column-pair) one documented in ptx.cuh.
template <typename Elem, int kRows, int kCols>
__device__ __forceinline__ void mma_m16n16(float (&acc)[kRows][kCols], int mt, int n16,
                                           const uint32_t (&a)[4], const uint32_t (&b)[4]) {
  ptx::mma_16816<Elem>(acc[2 * mt][4 * n16], acc[2 * mt][4 * n16 + 1], acc[2 * mt + 1][4 * n16],
                       acc[2 * mt + 1][4 * n16 + 1], a, b[0], b[1]);
  ptx::mma_16816<Elem>(acc[2 * mt][4 * n16 + 2], acc[2 * mt][4 * n16 + 3],
                       acc[2 * mt + 1][4 * n16 + 2], acc[2 * mt + 1][4 * n16 + 3], a, b[2], b[3]);
}

struct QuadReduce {
  static __device__ __forceinline__ float max(float x) { return ptx::quad_allreduce_max(x); }
  static __device__ __forceinline__ float sum(float x) { return ptx::quad_allreduce_sum(x); }
  static __device__ __forceinline__ bool any(bool x) { return __any_sync(0xffffffffu, x) != 0; }
};

constexpr int next_pow2(int x) { return x <= 1 ? 1 : 2 * next_pow2((x + 1) / 2); }

// Global -> shared copies of one tile with cp.async, 16 bytes per thread and
// step. Threads are laid out over a power-of-two number of chunks per row
// (head dims 96/160/224 leave some threads idle) so that each step covers a
// multiple of 8 rows: the swizzle bits of a thread then never change, and
// the shared-memory address advances by a constant. Where a row has more
// chunks than a step's lanes can take at 8 rows a step (head dims 224/256 with
// 4 warps), each thread also steps across the row by whole swizzle panels,
// which again moves its shared-memory address by a constant.
// kWholeTilePath: tiles wholly in bounds take an unpredicated path (load() below;
// FwdTileConfig::kWholeTileLoads says where).
template <class Tile, int kThreads, bool kWholeTilePath = true>
struct TileLoader {
  static constexpr int kLanesPerRow =
      next_pow2(Tile::kChunksPerRow) < kThreads / 8 ? next_pow2(Tile::kChunksPerRow) : kThreads / 8;
  static constexpr int kRowsPerStep = kThreads / kLanesPerRow;
  static constexpr int kRows = Tile::kChunks / Tile::kChunksPerRow;
  static constexpr int kSteps = kRows / kRowsPerStep;
  static constexpr int kColSteps = (Tile::kChunksPerRow + kLanesPerRow - 1) / kLanesPerRow;
  static constexpr int kColStepElems = kLanesPerRow * 8;
  static_assert(kRowsPerStep % 8 == 0 && kRows % kRowsPerStep == 0, "loader layout");
  static_assert(kColSteps == 1 || kColStepElems % Tile::kPanel == 0, "column steps are whole panels");
  // Shared-memory distance of one column step: whole panels, each kRows rows of one panel row.
  static constexpr uint32_t kColStepBytes =
      static_cast<uint32_t>(kColStepElems / Tile::kPanel) * kRows * Tile::kPanelRowBytes;

  int row0, col;
  uint32_t smem_lane;

  __device__ __forceinline__ explicit TileLoader(int tid)
      : row0(tid / kLanesPerRow), col((tid % kLanesPerRow) * 8) {
    smem_lane = col < Tile::kChunksPerRow * 8 ? Tile::offset(row0, col) : 0u;
  }

  // Rows >= valid_rows and columns >= headdim are zero-filled (those lanes
  // read nothing; they pass `base`, which is in bounds).
  template <typename Elem>
  __device__ __forceinline__ void load(uint32_t smem, const Elem* base, int64_t row_stride,
                                       int valid_rows, int headdim) const {
    if (col >= Tile::kChunksPerRow * 8) return;
    // 32-bit step offsets (the host guarantees kBlockN * row_stride < 2^31):
    // the unrolled steps' offsets stay live across the key loop, and 64-bit
    // ones pushed the 4-warp configs past 255 registers.
    const int step_stride = kRowsPerStep * static_cast<int>(row_stride);
    if (kWholeTilePath && valid_rows >= kRows && headdim >= Tile::kChunksPerRow * 8) {
      // The whole tile in bounds (every interior key block; uniform over the CTA): no
      // predicates or selects, one pointer stepping by step_stride. The predicated form
      // below costs ~12 instructions a chunk (bounds test, 64-bit select and add), ~125 a
      // warp per K or V block at head dims 128 and 192, issued right after the barriers
      // that precede S = Q K^T and P V.
      const Elem* src = base + row0 * row_stride + col;
#pragma unroll
      for (int cs = 0; cs < kColSteps; ++cs) {
        if (kColSteps > 1 && col + cs * kColStepElems >= Tile::kChunksPerRow * 8) continue;
        const Elem* at = src + cs * kColStepElems;
#pragma unroll
        for (int step = 0; step < kSteps; ++step) {
          ptx::cp_async_16(smem + smem_lane + cs * kColStepBytes + step * kRowsPerStep * Tile::kPanelRowBytes, at);
          at += step_stride;
        }
      }
      return;
    }
#pragma unroll
    for (int cs = 0; cs < kColSteps; ++cs) {
      const int c = col + cs * kColStepElems;
      if (kColSteps > 1 && c >= Tile::kChunksPerRow * 8) continue;  // past the tile's width
      const bool col_ok = c < headdim;
      const Elem* src = base + row0 * row_stride + c;
#pragma unroll
      for (int step = 0; step < kSteps; ++step) {
        const bool valid = col_ok && row0 + step * kRowsPerStep < valid_rows;
        ptx::cp_async_16(smem + smem_lane + cs * kColStepBytes + step * kRowsPerStep * Tile::kPanelRowBytes,
                         valid ? src + step * step_stride : base, valid);
      }
    }
  }
};

template <int kHeadDim, typename Elem, bool kExtras, bool kNarrow = false>
__global__ void __launch_bounds__(FwdTileConfig<kHeadDim, kNarrow>::kThreads,
                                  FwdTileConfig<kHeadDim, kNarrow>::kMinBlocksPerSm)
    fwd_kernel(const PortattnFwdParams params) {
  using Traits = FwdKernelTraits<kHeadDim, Elem, kNarrow>;
  using QTile = typename Traits::QTile;
  using KVTile = typename Traits::KVTile;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kThreads = Traits::kThreads;
  constexpr int kMTiles = Traits::kMTiles;
  constexpr int kRows = Traits::kRows;
  constexpr int kSCols = Traits::kSCols;
  constexpr int kOCols = Traits::kOCols;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  // The dynamic shared-memory window starts 128-byte aligned and each tile's
  // size is a multiple of 128 B, so adding a base never disturbs the swizzle
  // bits: (base + lane) ^ x == base + (lane ^ x).
  const uint32_t sQ = ptx::smem_addr(smem_raw);
  const uint32_t sK = sQ + QTile::kBytes;
  const uint32_t sV = sK + KVTile::kBytes;
  static_assert(QTile::kBytes % 128 == 0 && KVTile::kBytes % 128 == 0, "tile alignment");

  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  // With a right window (causal) later query blocks see more keys: launch them first.
  const int m_block =
      params.window_right >= 0 ? gridDim.x - 1 - blockIdx.x : static_cast<int>(blockIdx.x);

  // ---- which rows and keys this CTA sees ------------------------------------
  const SeqBounds seq = seq_bounds(params, batch);  // clamped to the tensors (seq_bounds.h)
  const int q_start = seq.q_start, k_start = seq.k_start;
  const int seqlen_q = seq.len_q, seqlen_k = seq.len_k;
  const int m0 = m_block * kBlockM;
  if (m0 >= seqlen_q) return;

  // The whole query block, rows past seqlen_q included (computed, never stored):
  // Note [portattn visible keys] in block_range.h.
  const MaskRule rule = MaskRule::of(seq, params.window_left, params.window_right);
  const int diag = rule.diag;  // key j is on query i's diagonal when j == i + diag
  const int m_last = m0 + kBlockM - 1;
  const IndexRange key_blocks = rule.key_blocks(m0, m_last, kBlockN);
  const int n_block_begin = key_blocks.begin, n_block_end = key_blocks.end;

  const int head_k = head / (params.nheads / params.nheads_k);
  const Elem* gQ = static_cast<const Elem*>(params.q) + batch * params.q_strides.batch_stride +
                   (q_start + m0) * params.q_strides.row_stride + head * params.q_strides.head_stride;
  const Elem* gK = static_cast<const Elem*>(params.k) + batch * params.k_strides.batch_stride +
                   static_cast<int64_t>(k_start) * params.k_strides.row_stride +
                   head_k * params.k_strides.head_stride;
  const Elem* gV = static_cast<const Elem*>(params.v) + batch * params.v_strides.batch_stride +
                   static_cast<int64_t>(k_start) * params.v_strides.row_stride +
                   head_k * params.v_strides.head_stride;
  const int64_t k_row_stride = params.k_strides.row_stride;
  const int64_t v_row_stride = params.v_strides.row_stride;
  const int headdim = params.headdim;

  // Row (within the CTA's query block) of this thread's register row r.
  const int warp_row0 = warp * kMTiles * 16 + lane / 4;
  auto row_of = [&](int r) { return warp_row0 + (r / 2) * 16 + (r % 2) * 8; };
  // Column (within a key block) of register column c of S.
  const int col0 = 2 * (lane % 4);
  auto col_of = [&](int c) { return (c / 2) * 8 + col0 + (c % 2); };

  float o[kRows][kOCols];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int c = 0; c < kOCols; ++c) o[r][c] = 0.f;
  softmax::RowState<kRows> state;
  state.init();

  const float scale_log2 = params.softmax_scale * softmax::kLog2e;
  // The extras path converts scores to log2 units itself (softcap needs the
  // natural-unit score first), so its softmax scale is 1.
  const float softmax_scale_log2 = kExtras ? 1.f : scale_log2;
  float alibi_slope = 0.f;
  if (kExtras && params.alibi_slopes != nullptr)
    alibi_slope = params.alibi_slopes[batch * params.alibi_batch_stride + head];

  if (n_block_begin < n_block_end) {
    const TileLoader<QTile, kThreads, Traits::kWholeTileLoads> q_loader(threadIdx.x);
    const TileLoader<KVTile, kThreads, Traits::kWholeTileLoads> kv_loader(threadIdx.x);
    // ldmatrix addresses: per-lane part here, the rest is compile-time (ptx.cuh).
    const uint32_t q_frag = sQ + QTile::lane(warp * kMTiles * 16 + lane % 16, lane / 16);
    const uint32_t k_frag = sK + KVTile::lane(lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
    const uint32_t v_frag = sV + KVTile::lane(lane % 8 + ((lane / 8) % 2) * 8, lane / 16);

    // The narrow shape requests the first block's V with Q and K rather than after S:
    // its tiles are 1-8 key blocks long, and the first P V would otherwise wait for a
    // second global round trip. (The wide kernels keep the plain order: the early V's
    // addresses push them from 0-60 to 4-120 bytes of spills, nvcc 13.0.)
    q_loader.load(sQ, gQ, params.q_strides.row_stride, seqlen_q - m0, headdim);
    {
      const int n0 = (n_block_end - 1) * kBlockN;
      kv_loader.load(sK, gK + n0 * k_row_stride, k_row_stride, seqlen_k - n0, headdim);
      if constexpr (Traits::kEarlyV) {
        ptx::cp_async_commit();
        kv_loader.load(sV, gV + n0 * v_row_stride, v_row_stride, seqlen_k - n0, headdim);
      }
      ptx::cp_async_commit();
    }

    for (int n_block = n_block_end - 1; n_block >= n_block_begin; --n_block) {
      const int n0 = n_block * kBlockN;
      if (Traits::kEarlyV && n_block == n_block_end - 1) {
        ptx::cp_async_wait<1>();
        __syncthreads();  // Q and K(n) visible to all warps (V(n) may still be in flight)
      } else {
        ptx::cp_async_wait<0>();
        __syncthreads();  // K(n) visible to all warps; every warp is done reading V(n+1)
        kv_loader.load(sV, gV + n0 * v_row_stride, v_row_stride, seqlen_k - n0, headdim);
        ptx::cp_async_commit();
      }

      // ---- S = Q K^T ----------------------------------------------------------
      float s[kRows][kSCols];
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int c = 0; c < kSCols; ++c) s[r][c] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        uint32_t a[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
          ptx::ldmatrix_x4(a[mt], (q_frag ^ QTile::chunk_xor(kk * 2)) + QTile::fixed(mt * 16, kk * 2));
#pragma unroll
        for (int np = 0; np < kBlockN / 16; ++np) {
          uint32_t b[4];
          ptx::ldmatrix_x4(b, (k_frag ^ KVTile::chunk_xor(kk * 2)) + KVTile::fixed(np * 16, kk * 2));
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) mma_m16n16<Elem>(s, mt, np, a[mt], b);
        }
      }

      ptx::cp_async_wait<0>();
      __syncthreads();  // V(n) visible; every warp is done reading K(n)
      if (n_block > n_block_begin) {
        const int n_prev = n0 - kBlockN;
        kv_loader.load(sK, gK + n_prev * k_row_stride, k_row_stride, seqlen_k - n_prev, headdim);
        ptx::cp_async_commit();
      }

      // ---- scores: extras, then the mask --------------------------------------
      if (kExtras) {
        const float softcap = params.softcap;
        const float inv_softcap = softcap > 0.f ? 1.f / softcap : 0.f;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const int i = m0 + row_of(r);
#pragma unroll
          for (int c = 0; c < kSCols; ++c) {
            float x = s[r][c] * params.softmax_scale;
            if (softcap > 0.f) x = softcap * tanhf(x * inv_softcap);
            x -= alibi_slope * fabsf(static_cast<float>(i + diag - (n0 + col_of(c))));
            s[r][c] = x * softmax::kLog2e;
          }
        }
      }
      if (!rule.tile_fully_visible(m0, m_last, n0, n0 + kBlockN - 1)) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const VisibleSpan keys = rule.keys_of_query(m0 + row_of(r));
#pragma unroll
          for (int c = 0; c < kSCols; ++c) {
            const int j = n0 + col_of(c);
            if (j < keys.lo || j > keys.hi) s[r][c] = softmax::neg_inf();
          }
        }
      }

      softmax::online_softmax_step_lazy<kRows, kSCols, kOCols, QuadReduce>(s, o, state,
                                                                            softmax_scale_log2);

      if (kExtras && params.dropout_p > 0.f) {
        const uint32_t threshold = dropout_threshold(params.dropout_p);
        const uint64_t philox_seed = philox_seed_of(params), philox_offset = philox_offset_of(params);
        const int bh = batch * params.nheads + head;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const int i = m0 + row_of(r);
          // Keep bits first, in a rolled loop (Philox is ~40 instructions and
          // unrolling it per element costs hundreds of registers), then apply.
          uint32_t keep = 0;
#pragma unroll 1
          for (int pair = 0; pair < kSCols / 2; ++pair) {
            const int j = n0 + pair * 8 + col0;  // even: j and j + 1 share one Philox call
            const Philox4 rnd =
                dropout_random4(philox_seed, philox_offset, bh, i, j & ~3);
            const bool upper = (j & 2) != 0;
            keep |= static_cast<uint32_t>((upper ? rnd.z : rnd.x) >= threshold) << (2 * pair);
            keep |= static_cast<uint32_t>((upper ? rnd.w : rnd.y) >= threshold) << (2 * pair + 1);
          }
#pragma unroll
          for (int c = 0; c < kSCols; ++c)
            if (((keep >> c) & 1u) == 0) s[r][c] = 0.f;
        }
      }

      // ---- O += P V -------------------------------------------------------------
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        uint32_t p[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          p[mt][0] = ptx::ElemTraits<Elem>::pack(s[2 * mt][4 * kk], s[2 * mt][4 * kk + 1]);
          p[mt][1] = ptx::ElemTraits<Elem>::pack(s[2 * mt + 1][4 * kk], s[2 * mt + 1][4 * kk + 1]);
          p[mt][2] = ptx::ElemTraits<Elem>::pack(s[2 * mt][4 * kk + 2], s[2 * mt][4 * kk + 3]);
          p[mt][3] =
              ptx::ElemTraits<Elem>::pack(s[2 * mt + 1][4 * kk + 2], s[2 * mt + 1][4 * kk + 3]);
        }
#pragma unroll
        for (int dp = 0; dp < kHeadDim / 16; ++dp) {
          uint32_t b[4];
          ptx::ldmatrix_x4_trans(b, (v_frag ^ KVTile::chunk_xor(dp * 2)) + KVTile::fixed(kk * 16, dp * 2));
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) mma_m16n16<Elem>(o, mt, dp, p[mt], b);
        }
      }
    }
  }

  // ---- epilogue: normalise, stage O through shared memory, store -------------
  float lse[kRows];
  const float out_scale = (kExtras && params.dropout_p > 0.f) ? 1.f / (1.f - params.dropout_p) : 1.f;
  // The approximate log2 and reciprocal (Note [portattn fast finalize]); PORTATTN_FWD_FAST_FINALIZE=0
  // builds the accurate ones (A/B).
#ifndef PORTATTN_FWD_FAST_FINALIZE
#define PORTATTN_FWD_FAST_FINALIZE 1
#endif
  softmax::online_softmax_finalize<kRows, kOCols, QuadReduce, PORTATTN_FWD_FAST_FINALIZE != 0>(
      o, state, softmax_scale_log2, out_scale, lse);

  // A null lse means the caller does not want it (inference): skip the store.
  if (params.lse != nullptr && lane % 4 == 0) {
    float* gLse = params.lse + batch * params.lse_batch_stride + head * params.lse_head_stride +
                  q_start + m0;
#pragma unroll
    for (int r = 0; r < kRows; ++r)
      if (m0 + row_of(r) < seqlen_q) gLse[row_of(r)] = lse[r];
  }

  // Each warp overwrites only its own Q rows (no other warp reads them), so no CTA
  // barrier is needed before the staging writes; the one after them is. The warp's own
  // lanes last read those rows in the last key block's S = Q K^T (ldmatrix), with no
  // barrier between those reads and these writes: __syncwarp orders them for the memory
  // model (independent thread scheduling), and for racecheck, which otherwise may report
  // the pair as an intra-warp hazard.
  __syncwarp();
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int c = 0; c < kOCols; c += 2) {
      const int col = (c / 2) * 8 + col0;
      const uint32_t packed = ptx::ElemTraits<Elem>::pack(o[r][c], o[r][c + 1]);
      const uint32_t addr = sQ + QTile::offset(row_of(r), col) + (col % 8) * 2;
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(packed));
    }
  }
  __syncthreads();

  Elem* gO = static_cast<Elem*>(params.out) + batch * params.out_strides.batch_stride +
             (q_start + m0) * params.out_strides.row_stride + head * params.out_strides.head_stride;
  constexpr int kChunksPerRow = kHeadDim / 8;
#pragma unroll
  for (int it = 0; it < QTile::kChunks / kThreads; ++it) {
    const int index = it * kThreads + static_cast<int>(threadIdx.x);
    const int row = index / kChunksPerRow;
    const int col = (index % kChunksPerRow) * 8;
    if (m0 + row < seqlen_q && col < headdim) {
      uint4 chunk;
      asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(chunk.x), "=r"(chunk.y), "=r"(chunk.z), "=r"(chunk.w)
                   : "r"(sQ + QTile::offset(row, col)));
      *reinterpret_cast<uint4*>(gO + row * params.out_strides.row_stride + col) = chunk;
    }
  }
}

}  // namespace cuda
}  // namespace portattn
