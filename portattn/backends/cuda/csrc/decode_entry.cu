// C entry points of the decode path (Note [portattn decode] in common/params.h):
// the split combine, the cache append with rotary, and the per-head-dim tile
// facts the Python split planner (portattn/decode.py) needs.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <mutex>

#include "../../common/rotary.h"
#include "decode_launch.cuh"
#include "fp8.cuh"
#include "variant_table.h"

namespace portattn {
namespace cuda {

namespace {

constexpr int kCombineWarps = 4;
// The planner never asks for more (decode.py: MAX_SPLITS); the combine keeps one
// weight per split in shared memory.
constexpr int kMaxSplits = 128;

template <typename Elem>
__device__ __forceinline__ float to_float(Elem x);
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename Elem>
__device__ __forceinline__ Elem from_float(float x);
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Max / sum across the 32 lanes of a warp (softmax::merged_lse's LaneReduce).
struct WarpReduce {
  static __device__ __forceinline__ float max(float x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
  }
  static __device__ __forceinline__ float sum(float x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
  }
};

// One block per output row (sequence, head, query): the LSE-weighted sum of the
// splits' normalised partial outputs (Note [portattn LSE merge] in online_softmax.h).
// Every warp computes the row's LSE from the
// split LSEs (a few loads per lane), then sums its own share of the splits (warp w
// takes splits w, w + kCombineWarps, ...) with several loads in flight; the warps'
// sums meet in shared memory. A row no split saw (every partial LSE -inf) gets
// out = 0 and lse = -inf, the forward kernels' convention.
template <typename Elem>
__global__ void __launch_bounds__(kCombineWarps * 32) decode_combine_kernel(const PortattnDecodeParams p) {
  constexpr int kMaxQuads = 256 / 4 / 32;  // float4 columns per lane at head dim 256
  constexpr int kUnroll = 4;
  __shared__ float4 sums[kCombineWarps][kMaxQuads * 32];
  wait_for_previous_grid();  // the decode kernel's partials
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t rows_total = static_cast<int64_t>(p.batch) * p.nheads * p.seqlen_q;
  const int64_t row = blockIdx.x;
  const decode::PartialRow partial = decode::PartialRow::of(p, row);
  if (!partial.in_sequence) return;  // uniform over the block
  const int splits = p.num_splits;
  const float lse = softmax::merged_lse<WarpReduce>(p.lse_partial + row, rows_total, splits, lane, 32);

  float4 acc[kMaxQuads];
#pragma unroll
  for (int j = 0; j < kMaxQuads; ++j) acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
  if (lse != softmax::neg_inf()) {
    for (int s0 = warp; s0 < splits; s0 += kCombineWarps * kUnroll) {
      float weight[kUnroll];
      float4 part[kUnroll][kMaxQuads];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {  // loads of kUnroll splits first, then the sums
        const int s = s0 + u * kCombineWarps;
        weight[u] = s < splits ? softmax::merge_weight(p.lse_partial[s * rows_total + row], lse) : 0.f;
#pragma unroll
        for (int j = 0; j < kMaxQuads; ++j) {
          const int col = (j * 32 + lane) * 4;
          part[u][j] = s < splits && col < p.headdim
                           ? *reinterpret_cast<const float4*>(p.o_partial + (s * rows_total + row) * p.headdim + col)
                           : make_float4(0.f, 0.f, 0.f, 0.f);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int j = 0; j < kMaxQuads; ++j) {
          acc[j].x += weight[u] * part[u][j].x;
          acc[j].y += weight[u] * part[u][j].y;
          acc[j].z += weight[u] * part[u][j].z;
          acc[j].w += weight[u] * part[u][j].w;
        }
    }
  }
#pragma unroll
  for (int j = 0; j < kMaxQuads; ++j) sums[warp][j * 32 + lane] = acc[j];
  __syncthreads();
  if (warp != 0) return;
  Elem* out = static_cast<Elem*>(p.out) + partial.out.out_offset(p);
#pragma unroll
  for (int j = 0; j < kMaxQuads; ++j) {
    const int col = (j * 32 + lane) * 4;
    if (col >= p.headdim) continue;
    float4 total = sums[0][j * 32 + lane];
#pragma unroll
    for (int w = 1; w < kCombineWarps; ++w) {
      const float4 other = sums[w][j * 32 + lane];
      total.x += other.x;
      total.y += other.y;
      total.z += other.z;
      total.w += other.w;
    }
    uint2 packed;
    packed.x = ptx::ElemTraits<Elem>::pack(total.x, total.y);
    packed.y = ptx::ElemTraits<Elem>::pack(total.z, total.w);
    *reinterpret_cast<uint2*>(out + col) = packed;
  }
  if (lane == 0 && p.lse != nullptr) p.lse[partial.out.lse_offset(p)] = lse;
}

// ---- append + rotary -------------------------------------------------------------

// The vendor part of rotary::Rotary (common/rotary.h): CUDA's 16-bit -> float conversions.
template <typename Elem_>
struct CudaRotaryFloats {
  using Elem = Elem_;
  using Bf16 = __nv_bfloat16;
  using Fp16 = __half;
  static __device__ __forceinline__ float of_elem(Elem x) { return to_float(x); }
  static __device__ __forceinline__ float of_bf16(Bf16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ float of_fp16(Fp16 x) { return __half2float(x); }
};

template <typename Elem>
using Rotary = rotary::Rotary<CudaRotaryFloats<Elem>>;

// One block per (token, head) row, one thread per element: rows of the new
// keys/values first (written into the cache), then the query rows (rotated
// into q_out). Tiny next to the decode itself; its own launch keeps one writer
// per cache element (no race between the CTAs of one KV head's splits).
// kFp8: the cache holds e4m3; a rotated key is rounded to Elem first (as the reference
// path rotates in the query's dtype), then quantised with its descale.
template <typename Elem, bool kFp8>
__global__ void kvcache_append_kernel(const PortattnAppendParams p) {
  wait_for_previous_grid();  // k_new, v_new, q and the lengths may come from the kernel before
  allow_next_grid();         // the decode kernel may be scheduled now; it waits for this grid
  const int e = threadIdx.x;
  const int64_t kv_rows = p.k_new != nullptr ? static_cast<int64_t>(p.batch) * p.seqlen_new * p.nheads_k : 0;
  int64_t row = blockIdx.x;
  const Rotary<Elem> rotary{p};
  if (row < kv_rows) {
    const int h = static_cast<int>(row % p.nheads_k);
    const int i = static_cast<int>((row / p.nheads_k) % p.seqlen_new);
    const int b = static_cast<int>(row / (static_cast<int64_t>(p.nheads_k) * p.seqlen_new));
    // Out-of-range metadata writes nothing (Note [portattn decode errors]); the first
    // element of the row reports it (the decode kernel reports it too: the same rule).
    const int filled = p.cache_seqlens[b];
    const bool reporter = e == 0 && h == 0;
    if (filled < 0 || filled > p.kv_capacity - p.seqlen_new) {
      if (reporter && i == 0) decode::record_error(p.errors, PORTATTN_ERR_CACHE_SEQLENS, b, filled);
      return;
    }
    const int pos = filled + i;
    if (e >= p.headdim) return;
    int64_t k_off, v_off;
    if (p.block_table != nullptr) {
      const int page = p.block_table[b * p.block_table_batch_stride + pos / p.page_size];
      if (page < 0 || page >= p.num_pages) {
        if (reporter) decode::record_error(p.errors, PORTATTN_ERR_BLOCK_TABLE, b, page);
        return;
      }
      const int in_page = pos % p.page_size;
      k_off = page * p.k_cache_strides.batch_stride + static_cast<int64_t>(in_page) * p.k_cache_strides.row_stride;
      v_off = page * p.v_cache_strides.batch_stride + static_cast<int64_t>(in_page) * p.v_cache_strides.row_stride;
    } else {
      const int entry = p.cache_batch_idx != nullptr ? p.cache_batch_idx[b] : b;
      if (entry < 0 || entry >= p.cache_batches) {
        if (reporter && i == 0) decode::record_error(p.errors, PORTATTN_ERR_CACHE_BATCH_IDX, b, entry);
        return;
      }
      k_off = entry * p.k_cache_strides.batch_stride + static_cast<int64_t>(pos) * p.k_cache_strides.row_stride;
      v_off = entry * p.v_cache_strides.batch_stride + static_cast<int64_t>(pos) * p.v_cache_strides.row_stride;
    }
    k_off += h * p.k_cache_strides.head_stride + e;
    v_off += h * p.v_cache_strides.head_stride + e;
    const Elem* k_src = static_cast<const Elem*>(p.k_new) + b * p.k_new_strides.batch_stride +
                        i * p.k_new_strides.row_stride + h * p.k_new_strides.head_stride;
    const Elem* v_src = static_cast<const Elem*>(p.v_new) + b * p.v_new_strides.batch_stride +
                        i * p.v_new_strides.row_stride + h * p.v_new_strides.head_stride;
    const Elem key = from_float<Elem>(rotary.apply(k_src, e, pos));
    if constexpr (kFp8) {
      const PortattnKvDescale& kv = p.kv;
      static_cast<uint8_t*>(p.k_cache)[k_off] = fp8::quantize(
          to_float(key), fp8::descale_of(kv.k_descale, kv.k_descale_batch_stride, kv.k_descale_head_stride, b, h));
      static_cast<uint8_t*>(p.v_cache)[v_off] = fp8::quantize(
          to_float(v_src[e]), fp8::descale_of(kv.v_descale, kv.v_descale_batch_stride, kv.v_descale_head_stride, b, h));
    } else {
      static_cast<Elem*>(p.k_cache)[k_off] = key;
      static_cast<Elem*>(p.v_cache)[v_off] = v_src[e];
    }
    return;
  }
  row -= kv_rows;
  const int h = static_cast<int>(row % p.nheads);
  const int i = static_cast<int>((row / p.nheads) % p.seqlen_q);
  const int b = static_cast<int>(row / (static_cast<int64_t>(p.nheads) * p.seqlen_q));
  if (e >= p.headdim) return;
  const int pos = p.cache_seqlens[b] + (p.q_position_per_token ? i : 0);
  const Elem* q_src = static_cast<const Elem*>(p.q) + b * p.q_strides.batch_stride + i * p.q_strides.row_stride +
                      h * p.q_strides.head_stride;
  Elem* q_dst = static_cast<Elem*>(p.q_out) + b * p.q_out_strides.batch_stride + i * p.q_out_strides.row_stride +
                h * p.q_out_strides.head_stride;
  q_dst[e] = from_float<Elem>(rotary.apply(q_src, e, pos));
}

// Static tile facts of the 16-bit-cache kernels (build_config's budgets; the planner asks
// portattn_cuda_decode_occupancy, which knows the FP8 path and the device).
template <bool kFp8>
void decode_tile_of(int head_dim, int* stage_keys, int* threads, int* smem_bytes) {
  *stage_keys = *threads = *smem_bytes = -1;
  with_instantiable_head_dim(head_dim, [&](auto hd) {
    using Tile = DecodeTileConfig<decltype(hd)::value, kFp8>;
    *stage_keys = Tile::kStageKeys;
    *threads = Tile::kThreads;
    *smem_bytes = Tile::kSmemBytes;
  });
}

bool fp8_cache(int cache_dtype) { return cache_dtype == PORTATTN_CACHE_FP8_E4M3; }

// PORTATTN_DECODE_FP8_PATH (tuning; docs/environment.md): "regs" (unset, the default) reads the
// e4m3 bytes into mma operand registers and converts them there (Note [portattn fp8 register
// fragments], docs/decode.md); "regs_deep" does so with kFp8DeepStages stages (Note [portattn fp8
// deep pipeline]); "smem" converts each stage through a 16-bit stage in shared memory. Read once,
// at the first FP8 decode call; portattn_cuda_decode_fp8_path changes it afterwards (tests and the
// A/B run every path in one process).
constexpr const char* kFp8PathEnv = "PORTATTN_DECODE_FP8_PATH";
std::atomic<int> g_fp8_path{kDecodeFp8Regs};
std::once_flag g_fp8_path_once;

int fp8_path_from_text(const char* text) {
  if (text == nullptr || *text == '\0' || strcmp(text, "regs") == 0) return kDecodeFp8Regs;
  if (strcmp(text, "smem") == 0) return kDecodeFp8Smem;
  if (strcmp(text, "regs_deep") == 0) return kDecodeFp8RegsDeep;
  return kDecodeFp8Invalid;
}

int fp8_path_now() {
  std::call_once(g_fp8_path_once, [] { g_fp8_path.store(fp8_path_from_text(getenv(kFp8PathEnv))); });
  return g_fp8_path.load();
}

// The loads move 16-byte chunks: 8 elements of a 16-bit cache, 16 of an e4m3 one.
bool cache_strides_aligned(const PortattnTensor4& s, bool fp8) {
  return fp8 ? s.batch_stride % 16 == 0 && s.row_stride % 16 == 0 && s.head_stride % 16 == 0 : strides_aligned(s);
}

bool decode_strides_aligned(const PortattnDecodeParams& p) {
  const bool fp8 = fp8_cache(p.kv.cache_dtype);
  return aligned16(p.q) && aligned16(p.k) && aligned16(p.v) && aligned16(p.out) &&
         strides_aligned(p.q_strides) && cache_strides_aligned(p.k_strides, fp8) &&
         cache_strides_aligned(p.v_strides, fp8) && strides_aligned(p.out_strides);
}

}  // namespace

cudaError_t launch_decode_combine(const PortattnDecodeParams& params) {
  const dim3 blocks(static_cast<unsigned>(static_cast<int64_t>(params.batch) * params.nheads * params.seqlen_q));
  const cudaStream_t stream = static_cast<cudaStream_t>(params.stream);
  if (params.dtype == PORTATTN_BF16)
    return launch_overlapped(&decode_combine_kernel<__nv_bfloat16>, blocks, dim3(kCombineWarps * 32), 0, stream, params);
  return launch_overlapped(&decode_combine_kernel<__half>, blocks, dim3(kCombineWarps * 32), 0, stream, params);
}

DecodeFp8Path decode_fp8_path() { return static_cast<DecodeFp8Path>(fp8_path_now()); }

bool pdl_supported() {
  static std::mutex mutex;
  static unsigned long long known = 0, supported = 0;  // bit d: device d asked / sm90+
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device >= 64) return false;
  const unsigned long long bit = 1ull << device;
  std::lock_guard<std::mutex> lock(mutex);
  if (!(known & bit)) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major >= 9)
      supported |= bit;
    known |= bit;
  }
  return (supported & bit) != 0;
}

}  // namespace cuda
}  // namespace portattn

