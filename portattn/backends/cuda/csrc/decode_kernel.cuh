// Split-KV decode kernel for sm80+ (mma.sync): few query rows against many
// keys, read in place from a contiguous cache, a paged cache or packed
// (varlen) sequences. Design: Note [portattn decode] in common/params.h.
//
// Tile configuration (DecodeTileConfig): a CTA owns 16 packed query rows
// (query x head-in-group) of one (sequence, KV head) and one key split.
// Each warp takes kWarpKeys keys of every stage (kStageKeys = kWarpKeys x warps),
// so the score tile of a warp is one or two m16n16 blocks and P never leaves registers.
//   head dim <= 64:  4 warps of 32 keys, 128 keys per stage;
//   head dim <= 128: 4 warps of 16 keys, 64 keys per stage;
//   head dim  > 128: 2 warps, 32 keys per stage (O is head_dim / 2 fp32
//                    registers per thread; 4 warps would also double the
//                    shared memory of the final merge).
// Shared memory: kStages stages of K and V (swizzled, ptx::SwizzledTile),
// each 32 KiB at head dims 64, 128 and 256, three stages in flight: 96 KiB, within
// the 99 KiB that consumer GPUs (sm86/sm89/sm120) allow per block. Q is read
// straight into mma A fragments (16 rows, once per CTA), so it needs no
// shared memory. The decode is bound by HBM bandwidth: what matters is the
// bytes in flight per SM (Little's law: ~3.35 TB/s x ~1 us / 132 SMs = 25 KiB
// on an H100); two stages ahead of the one being consumed give 64 KiB per CTA.
//
// Per stage: every thread issues its part of the next K/V stage (cp.async,
// with a per-row page lookup when paged: any page size works, a stage may
// span several pages), then each warp computes S = Q K^T over its keys,
// masks only on boundary stages, runs the online-softmax step and O += P V.
// At the end the warps' (O, LSE) pairs are merged through shared memory,
// which is the same LSE-weighted sum the split combine does across CTAs.
//
// FP8 caches (kFp8, Note [portattn fp8 kv cache] in common/params.h): a stage
// arrives as raw e4m3 rows (kHeadDim bytes a row, unswizzled, K then V: 16 KiB
// at head dim 128), half the bytes of a 16-bit stage, so three stages take
// 48 KiB. Before its mma each warp converts its own kWarpKeys keys of K and V
// into one Elem stage (the swizzled tiles above, 32 KiB): a warp reads only the
// keys it converted, so a __syncwarp orders the two and the CTA keeps one
// barrier per stage. 80 KiB in all at head dims 64, 128 and 256. k_descale
// scales the scores (folded into the softmax scale), v_descale the output.
// kFp8Regs (the register path, PORTATTN_DECODE_FP8_PATH=regs; Note [portattn fp8 register
// fragments] in docs/decode.md, decode_fp8_frag.h): the raw rows are stored swizzled, and each
// warp's ldmatrix reads them straight into mma operand registers, where they are converted;
// no converted stage, so 48 KiB at head dims 64, 128 and 256.
// kStages = kFp8DeepStages (5; PORTATTN_DECODE_FP8_PATH=regs_deep): the register path with
// four raw stages ahead instead of two, 80 KiB; Note [portattn fp8 deep pipeline] in
// docs/decode.md gives the bytes-in-flight and occupancy reasoning and ptxas's numbers.
#pragma once
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include <type_traits>

#include "../../common/online_softmax.h"
#include "../../common/params.h"
#include "../../common/decode_sequence.h"
#include "decode_fp8_frag.h"
#include "fp8.cuh"
#include "fwd_kernel.cuh"
#include "ptx.cuh"

