// The sm80+ backward's main kernel from head dim 64 up with the whole head dim in one CTA
// (FlashAttention-2's shape), the default wherever one of its tiles fits the budget
// (BwdWideConfigsFor); PORTATTN_SM80_BWD_WIDE=0 (bwd_wide_enabled, bwd_entry.cu) runs bwd_kernel
// instead (its head-dim halves above 128).
//
// Note [portattn sm80 wide backward]
// bwd_kernel (bwd_kernel.cuh) gives each warp 16 keys and keeps that warp's dK and dV rows in
// registers: kDOut fp32 a thread for the two, which caps the unsplit head dim at 128. Above it,
// it splits the dK/dV/dQ columns into two CTAs over grid.z, and both recompute S^T and dP^T over
// the full head dim (1.4x the FLOPs at hd256). This kernel keeps the full head dim and splits the
// work differently in each of its two phases of a query block:
//   1. S^T = K Q^T and dP^T = V dO^T, kBlockN x kBlockM, over the warps as a grid of
//      kSWarpsN = kBlockN / kSRows key groups x kSWarpsM query groups (kSRows keys x kSCols
//      queries a warp; 32 x 32 at 128 x 64, FlashAttention-2's warp tile, else 16 x 32); P^T
//      (dropped) and dS^T go to shared memory, packed to 16 bits.
//   2. dV += P^T dO and dK += dS^T Q, kBlockN x kHeadDim, over the warps as a grid of
//      kKvWarpsN key groups x kKvWarpsD column groups (kKvRows x kKvCols a warp, the columns
//      every kKvWarpsD-th block of 16, so that one lane address serves them all): each warp owns
//      a slice of the output columns, so dK + dV cost 2 * kBlockN * kHeadDim / kThreads fp32 a
//      thread (128 at 64 x 256 with 8 warps), whatever the head dim. P^T and dS^T come back from
//      shared memory as A fragments (ldmatrix), dO and Q as B fragments (ldmatrix.trans).
//   dQ += dS K is bwd_kernel's code: kDqRows x kDqChunk tiles over the warps, dS^T through
//   ldmatrix.trans, fp32 adds into the accumulator (atomics, or the deterministic slices).
// Barriers a step: tiles ready; P^T/dS^T written; with one Q/dO stage, also Q and dO free for the
// next block's load (bwd_kernel: two). No FLOP is computed twice.
// Everything around the kernel is bwd_kernel's: BwdArgs, grid (key block or deterministic
// split, head, batch; kDSplit = 1), preprocess, converts, workspace (det_splits counts one CTA
// per (batch, KV head) here instead of two), GQA (atomics into the dK/dV accumulators, or a CTA
// walking its group in the deterministic mode), extras (softcap, ALiBi, dropout: the kExtras
// instantiation, same per-element code and the same Philox stream), windows and varlen.
// Tiles per budget: BwdWideConfigsFor in bwd_launch.cuh.
#pragma once
#include "bwd_kernel.cuh"