using namespace portattn::cuda;

extern "C" int portattn_cuda_decode_occupancy(int head_dim, int dtype, int cache_dtype, int extras, int* facts);

// Tile facts of the decode kernel serving `head_dim` (-1s when none is built); cache_dtype is a
// PortattnCacheDtype. An e4m3 cache's are those of the FP8 path in effect on the current device
// (portattn_cuda_decode_occupancy's, without softcap/ALiBi).
extern "C" void portattn_cuda_decode_tile(int head_dim, int cache_dtype, int* stage_keys, int* threads,
                                          int* smem_bytes) {
  *stage_keys = *threads = *smem_bytes = -1;
  if (fp8_cache(cache_dtype)) {
    int facts[6];
    if (portattn_cuda_decode_occupancy(head_dim, PORTATTN_FP16, cache_dtype, 0, facts) != 0 &&
        portattn_cuda_decode_occupancy(head_dim, PORTATTN_BF16, cache_dtype, 0, facts) != 0)
      return;
    *stage_keys = facts[0];
    *threads = facts[1];
    *smem_bytes = facts[2];
    return;
  }
  const DecodeVariant* variant = find_variant(kDecodeVariants, kNumDecodeVariants, head_dim, PORTATTN_FP16);
  if (variant == nullptr) variant = find_variant(kDecodeVariants, kNumDecodeVariants, head_dim, PORTATTN_BF16);
  if (variant != nullptr) decode_tile_of<false>(variant->head_dim, stage_keys, threads, smem_bytes);
}