namespace portattn {
namespace cuda {

// Stages of the FP8 register path's deep variant (regs_deep): a raw stage is 16 KiB at head
// dims 64, 128 and 256, so 5 stages keep 64 KiB ahead of the one consumed, the 16-bit kernel's
// 2 x 32 KiB, in 80 KiB: two CTAs per SM on sm80 (164 KiB) and sm90 (228 KiB) whatever the
// registers (<= 255 a thread at 128 threads), one within the 99 KiB of sm86/sm89/sm120.
constexpr int kFp8DeepStages = 5;

template <int kHeadDim_, bool kFp8_ = false, bool kFp8Regs_ = false, int kStages_ = 3>
struct DecodeTileConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kFp8 = kFp8_;  // the cache holds e4m3 bytes
  static constexpr bool kFp8Regs = kFp8 && kFp8Regs_;  // ... converted in registers, not through a stage
  static constexpr int kWarps = kHeadDim <= 128 ? 4 : 2;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockM = 16;  // packed query rows per CTA
  // Keys per warp and stage: 32 at head dim <= 64 so that a stage moves 32 KiB, as at
  // head dim 128 (the loads' address work and the barriers per byte then match).
  static constexpr int kWarpKeys = kHeadDim <= 64 ? 32 : 16;
  static constexpr int kStageKeys = kWarps * kWarpKeys;
  // Stages in the ring, kStages - 1 of them loading while one is consumed. Other than 3 only
  // for the register path, whose stages are half a 16-bit stage's bytes.
  static constexpr int kStages = kStages_;
  static_assert(kStages == 3 || (kFp8Regs && kStages >= 2), "deeper rings only on the FP8 register path");
  using KVTile = ptx::SwizzledTile<kStageKeys, kHeadDim>;
  static constexpr int kStageBytes = 2 * KVTile::kBytes;  // K then V
  // What the loads bring in per stage: the Elem tiles, or (kFp8) raw e4m3 rows that the
  // warps convert into one Elem stage placed after the kStages raw ones; kFp8Regs: raw rows
  // in the swizzled layout the register fragments read, and no converted stage.
  using RawLayout = fp8_frag::StageLayout<kHeadDim, kStageKeys, kWarpKeys>;
  static constexpr int kRawTileBytes = kFp8Regs ? RawLayout::kTileBytes : kStageKeys * kHeadDim;
  static constexpr int kLoadStageBytes = kFp8 ? 2 * kRawTileBytes : kStageBytes;
  static constexpr int kConvertedOffset = kStages * kLoadStageBytes;
  static constexpr int kPipeBytes = kConvertedOffset + (kFp8 && !kFp8Regs ? kStageBytes : 0);
  // Stage loads: 16-byte chunks, a power-of-two number of lanes per key row.
  static constexpr int kChunkElems = kFp8 ? 16 : 8;
  static constexpr int kLoadLanesPerRow = next_pow2(kHeadDim / kChunkElems);
  static constexpr int kLoadRowsPerStep = kThreads / kLoadLanesPerRow;
  static_assert(kLoadRowsPerStep > 0 && kStageKeys % kLoadRowsPerStep == 0, "loader layout");
  static constexpr int kMergeBytes = kWarps * kBlockM * (kHeadDim + 1) * 4;
  static constexpr int kSmemBytes = kPipeBytes > kMergeBytes ? kPipeBytes : kMergeBytes;
  static_assert(kHeadDim % 32 == 0 && kHeadDim <= 256, "instantiated head dims are multiples of 32");
  static_assert(KVTile::kBytes % 128 == 0, "stage buffers keep the swizzle's 128-byte alignment");
  static_assert(kLoadStageBytes % 128 == 0, "the converted stage keeps the swizzle's 128-byte alignment");
  static_assert(!kFp8 || kWarpKeys * kHeadDim % (32 * 16) == 0, "a warp converts whole 16-byte chunks per lane");
};

// Sequences, key rows and key ranges: common/decode_sequence.h (one copy of the rules for
// both vendors' decode kernels).
using decode::KeyRange;
using decode::KeyRowAddress;
using DecodeSequence = decode::Sequence;

// Programmatic dependent launch (sm90+; decode_launch.cuh sets the launch attribute there):
// a kernel may be scheduled while the previous one in the stream finishes, and waits for
// it here before touching memory that kernel may write. Without the attribute (or before
// sm90) both are no-ops.
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::);
#endif
}