namespace portattn {
namespace cuda {

// kBlockN keys per CTA, kBlockM queries per step, kStages Q/dO buffers, kWarps warps, of which
// kKvWarpsN share the keys (and kWarps / kKvWarpsN the head dim) in the dK/dV products; kSRows
// keys a warp in the S^T / dP^T products. kPlainOnly: calls with softcap, ALiBi or dropout skip
// this tile for the next candidate, and its extras kernel is never compiled.
template <int kHeadDim_, int kBlockN_, int kBlockM_, int kStages_, int kWarps_, int kKvWarpsN_, int kSRows_ = 16,
          bool kPlainOnly_ = false>
struct BwdWideConfig {
  static constexpr bool kWide = true;
  static constexpr bool kPlainOnly = kPlainOnly_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kStages = kStages_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kDSplit = 1;  // the launch's grid.z factor: the head dim is not split
  static constexpr int kDOut = kHeadDim;
  // Phase 1 (S^T, dP^T): kSRows keys x kSCols queries a warp. Per k16 step a warp loads
  // kSRows / 16 + kSCols / 16 fragments of each operand pair: 2 + 2 at 32 x 32 against 1 + 4 at
  // 16 x 64 (the 128 x 64 tile with 16-key warps), for the same MMAs.
  static constexpr int kSRows = kSRows_;
  static constexpr int kSWarpsN = kBlockN / kSRows;
  static constexpr int kSWarpsM = kWarps / kSWarpsN;
  static constexpr int kSCols = kBlockM / kSWarpsM;
  // Phase 2 (dK, dV): kKvRows keys x kKvCols columns a warp.
  static constexpr int kKvWarpsN = kKvWarpsN_;
  static constexpr int kKvWarpsD = kWarps / kKvWarpsN;
  static constexpr int kKvRows = kBlockN / kKvWarpsN;
  static constexpr int kKvCols = kHeadDim / kKvWarpsD;
  // A warp's dK/dV columns are every kKvWarpsD-th 16-column block, from block kv_d: block
  // dp * kKvWarpsD + kv_d. Its swizzle bits (2 kv_d) then never meet those of dp's stride, so
  // one lane address a thread plus compile-time offsets reach every block (wide_cols_fold).
  static constexpr bool wide_cols_fold() {
    using Tile = ptx::SwizzledTile<kBlockM, kHeadDim>;
    for (int dp = 0; dp < kKvCols / 16; ++dp)
      for (int d = 0; d < kKvWarpsD; ++d) {
        const int stride = (2 * dp * kKvWarpsD) % Tile::kChunksPerPanelRow;
        if ((stride & (2 * d)) != 0 || stride + 2 * d >= Tile::kChunksPerPanelRow) return false;
      }
    return true;
  }
  // dQ tiles: BwdTileConfig's where their count divides evenly among the warps. The dQ phase
  // lasts as long as the warp with the most tiles, and BwdTileConfig's 32 x 32 tiles leave warps
  // idle at hd160 (10 tiles over 8 warps) and hd192 (12); there 16-row tiles run, as wide as
  // balances them, 32 to 80 columns (at most 40 fp32 a thread): 16 x 80 at hd160, 16 x 48 at hd192
  // (hd224 would need 16 x 16, twice the ldmatrix a MMA, for 12.5% less dQ time: kept).
  static constexpr int kDqChunkBase = (kDOut % 32 == 0 && (kBlockM / 16) * (kDOut / 32) >= kWarps) ? 32 : 16;
  static constexpr int kDqRowsBase =
      (kBlockM % 32 == 0 && (kBlockM / 32) * (kDOut / kDqChunkBase) >= kWarps) ? 32 : 16;
  static constexpr bool kDqBaseBalanced = ((kBlockM / kDqRowsBase) * (kDOut / kDqChunkBase)) % kWarps == 0;
  static constexpr int balanced_dq_chunk() {
    int best = 0;
    for (int c = 32; c <= 80; c += 16)
      if (kDOut % c == 0 && ((kBlockM / 16) * (kDOut / c)) % kWarps == 0) best = c;
    return best;
  }
  static constexpr bool kDqRebalance = !kDqBaseBalanced && balanced_dq_chunk() > 0;
  static constexpr int kDqChunk = kDqRebalance ? balanced_dq_chunk() : kDqChunkBase;
  static constexpr int kDqRows = kDqRebalance ? 16 : kDqRowsBase;

  using KVTile = ptx::SwizzledTile<kBlockN, kHeadDim>;
  using QTile = ptx::SwizzledTile<kBlockM, kHeadDim>;
  using PTile = ptx::SwizzledTile<kBlockN, kBlockM>;  // P^T and dS^T: keys x queries
  static constexpr int kOffK = 0;
  static constexpr int kOffV = KVTile::kBytes;
  static constexpr int kOffQ = 2 * KVTile::kBytes;
  static constexpr int kOffDo = kOffQ + kStages * QTile::kBytes;
  static constexpr int kOffP = kOffDo + kStages * QTile::kBytes;
  static constexpr int kOffDs = kOffP + PTile::kBytes;
  static constexpr int kOffLse = kOffDs + PTile::kBytes;
  static constexpr int kOffDelta = kOffLse + kStages * kBlockM * 4;
  static constexpr int kSmemBytes = kOffDelta + kStages * kBlockM * 4;