// What a decode call of (head_dim, dtype, cache_dtype; extras: softcap or ALiBi) would launch on
// the current device, for the split planner: facts[0..5] = keys per stage, threads, dynamic shared
// memory bytes, stages, registers per thread, resident CTAs per SM (the occupancy calculator's,
// with that shared memory). An e4m3 cache's kernel is the one of the FP8 path in effect
// (PORTATTN_DECODE_FP8_PATH), regs_deep's fallback under a small budget included. Returns 0, -1
// when no kernel is built for the arguments, or the CUDA error (facts[5] then -1).
extern "C" int portattn_cuda_decode_occupancy(int head_dim, int dtype, int cache_dtype, int extras, int* facts) {
  for (int i = 0; i < 6; ++i) facts[i] = -1;
  const bool fp8 = fp8_cache(cache_dtype);
  const DecodeVariant* variant =
      fp8 ? find_variant(kDecodeFp8Variants, kNumDecodeFp8Variants, head_dim, dtype)
          : find_variant(kDecodeVariants, kNumDecodeVariants, head_dim, dtype);
  if (variant == nullptr || variant->query == nullptr || (fp8 && fp8_path_now() == kDecodeFp8Invalid)) return -1;
  DecodeTileFacts out;
  const cudaError_t err = variant->query(extras != 0, &out);
  facts[0] = out.stage_keys;
  facts[1] = out.threads;
  facts[2] = out.smem_bytes;
  facts[3] = out.stages;
  facts[4] = out.registers;
  facts[5] = err == cudaSuccess ? out.ctas_per_sm : -1;
  return static_cast<int>(err);
}