// The sequence of block `batch`, contained when its metadata is out of range (Note [portattn
// decode errors] in params.h): every block of the sequence scans its page numbers, so all
// splits agree and no key of another sequence's page is read; one block per sequence
// (`reporter`) records it.
template <int kThreads>
__device__ __forceinline__ DecodeSequence contained_sequence(const PortattnDecodeParams& params, int batch,
                                                             bool reporter) {
  DecodeSequence seq = DecodeSequence::of(params, batch);
  if (params.block_table != nullptr) {
    const int32_t* pages = params.block_table + batch * params.block_table_batch_stride;
    const int bad_slot = decode::first_bad_page_slot(pages, params.page_size, params.num_pages, seq.key_base,
                                                     seq.seqlen_k, threadIdx.x, kThreads);
    if (__syncthreads_or(bad_slot >= 0)) {
      if (reporter && bad_slot >= 0)
        decode::record_error(params.errors, PORTATTN_ERR_BLOCK_TABLE, batch, pages[bad_slot]);
      seq.contain();
    }
  }
  if (reporter && threadIdx.x == 0 && seq.seqlen_k == 0 && params.errors != nullptr) {
    int value = 0;
    const int argument = decode::metadata_error(params, batch, &value);
    if (argument >= 0) decode::record_error(params.errors, argument, batch, value);
  }
  return seq;
}