  static_assert(kHeadDim % 32 == 0 && kHeadDim <= 256, "instantiated head dims are multiples of 32");
  static_assert(kSRows % 16 == 0 && kBlockN % kSRows == 0 && kWarps % kSWarpsN == 0,
                "phase 1: whole kSRows-key groups over the warps");
  static_assert(kSCols % 16 == 0 && kSCols * kSWarpsM == kBlockM, "phase 1: 16-query steps (ldmatrix.x4)");
  static_assert(kWarps % kKvWarpsN == 0 && kKvRows % 16 == 0 && kKvRows * kKvWarpsN == kBlockN,
                "phase 2: m16 tiles of keys");
  static_assert(kKvCols % 16 == 0 && kKvCols * kKvWarpsD == kHeadDim, "phase 2: 16-column steps (ldmatrix.x4.trans)");
  static_assert(wide_cols_fold(), "phase 2: a warp's column blocks must share its swizzle bits");
  static_assert((kSCols / 8 & (kSCols / 8 - 1)) == 0 && PTile::kChunksPerPanelRow % (kSCols / 8) == 0,
                "phase 1: a warp's query chunks lie in one panel row at an aligned offset (P^T / dS^T stores)");
  static_assert(kBlockM % 32 == 0, "P^T / dS^T tiles are multiples of 32 queries wide (SwizzledTile)");
  static_assert(kStages == 1 || kStages == 2, "one or two Q/dO buffers");
  static_assert(kBlockM <= kThreads, "one thread per query row stages its LSE and delta");
};

// acc[mt] (16 x kCols each, kMt row tiles) += a[mt] (16 x 16) * tile[k0 : k0 + 16, column blocks
// dp * kStride + this warp's], each B fragment loaded once for all kMt row tiles. `frag`: the lane's
// address part with the warp's block folded in (BwdWideConfig::wide_cols_fold), so each ldmatrix
// costs one LOP3 and an immediate.
template <class Tile, int kMt, int kCols, int kStride, typename Elem>
__device__ __forceinline__ void wide_mma_rows(float (&acc)[kMt][kCols / 8][4], const uint32_t (&a)[kMt][4],
                                              uint32_t tile, uint32_t frag, int k0) {
#pragma unroll
  for (int dp = 0; dp < kCols / 16; ++dp) {
    const int chunk = 2 * dp * kStride;
    uint32_t b[4];
    ptx::ldmatrix_x4_trans(b, tile + ((frag ^ Tile::chunk_xor(chunk)) + Tile::fixed(k0, chunk)));
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt) {
      ptx::mma_16816<Elem>(acc[mt][2 * dp][0], acc[mt][2 * dp][1], acc[mt][2 * dp][2], acc[mt][2 * dp][3],
                           a[mt], b[0], b[1]);
      ptx::mma_16816<Elem>(acc[mt][2 * dp + 1][0], acc[mt][2 * dp + 1][1], acc[mt][2 * dp + 1][2],
                           acc[mt][2 * dp + 1][3], a[mt], b[2], b[3]);
    }
  }
}

template <class Cfg, typename Elem, bool kExtras>
__global__ void __launch_bounds__(Cfg::kThreads, 1) bwd_wide_kernel(const BwdArgs args) {
  constexpr int kHeadDim = Cfg::kHeadDim;
  constexpr int kBlockN = Cfg::kBlockN;
  constexpr int kBlockM = Cfg::kBlockM;
  constexpr int kStages = Cfg::kStages;
  constexpr int kWarps = Cfg::kWarps;
  constexpr int kThreads = Cfg::kThreads;
  constexpr int kDqChunk = Cfg::kDqChunk;
  constexpr int kDqRows = Cfg::kDqRows;
  constexpr int kSCols = Cfg::kSCols;
  constexpr int kSMt = Cfg::kSRows / 16;            // m16 tiles of S^T keys a warp
  constexpr int kSTiles = kSCols / 8;               // n8 tiles of S^T queries a warp
  constexpr int kKvMt = Cfg::kKvRows / 16;          // m16 tiles of dK/dV rows a warp
  constexpr int kKvCols = Cfg::kKvCols;
  constexpr int kOTiles = kKvCols / 8;              // n8 tiles of dK/dV columns a warp
  using KVTile = typename Cfg::KVTile;
  using QTile = typename Cfg::QTile;
  using PTile = typename Cfg::PTile;

  const PortattnBwdParams& p = args.p;
  const PortattnFwdParams& f = p.fwd;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t smem = ptx::smem_addr(smem_raw);
  const uint32_t sK = smem + Cfg::kOffK;
  const uint32_t sV = smem + Cfg::kOffV;
  const uint32_t sP = smem + Cfg::kOffP;
  const uint32_t sDs = smem + Cfg::kOffDs;
  float* sLse = reinterpret_cast<float*>(smem_raw + Cfg::kOffLse);
  float* sDelta = reinterpret_cast<float*>(smem_raw + Cfg::kOffDelta);

  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int g = lane / 4;
  const int q2 = 2 * (lane % 4);
  const int s_n = warp % Cfg::kSWarpsN;   // phase 1: keys s_n * kSRows + [0, kSRows)
  const int s_m = warp / Cfg::kSWarpsN;   //          queries s_m * kSCols + [0, kSCols)
  const int kv_n = warp % Cfg::kKvWarpsN;  // phase 2: keys kv_n * kKvRows + [0, kKvRows)
  const int kv_d = warp / Cfg::kKvWarpsN;  //          column blocks of 16: kv_d, kv_d + kKvWarpsD, ...
  const int batch = blockIdx.z;
  const bool det = p.deterministic != 0;
  const int group = f.nheads / f.nheads_k;
  const BwdHeads cta_heads = bwd_heads(args, det, group);
  const int head_k = cta_heads.head_k;
  const int head_first = cta_heads.head_first;
  const int heads = cta_heads.heads;
  const bool gqa_atomic = !det && group > 1;

  const SeqBounds s = seq_bounds(f, batch);
  const int n_blocks = (s.len_k + kBlockN - 1) / kBlockN;
  const MaskRule rule = MaskRule::of(s, f.window_left, f.window_right);
  const int headdim = f.headdim;
  const BwdPointwise pw = bwd_pointwise<kExtras>(f);

  // Lane parts of the shared-memory addresses. Row offsets that are multiples of 8 leave the
  // swizzle bits alone (SwizzledTile), so the warp's row offsets fold in here.
  const uint32_t kv_rows = lane_rows_first<KVTile>(lane) + s_n * Cfg::kSRows * KVTile::kPanelRowBytes;  // A of S^T, dP^T
  const uint32_t q_chunks = lane_chunks_first<QTile>(lane) + s_m * kSCols * QTile::kPanelRowBytes;  // B of S^T, dP^T
  const uint32_t p_rows = lane_rows_first<PTile>(lane) + kv_n * Cfg::kKvRows * PTile::kPanelRowBytes;  // A of dV, dK
  const uint32_t kv_t = lane_rows_first<KVTile>(lane);      // B of dQ (K through .trans)
  const uint32_t ds_chunks = lane_chunks_first<PTile>(lane);  // A of dQ (dS^T through .trans)
  // B of dV, dK (dO, Q through .trans): column blocks dp * kKvWarpsD + kv_d (wide_cols_fold).
  const uint32_t qo_cols = lane_rows_first<QTile>(lane) ^ QTile::chunk_xor(2 * kv_d);
  // P^T / dS^T stores: row s_n * kSRows + g at the warp's first query chunk, plus the column pair's
  // byte offset within the 16-byte chunk; step kk's two 8-column halves are chunks 2 kk and
  // 2 kk + 1 past it, row tile mt 16 rows below (a multiple of 8: the swizzle bits stay).
  const uint32_t p_store = PTile::offset(s_n * Cfg::kSRows + g, s_m * kSCols) + q2 * 2;

  const int n_first = blockIdx.x;
  const int n_step = det ? args.splits : n_blocks;
  float* dq_slice = args.dq_accum + (det ? blockIdx.x * args.dq_slice : 0);

  for (int n_block = n_first; n_block < n_blocks; n_block += n_step) {
    const int n0 = n_block * kBlockN;
    const int n_valid = min(kBlockN, s.len_k - n0);
    const IndexRange query_blocks = MaskRule::blocks_of(rule.query_range(n0, n0 + n_valid - 1), kBlockM);
    const int m_begin = query_blocks.begin;
    const int m_blocks = query_blocks.size();
    const int iters = heads * m_blocks;
    // Step it's head and first query row. A CTA walks one head except in the deterministic mode
    // with GQA (bwd_heads): the division by m_blocks (~20 integer instructions) only runs there.
    auto head_of = [&](int it) { return heads == 1 ? head_first : head_first + it / m_blocks; };
    auto m0_of = [&](int it) { return (m_begin + (heads == 1 ? it : it % m_blocks)) * kBlockM; };

    auto load_step = [&](int it, int stage) {
      bwd_load_step<Cfg, Elem>(args, smem, stage, batch, head_of(it), m0_of(it), s, headdim);
    };

    // K and V only for a block some query sees (bwd_kernel: unwaited copies of an empty block
    // could land after the next block's).
    // (The K/V addresses are computed here, not kept across the loop: registers are this kernel's
    // limit.)
    if (iters > 0) {
      const Elem* gK = static_cast<const Elem*>(f.k) + batch * f.k_strides.batch_stride +
                       static_cast<int64_t>(s.k_start + n0) * f.k_strides.row_stride + head_k * f.k_strides.head_stride;
      const Elem* gV = static_cast<const Elem*>(f.v) + batch * f.v_strides.batch_stride +
                       static_cast<int64_t>(s.k_start + n0) * f.v_strides.row_stride + head_k * f.v_strides.head_stride;
      bwd_load_tile<KVTile, kBlockN, kHeadDim, kThreads>(sK, gK, f.k_strides.row_stride, n_valid, headdim);
      bwd_load_tile<KVTile, kBlockN, kHeadDim, kThreads>(sV, gV, f.v_strides.row_stride, n_valid, headdim);
      ptx::cp_async_commit();
      load_step(0, 0);
    }

    float acc_dk[kKvMt][kOTiles][4], acc_dv[kKvMt][kOTiles][4];
#pragma unroll
    for (int mt = 0; mt < kKvMt; ++mt)
#pragma unroll
      for (int t = 0; t < kOTiles; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dk[mt][t][e] = acc_dv[mt][t][e] = 0.f;

    for (int it = 0; it < iters; ++it) {
      const int stage = kStages == 2 ? it % 2 : 0;
      const int head = head_of(it);
      const int m0 = m0_of(it);
      const uint32_t sQ = smem + Cfg::kOffQ + stage * QTile::kBytes;
      const uint32_t sDo = smem + Cfg::kOffDo + stage * QTile::kBytes;
      const float* lse2 = sLse + stage * kBlockM;
      const float* delta = sDelta + stage * kBlockM;

      ptx::cp_async_wait<0>();
      __syncthreads();  // this step's tiles visible; every warp is done with the previous step
      if (kStages == 2 && it + 1 < iters) load_step(it + 1, (it + 1) % 2);

      // ---- phase 1: S^T = K Q^T and dP^T = V dO^T (kSRows keys x kSCols queries a warp) ---
      float acc_s[kSMt][kSTiles][4], acc_dp[kSMt][kSTiles][4];
      bwd_st_dpt_rows<KVTile, QTile, kHeadDim, kSMt, kSCols, Elem>(acc_s, acc_dp, sK, sV, sQ, sDo, kv_rows, q_chunks);

      // ---- P^T (dropped, for dV) into acc_s and dS^T into acc_dp: bwd_kernel's arithmetic --
      const bool needs_mask =
          m0 + kBlockM > s.len_q || !rule.tile_fully_visible(m0, m0 + kBlockM - 1, n0, n0 + kBlockN - 1);
      const int key0 = n0 + s_n * Cfg::kSRows + g;  // this thread's keys: key0 + 16 mt + {0, 8}
      const int col0 = s_m * kSCols;                // and its queries' offset in the block
#pragma unroll
      for (int mt = 0; mt < kSMt; ++mt)
        bwd_p_ds<kExtras, kSTiles>(acc_s[mt], acc_dp[mt], f, pw, rule, needs_mask, batch, head, m0, col0, key0 + 16 * mt,
                                   q2, lse2, delta);

      // ---- P^T and dS^T -> shared (16-bit) ----------------------------------------------
#pragma unroll
      for (int mt = 0; mt < kSMt; ++mt)
#pragma unroll
        for (int kk = 0; kk < kSCols / 16; ++kk) {
          // The warp's base chunk is a multiple of kSCols / 8, which divides a panel row, so
          // chunk base + 2 kk + h neither carries into the base's bits nor leaves its panel: an XOR.
          const uint32_t lo = p_store ^ PTile::chunk_xor(2 * kk);
          const uint32_t hi = lo ^ 16u;
          const uint32_t fixed = PTile::fixed(0, 2 * kk) + mt * 16 * PTile::kPanelRowBytes;
          uint32_t a[4];
          pack_a<Elem>(a, acc_s[mt][2 * kk], acc_s[mt][2 * kk + 1]);
          st_shared_b32(sP + lo + fixed, a[0]);
          st_shared_b32(sP + lo + fixed + 8 * PTile::kPanelRowBytes, a[1]);
          st_shared_b32(sP + hi + fixed, a[2]);
          st_shared_b32(sP + hi + fixed + 8 * PTile::kPanelRowBytes, a[3]);
          pack_a<Elem>(a, acc_dp[mt][2 * kk], acc_dp[mt][2 * kk + 1]);
          st_shared_b32(sDs + lo + fixed, a[0]);
          st_shared_b32(sDs + lo + fixed + 8 * PTile::kPanelRowBytes, a[1]);
          st_shared_b32(sDs + hi + fixed, a[2]);
          st_shared_b32(sDs + hi + fixed + 8 * PTile::kPanelRowBytes, a[3]);
        }
      __syncthreads();  // P^T and dS^T complete

      // ---- phase 2: dV += P^T dO, dK += dS^T Q (kKvRows keys x kKvCols columns a warp) ----
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk) {
        uint32_t a[kKvMt][4];
#pragma unroll
        for (int mt = 0; mt < kKvMt; ++mt)
          ptx::ldmatrix_x4(a[mt], sP + ((p_rows ^ PTile::chunk_xor(kk * 2)) + PTile::fixed(mt * 16, kk * 2)));
        wide_mma_rows<QTile, kKvMt, kKvCols, Cfg::kKvWarpsD, Elem>(acc_dv, a, sDo, qo_cols, kk * 16);
      }
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk) {
        uint32_t a[kKvMt][4];
#pragma unroll
        for (int mt = 0; mt < kKvMt; ++mt)
          ptx::ldmatrix_x4(a[mt], sDs + ((p_rows ^ PTile::chunk_xor(kk * 2)) + PTile::fixed(mt * 16, kk * 2)));
        wide_mma_rows<QTile, kKvMt, kKvCols, Cfg::kKvWarpsD, Elem>(acc_dk, a, sQ, qo_cols, kk * 16);
      }

      if (kStages == 1) {
        __syncthreads();  // every warp is done with Q and dO (and LSE, delta) of this step
        if (it + 1 < iters) load_step(it + 1, 0);
      }

      // ---- dQ += dS K (bwd_kernel's tiles) ------------------------------------------------
      constexpr int kRowTiles = kDqRows / 16;
      constexpr int kTilesM = kBlockM / kDqRows;
      constexpr int kTiles = kTilesM * (kHeadDim / kDqChunk);
      const int64_t dq_row0 = ws_row(args, batch, head, m0);
      const bool dq_interior = m0 + kBlockM <= s.len_q && headdim == kHeadDim;  // as bwd_kernel's
      for (int tile = warp; tile < kTiles; tile += kWarps) {
        const int tm = tile % kTilesM;
        const int dq_col0 = (tile / kTilesM) * kDqChunk;
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
            const int chunk = (tm * kRowTiles + r) * 2;
            ptx::ldmatrix_x4_trans(a[r], sDs + ((ds_chunks ^ PTile::chunk_xor(chunk)) + PTile::fixed(kk * 16, chunk)));
          }
#pragma unroll
          for (int r = 0; r < kRowTiles; ++r) mma_a_tile<KVTile, kDqChunk, Elem>(acc[r], a[r], sK, kv_t, kk * 16, dq_col0);
        }
        dq_tile_add<kHeadDim, kRowTiles, kDqChunk / 8>(dq_slice, dq_row0, acc, tm, dq_col0, g, q2, dq_interior, headdim,
                                                       s.len_q - m0);
      }
    }

    // ---- epilogue: dK (scaled) and dV of this warp's keys and columns ----------------------
    if (gqa_atomic) {
      const int64_t stride = static_cast<int64_t>(args.heads_k) * headdim;
      const int64_t base = (static_cast<int64_t>(batch) * f.seqlen_k + n0) * stride +
                           static_cast<int64_t>(head_k - args.head0 / group) * headdim;
#pragma unroll
      for (int mt = 0; mt < kKvMt; ++mt)
#pragma unroll
        for (int t = 0; t < kOTiles; ++t) {
          const int col = ((t / 2) * Cfg::kKvWarpsD + kv_d) * 16 + (t % 2) * 8 + q2;
          if (col >= headdim) continue;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = kv_n * Cfg::kKvRows + mt * 16 + g + h * 8;
            if (r >= n_valid) continue;
            const int64_t off = base + r * stride + col;
            accum_add2(args.dk_accum + off, acc_dk[mt][t][2 * h] * f.softmax_scale,
                       acc_dk[mt][t][2 * h + 1] * f.softmax_scale);
            accum_add2(args.dv_accum + off, acc_dv[mt][t][2 * h], acc_dv[mt][t][2 * h + 1]);
          }
        }
    } else {
      Elem* gDk = static_cast<Elem*>(p.dk) + batch * p.dk_strides.batch_stride +
                  static_cast<int64_t>(s.k_start + n0) * p.dk_strides.row_stride + head_k * p.dk_strides.head_stride;
      Elem* gDv = static_cast<Elem*>(p.dv) + batch * p.dv_strides.batch_stride +
                  static_cast<int64_t>(s.k_start + n0) * p.dv_strides.row_stride + head_k * p.dv_strides.head_stride;
#pragma unroll
      for (int mt = 0; mt < kKvMt; ++mt)
#pragma unroll
        for (int t = 0; t < kOTiles; ++t) {
          const int col = ((t / 2) * Cfg::kKvWarpsD + kv_d) * 16 + (t % 2) * 8 + q2;
          if (col >= headdim) continue;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = kv_n * Cfg::kKvRows + mt * 16 + g + h * 8;
            if (r >= n_valid) continue;
            *reinterpret_cast<uint32_t*>(gDk + r * p.dk_strides.row_stride + col) = ptx::ElemTraits<Elem>::pack(
                acc_dk[mt][t][2 * h] * f.softmax_scale, acc_dk[mt][t][2 * h + 1] * f.softmax_scale);
            *reinterpret_cast<uint32_t*>(gDv + r * p.dv_strides.row_stride + col) =
                ptx::ElemTraits<Elem>::pack(acc_dv[mt][t][2 * h], acc_dv[mt][t][2 * h + 1]);
          }
        }
    }
    ptx::cp_async_wait<0>();
    __syncthreads();  // every warp is done with K/V (and P^T/dS^T) before the next key block
  }
}

}  // namespace cuda
}  // namespace portattn