extern "C" int portattn_cuda_decode(const PortattnDecodeParams* params, char* message, int message_len) {
  const bool fp8 = fp8_cache(params->kv.cache_dtype);
  if (params->kv.cache_dtype != PORTATTN_CACHE_AS_QUERY && !fp8) {
    return fail(message, message_len, -1, "portattn cuda decode: unknown cache_dtype");
  }
  const DecodeVariant* variant =
      fp8 ? find_variant(kDecodeFp8Variants, kNumDecodeFp8Variants, params->headdim, params->dtype)
          : find_variant(kDecodeVariants, kNumDecodeVariants, params->headdim, params->dtype);
  if (variant == nullptr) {
    char text[160];
    snprintf(text, sizeof(text), "portattn cuda: no decode kernel built for head_dim %d dtype %d%s",
             params->headdim, params->dtype, fp8 ? " with an e4m3 cache" : "");
    return fail(message, message_len, -1, text);
  }
  if (fp8 && fp8_path_now() == kDecodeFp8Invalid) {
    char text[200];
    snprintf(text, sizeof(text), "portattn cuda decode: %s is '%s'; expected 'regs' (default), 'regs_deep' or 'smem'",
             kFp8PathEnv, getenv(kFp8PathEnv) ? getenv(kFp8PathEnv) : "");
    return fail(message, message_len, -1, text);
  }
  if (fp8 && (params->headdim % 16 != 0 || params->cu_seqlens_k != nullptr)) {
    return fail(message, message_len, -1,
                "portattn cuda decode: an e4m3 cache needs headdim % 16 == 0 and a cache layout (no cu_seqlens_k)");
  }
  if (!decode_strides_aligned(*params)) {
    return fail(message, message_len, -1,
                "portattn cuda decode: q, the caches and out need 16-byte aligned data pointers and "
                "strides that are multiples of 16 bytes (8 fp16/bf16 elements, 16 e4m3 ones)");
  }
  if (params->nheads_k <= 0 || params->nheads % params->nheads_k != 0 || params->headdim % 8 != 0) {
    return fail(message, message_len, -1, "portattn cuda decode: nheads % nheads_k and headdim % 8 must be 0");
  }
  if (params->num_splits < 1 || params->num_splits > kMaxSplits ||
      (params->num_splits > 1 && (params->o_partial == nullptr || params->lse_partial == nullptr ||
                                  !aligned16(params->o_partial)))) {
    char text[200];
    snprintf(text, sizeof(text),
             "portattn cuda decode: num_splits %d must be in [1, %d], with an aligned workspace above 1",
             params->num_splits, kMaxSplits);
    return fail(message, message_len, -1, text);
  }
  if (params->block_table != nullptr && (params->page_size <= 0 || params->num_pages <= 0)) {
    return fail(message, message_len, -1, "portattn cuda decode: a paged cache needs page_size and num_pages > 0");
  }
  set_error_detail("");
  const cudaError_t err = variant->run(*params);
  if (err != cudaSuccess) {
    char text[400];
    snprintf(text, sizeof(text), "portattn cuda decode: %s%s%s", cudaGetErrorString(err),
             last_error_detail()[0] ? ": " : "", last_error_detail());
    return fail(message, message_len, static_cast<int>(err), text);
  }
  return 0;
}