template <int kHeadDim, typename Elem, bool kExtras, bool kFp8 = false, bool kFp8Regs = false, int kStages_ = 3>
__global__ void __launch_bounds__(DecodeTileConfig<kHeadDim, kFp8, kFp8Regs, kStages_>::kThreads)
    decode_kernel(const PortattnDecodeParams params) {
  using Config = DecodeTileConfig<kHeadDim, kFp8, kFp8Regs, kStages_>;
  using RawLayout = typename Config::RawLayout;
  using CacheElem = typename std::conditional<kFp8, uint8_t, Elem>::type;
  using KVTile = typename Config::KVTile;
  constexpr int kThreads = Config::kThreads;
  constexpr int kStageKeys = Config::kStageKeys;
  constexpr int kStages = Config::kStages;
  constexpr int kOCols = kHeadDim / 4;
  constexpr int kWarpKeys = Config::kWarpKeys;
  constexpr int kSCols = kWarpKeys / 4;  // two columns per n8 tile of keys
  constexpr int kRows = 2;   // rows g and g + 8 of the 16-row tile

  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t smem = ptx::smem_addr(smem_raw);

  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int split = blockIdx.x;
  const int group = params.nheads / params.nheads_k;
  const int m_tiles = (params.seqlen_q * group + 15) / 16;
  const int head_k = blockIdx.y / m_tiles;
  const int m_tile = blockIdx.y % m_tiles;
  const int batch = blockIdx.z;

  wait_for_previous_grid();  // q, the cache and the lengths may come from the kernel before
  const DecodeSequence seq = contained_sequence<kThreads>(params, batch, blockIdx.x == 0 && blockIdx.y == 0);
  const int rows = seq.seqlen_q * group;  // packed rows of this sequence
  const int row0 = m_tile * 16;
  if (row0 >= rows) return;  // a shorter varlen sequence: nothing of it here (the combine skips it too)
  // k_descale scales every score of this CTA, v_descale its output (1 without an FP8 cache).
  const float k_scale = kFp8 ? fp8::descale_of(params.kv.k_descale, params.kv.k_descale_batch_stride,
                                               params.kv.k_descale_head_stride, batch, head_k)
                             : 1.f;
  const float v_scale = kFp8 ? fp8::descale_of(params.kv.v_descale, params.kv.v_descale_batch_stride,
                                               params.kv.v_descale_head_stride, batch, head_k)
                             : 1.f;
  const float score_scale = params.softmax_scale * k_scale;

  // ---- the key range this CTA covers --------------------------------------------
  const KeyRange range = KeyRange::of(params, seq, row0, 16, group, kStageKeys, split);
  const MaskRule rule = seq.rule(params);  // Note [portattn visible keys] (block_range.h)
  const int diag = range.diag;
  const int stage_begin = range.begin, stage_end = range.end;

  // ---- per-thread rows: register row r is tile row g + 8 r -----------------------
  const int g = lane / 4;
  int q_of_row[kRows];
  float slope[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int packed = min(row0 + g + 8 * r, rows - 1);
    q_of_row[r] = packed / group;
    slope[r] = 0.f;
    if (kExtras && params.alibi_slopes != nullptr)
      slope[r] = params.alibi_slopes[batch * params.alibi_batch_stride + head_k * group + packed % group];
  }

  // ---- Q straight into A fragments: a[kk] = rows (g, g+8) x cols kk*16 + (2q, 2q+1, 8+2q, 9+2q),
  // or with kFp8Regs in K's order, kk*16 + (4q, 4q+1, 4q+2, 4q+3) (fp8_frag::q_col)
  const Elem* gQ = static_cast<const Elem*>(params.q);
  uint32_t qa[kHeadDim / 16][4];
  {
    const int64_t q_batch = params.cu_seqlens_q != nullptr ? 0 : batch * params.q_strides.batch_stride;
    const Elem* q_row[kRows];
    bool row_ok[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int packed = row0 + g + 8 * r;
      row_ok[r] = packed < rows;
      const int safe = row_ok[r] ? packed : 0;
      q_row[r] = gQ + q_batch + static_cast<int64_t>(seq.q_start + safe / group) * params.q_strides.row_stride +
                 static_cast<int64_t>(head_k * group + safe % group) * params.q_strides.head_stride;
    }
    const int c0 = 2 * (lane % 4);
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int col = Config::kFp8Regs ? fp8_frag::q_col(kk, half, lane) : kk * 16 + half * 8 + c0;
        const bool col_ok = col < params.headdim;
#pragma unroll
        for (int r = 0; r < kRows; ++r)
          qa[kk][half * 2 + r] =
              row_ok[r] && col_ok ? *reinterpret_cast<const uint32_t*>(q_row[r] + col) : 0u;
      }
    }
  }

  // ---- K/V stage loader: per-row addresses (pages may change at any row) ---------
  constexpr int kLanesPerRow = Config::kLoadLanesPerRow;
  constexpr int kRowsPerStep = Config::kLoadRowsPerStep;
  constexpr int kSteps = kStageKeys / kRowsPerStep;
  const int load_row0 = threadIdx.x / kLanesPerRow;
  const int load_col = (threadIdx.x % kLanesPerRow) * Config::kChunkElems;
  const bool load_lane = load_col < kHeadDim;
  const bool load_col_ok = load_col < params.headdim;
  const CacheElem* gK = static_cast<const CacheElem*>(params.k) + head_k * params.k_strides.head_stride;
  const CacheElem* gV = static_cast<const CacheElem*>(params.v) + head_k * params.v_strides.head_stride;
  const KeyRowAddress rows_at(
      params.block_table != nullptr ? params.block_table + batch * params.block_table_batch_stride : nullptr,
      params.page_size, params.num_pages);
  const int cache_row = params.cu_seqlens_k != nullptr && params.block_table == nullptr ? 0 : seq.cache_row;

  // Per-thread invariants of the loads: this thread's rows of a stage are load_row0 +
  // step * kRowsPerStep, so within one page (or a contiguous cache) their addresses are
  // a base plus constant steps; shared-memory offsets are the same for every stage.
  const int64_t k_step = kRowsPerStep * params.k_strides.row_stride;
  const int64_t v_step = kRowsPerStep * params.v_strides.row_stride;
  // Rows kRowsPerStep apart keep their swizzle bits when kRowsPerStep is a multiple of 8:
  // then the offsets are one register plus immediates; otherwise computed per use.
  // Raw e4m3 rows of the conversion pass (kFp8, not kFp8Regs) are plain row-major: one
  // register plus immediates as well; those of kFp8Regs are swizzled as KVTile's.
  using RawTile = typename RawLayout::Tile;
  const uint32_t dst0 = Config::kFp8Regs ? RawLayout::offset(load_row0, load_col)
                        : kFp8           ? load_row0 * kHeadDim + load_col
                                         : KVTile::offset(load_row0, load_col);
  auto dst = [&](int step) -> uint32_t {
    if constexpr (Config::kFp8Regs) {
      if constexpr (kRowsPerStep % 8 == 0) return dst0 + step * kRowsPerStep * RawTile::kPanelRowBytes;
      return RawLayout::offset(load_row0 + step * kRowsPerStep, load_col);
    }
    if constexpr (kFp8) return dst0 + step * kRowsPerStep * kHeadDim;
    if constexpr (kRowsPerStep % 8 == 0) return dst0 + step * kRowsPerStep * KVTile::kPanelRowBytes;
    return KVTile::offset(load_row0 + step * kRowsPerStep, load_col);
  };

  auto load_stage = [&](int stage) {
    const uint32_t sK = smem + (stage % kStages) * Config::kLoadStageBytes;
    const uint32_t sV = sK + (kFp8 ? Config::kRawTileBytes : KVTile::kBytes);
    if (!load_lane) return;
    const int stage_key0 = stage * kStageKeys;
    const int key0 = stage_key0 + load_row0;           // this thread's first key of the stage
    const int rows_left = seq.seqlen_k - key0;         // its rows with step * kRowsPerStep < rows_left exist
    const int first_pos = seq.key_base + stage_key0;   // the stage's first and last positions
    // One page (or a contiguous cache) holds the whole stage: one lookup, constant steps.
    // Uniform across the CTA, so the branch does not diverge.
    const bool one_page = rows_at.pages == nullptr ||
                          rows_at.page_of_slot(first_pos) == rows_at.page_of_slot(first_pos + kStageKeys - 1);
    if (one_page) {
      const int pos = seq.key_base + (rows_left > 0 ? key0 : 0);
      const int page = rows_at.pages != nullptr ? rows_at.page_of(pos) : cache_row;
      const int row = rows_at.pages != nullptr ? rows_at.row_in_page(pos) : pos;
      const CacheElem* k_src = gK + KeyRowAddress::offset_of(params.k_strides, page, row) + load_col;
      const CacheElem* v_src = gV + KeyRowAddress::offset_of(params.v_strides, page, row) + load_col;
#pragma unroll
      for (int step = 0; step < kSteps; ++step) {
        const bool valid = load_col_ok && step * kRowsPerStep < rows_left;
        ptx::cp_async_16(sK + dst(step), valid ? k_src + step * k_step : gK, valid);
        ptx::cp_async_16(sV + dst(step), valid ? v_src + step * v_step : gV, valid);
      }
      return;
    }
    // The stage spans pages: the block-table reads of a group of steps first (independent
    // loads whose latencies overlap), then their copies. Groups of kLookupGroup keep the
    // live page numbers few (16 steps at once spilled at head dim 256).
    constexpr int kLookupGroup = kSteps < 4 ? kSteps : 4;
    static_assert(kSteps % kLookupGroup == 0, "lookup groups tile the steps");
#pragma unroll
    for (int group0 = 0; group0 < kSteps; group0 += kLookupGroup) {
      int page[kLookupGroup], row_in[kLookupGroup];
#pragma unroll
      for (int i = 0; i < kLookupGroup; ++i) {
        const int step = group0 + i;
        const int pos = seq.key_base + (step * kRowsPerStep < rows_left ? key0 + step * kRowsPerStep : 0);
        page[i] = rows_at.page_of(pos);
        row_in[i] = rows_at.row_in_page(pos);
      }
#pragma unroll
      for (int i = 0; i < kLookupGroup; ++i) {
        const int step = group0 + i;
        const bool valid = load_col_ok && step * kRowsPerStep < rows_left;
        const int64_t k_off = KeyRowAddress::offset_of(params.k_strides, page[i], row_in[i]) + load_col;
        const int64_t v_off = KeyRowAddress::offset_of(params.v_strides, page[i], row_in[i]) + load_col;
        ptx::cp_async_16(sK + dst(step), valid ? gK + k_off : gK, valid);
        ptx::cp_async_16(sV + dst(step), valid ? gV + v_off : gV, valid);
      }
    }
  };


  float o[kRows][kOCols];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int c = 0; c < kOCols; ++c) o[r][c] = 0.f;
  softmax::RowState<kRows> state;
  state.init();
  const float scale_log2 = score_scale * softmax::kLog2e;
  const float softmax_scale_log2 = kExtras ? 1.f : scale_log2;

  // ldmatrix lane addresses of this warp's keys (rows kWarpKeys w .. of a stage).
  const uint32_t k_frag = KVTile::lane(warp * kWarpKeys + lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
  const uint32_t v_frag = KVTile::lane(warp * kWarpKeys + lane % 8 + ((lane / 8) % 2) * 8, lane / 16);
  const int col0 = 2 * (lane % 4);
  // kFp8Regs: the same for the raw tiles (one address serves K's ldmatrix and V's ldmatrix.trans).
  const uint32_t raw_frag = RawLayout::lane_part(warp, lane);

  // kFp8: this warp's kWarpKeys rows of a raw stage (K and V) -> the converted Elem stage.
  auto convert_own_keys = [&](uint32_t raw) {
    constexpr int kRowChunks = kHeadDim / 16;  // 16-byte chunks of an e4m3 row
    constexpr int kLaneChunks = kWarpKeys * kRowChunks / 32;
    const uint32_t converted = smem + Config::kConvertedOffset;
#pragma unroll
    for (int kv = 0; kv < 2; ++kv) {
#pragma unroll
      for (int i = 0; i < kLaneChunks; ++i) {
        const int chunk = i * 32 + lane;
        const int row = warp * kWarpKeys + chunk / kRowChunks;
        const int col = (chunk % kRowChunks) * 16;
        uint4 lo, hi;
        fp8::e4m3x16_to<Elem>(fp8::ld_shared_16(raw + kv * Config::kRawTileBytes + row * kHeadDim + col), lo, hi);
        const uint32_t tile = converted + kv * KVTile::kBytes;
        fp8::st_shared_16(tile + KVTile::offset(row, col), lo);
        fp8::st_shared_16(tile + KVTile::offset(row, col + 8), hi);
      }
    }
  };

#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    if (stage_begin + i < stage_end) load_stage(stage_begin + i);
    ptx::cp_async_commit();
  }

  for (int stage = stage_begin; stage < stage_end; ++stage) {
    ptx::cp_async_wait<kStages - 2>();
    __syncthreads();  // this stage landed for every thread; everyone is done with stage - 1's buffer
    if (stage + kStages - 1 < stage_end) load_stage(stage + kStages - 1);
    ptx::cp_async_commit();

    uint32_t sK = smem + (stage % kStages) * Config::kLoadStageBytes;
    if constexpr (kFp8 && !Config::kFp8Regs) {
      convert_own_keys(sK);
      __syncwarp();  // the warp reads back only the rows it converted
      sK = smem + Config::kConvertedOffset;
    }
    const uint32_t sV = sK + (Config::kFp8Regs ? Config::kRawTileBytes : KVTile::kBytes);
    float s[kRows][kSCols];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int c = 0; c < kSCols; ++c) s[r][c] = 0.f;
    if constexpr (Config::kFp8Regs) {
      // e4m3 K rows -> B operands in registers (fp8_frag: dims in Q's q_col order).
#pragma unroll
      for (int pair = 0; pair < RawLayout::kPairs; ++pair) {
#pragma unroll
        for (int np = 0; np < RawLayout::kBlocks; ++np) {
          uint32_t raw[4];
          ptx::ldmatrix_x4(raw, sK + RawLayout::address(raw_frag, np, pair));
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            uint32_t b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i)
              b[i] = fp8::e4m3x2_from_spread<Elem>(
                  __byte_perm(raw[2 * h + fp8_frag::key_source(i)], 0u, fp8_frag::key_selector(i)));
            mma_m16n16<Elem>(s, 0, np, qa[2 * pair + h], b);
          }
        }
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk) {
#pragma unroll
        for (int np = 0; np < kWarpKeys / 16; ++np) {
          uint32_t b[4];
          ptx::ldmatrix_x4(b, sK + (k_frag ^ KVTile::chunk_xor(kk * 2)) + KVTile::fixed(np * 16, kk * 2));
          mma_m16n16<Elem>(s, 0, np, qa[kk], b);
        }
      }
    }

    const int key0 = stage * kStageKeys + warp * kWarpKeys;
    if (kExtras) {
      const float softcap = params.softcap;
      const float inv_softcap = softcap > 0.f ? 1.f / softcap : 0.f;
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int c = 0; c < kSCols; ++c) {
          float x = s[r][c] * score_scale;
          if (softcap > 0.f) x = softcap * tanhf(x * inv_softcap);
          const int j = key0 + (c / 2) * 8 + col0 + (c % 2);
          x -= slope[r] * fabsf(static_cast<float>(q_of_row[r] + diag - j));
          s[r][c] = x * softmax::kLog2e;
        }
    }
    if (!range.all_visible(params, seq, stage * kStageKeys, kStageKeys)) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const VisibleSpan keys = rule.keys_of_query(q_of_row[r]);