// The FP8 decode path (PORTATTN_DECODE_FP8_PATH; tuning): 0 = smem, 1 = regs, 2 = regs_deep sets
// it for the calls that follow; any other value only reads it. Returns the path now in effect
// (-1: the environment variable names none, and FP8 decode calls fail until a path is set).
extern "C" int portattn_cuda_decode_fp8_path(int path) {
  fp8_path_now();  // the environment's value first, so a later first read cannot undo the set
  if (path == kDecodeFp8Smem || path == kDecodeFp8Regs || path == kDecodeFp8RegsDeep) g_fp8_path.store(path);
  return g_fp8_path.load();
}

extern "C" int portattn_cuda_kvcache_append(const PortattnAppendParams* params, char* message, int message_len) {
  const PortattnAppendParams& p = *params;
  const bool fp8 = fp8_cache(p.kv.cache_dtype);
  if (p.kv.cache_dtype != PORTATTN_CACHE_AS_QUERY && !fp8) {
    return fail(message, message_len, -1, "portattn cuda append: unknown cache_dtype");
  }
  if (p.headdim <= 0 || p.headdim > 1024 || (p.rotary_dim % 2) != 0 || p.rotary_dim > p.headdim) {
    return fail(message, message_len, -1,
                "portattn cuda append: headdim must be in [1, 1024] and rotary_dim even and <= headdim");
  }
  if (p.rotary_dim > 0 && (p.rotary_cos == nullptr || p.rotary_sin == nullptr || p.seqlen_ro <= 0)) {
    return fail(message, message_len, -1, "portattn cuda append: rotary needs cos, sin and seqlen_ro > 0");
  }
  if (p.cache_seqlens == nullptr || (p.q != nullptr && (p.q_out == nullptr || p.q_out == p.q))) {
    // Rows are placed by cache_seqlens; queries are rotated out of place (the kernel
    // reads each element's rotary partner while other threads write theirs).
    return fail(message, message_len, -1,
                "portattn cuda append: needs cache_seqlens, and q_out distinct from q");
  }
  const int64_t kv_rows = p.k_new != nullptr ? static_cast<int64_t>(p.batch) * p.seqlen_new * p.nheads_k : 0;
  const int64_t q_rows = p.q != nullptr ? static_cast<int64_t>(p.batch) * p.seqlen_q * p.nheads : 0;
  const int64_t blocks = kv_rows + q_rows;
  if (blocks == 0) return 0;
  const dim3 threads((p.headdim + 31) / 32 * 32);
  const cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const dim3 grid(static_cast<unsigned>(blocks));
  cudaError_t err;
  if (p.dtype == PORTATTN_BF16)
    err = fp8 ? launch_overlapped(&kvcache_append_kernel<__nv_bfloat16, true>, grid, threads, 0, stream, p)
              : launch_overlapped(&kvcache_append_kernel<__nv_bfloat16, false>, grid, threads, 0, stream, p);
  else
    err = fp8 ? launch_overlapped(&kvcache_append_kernel<__half, true>, grid, threads, 0, stream, p)
              : launch_overlapped(&kvcache_append_kernel<__half, false>, grid, threads, 0, stream, p);
  if (err != cudaSuccess) {
    char text[200];
    snprintf(text, sizeof(text), "portattn cuda append: %s", cudaGetErrorString(err));
    return fail(message, message_len, static_cast<int>(err), text);
  }
  return 0;
}