#pragma unroll
        for (int c = 0; c < kSCols; ++c) {
          const int j = key0 + (c / 2) * 8 + col0 + (c % 2);
          if (j < keys.lo || j > keys.hi) s[r][c] = softmax::neg_inf();
        }
      }
    }

    softmax::online_softmax_step_lazy<kRows, kSCols, kOCols, QuadReduce>(s, o, state, softmax_scale_log2);

#pragma unroll
    for (int kk = 0; kk < kWarpKeys / 16; ++kk) {
      uint32_t p[4];
      p[0] = ptx::ElemTraits<Elem>::pack(s[0][4 * kk], s[0][4 * kk + 1]);
      p[1] = ptx::ElemTraits<Elem>::pack(s[1][4 * kk], s[1][4 * kk + 1]);
      p[2] = ptx::ElemTraits<Elem>::pack(s[0][4 * kk + 2], s[0][4 * kk + 3]);
      p[3] = ptx::ElemTraits<Elem>::pack(s[1][4 * kk + 2], s[1][4 * kk + 3]);
      if constexpr (Config::kFp8Regs) {
        // e4m3 V rows -> B operands in registers: per chunk, an even-dim and an odd-dim n8
        // tile (fp8_frag::o_col).
#pragma unroll
        for (int pair = 0; pair < RawLayout::kPairs; ++pair) {
          uint32_t raw[4];
          ptx::ldmatrix_x4_trans(raw, sV + RawLayout::address(raw_frag, kk, pair));
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            uint32_t b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i)
              b[i] = fp8::e4m3x2_from_spread<Elem>(
                  __byte_perm(raw[2 * h + fp8_frag::value_source(i)], 0u, fp8_frag::value_selector(i)));
            mma_m16n16<Elem>(o, 0, 2 * pair + h, p, b);
          }
        }
      } else {
#pragma unroll
        for (int dp = 0; dp < kHeadDim / 16; ++dp) {
          uint32_t b[4];
          ptx::ldmatrix_x4_trans(b, sV + (v_frag ^ KVTile::chunk_xor(dp * 2)) + KVTile::fixed(kk * 16, dp * 2));
          mma_m16n16<Elem>(o, 0, dp, p, b);
        }
      }
    }
  }

  allow_next_grid();  // the combine (or whatever follows) may be scheduled now; it waits for us

  // ---- merge the warps' states, then write out (one split) or the partials ------
  float lse[kRows];
  softmax::online_softmax_finalize<kRows, kOCols, QuadReduce>(o, state, softmax_scale_log2, 1.f, lse);
  ptx::cp_async_wait<0>();
  __syncthreads();  // the stage buffers become the merge buffer
  // [warp][row][kHeadDim + 1] fp32: the extra column holds the row's LSE, and the
  // odd pitch spreads the rows of one store over the banks.
  float* sO = reinterpret_cast<float*>(smem_raw);
  constexpr int kRowPitch = kHeadDim + 1;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    float* row = sO + (warp * 16 + g + 8 * r) * kRowPitch;
#pragma unroll
    for (int c = 0; c < kOCols; ++c)
      row[Config::kFp8Regs ? fp8_frag::o_col(c, lane) : (c / 2) * 8 + col0 + (c % 2)] = o[r][c];
    if (lane % 4 == 0) row[kHeadDim] = lse[r];
  }
  __syncthreads();

  const bool single = params.num_splits == 1;
  Elem* gO = static_cast<Elem*>(params.out);
  constexpr int kQuads = 16 * kHeadDim / 4;  // 4 consecutive columns per item
  for (int item = threadIdx.x; item < kQuads; item += kThreads) {
    const int row = item / (kHeadDim / 4);
    const int col = (item % (kHeadDim / 4)) * 4;
    const int packed = row0 + row;
    if (packed >= rows || col >= params.headdim) continue;
    float m = softmax::neg_inf();
#pragma unroll
    for (int w = 0; w < Config::kWarps; ++w) m = fmaxf(m, sO[(w * 16 + row) * kRowPitch + kHeadDim]);
    float total_lse = softmax::neg_inf();
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    if (m != softmax::neg_inf()) {
      // v_scale (1 without an FP8 cache) rides on the weights: O is linear in V.
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < Config::kWarps; ++w) sum += __expf(sO[(w * 16 + row) * kRowPitch + kHeadDim] - m);
      total_lse = m + __logf(sum);
#pragma unroll
      for (int w = 0; w < Config::kWarps; ++w) {
        const float* src = sO + (w * 16 + row) * kRowPitch;
        const float weight = v_scale * __expf(src[kHeadDim] - total_lse);  // exp(-inf) = 0 for an empty warp
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[e] += weight * src[col + e];
      }
    }
    const decode::OutputRow at{batch, head_k * group + packed % group, seq.q_start, packed / group};
    if (single) {
      Elem* dst = gO + at.out_offset(params) + col;
      uint2 packed_out;
      packed_out.x = ptx::ElemTraits<Elem>::pack(acc[0], acc[1]);
      packed_out.y = ptx::ElemTraits<Elem>::pack(acc[2], acc[3]);
      *reinterpret_cast<uint2*>(dst) = packed_out;
      if (col == 0 && params.lse != nullptr) params.lse[at.lse_offset(params)] = total_lse;
    } else {
      const int64_t row_index = at.partial_row(params, split);
      *reinterpret_cast<float4*>(params.o_partial + row_index * params.headdim + col) =
          make_float4(acc[0], acc[1], acc[2], acc[3]);
      if (col == 0) params.lse_partial[row_index] = total_lse;
    }
  }
}

}  // namespace cuda
}  // namespace portattn
