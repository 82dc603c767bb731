// The ROCm decode pieces both kernel families share (CDNA: decode_kernel.h,
// RDNA: wmma_decode_kernel.h): where a sequence's key rows are read from,
// the containment scan of its block-table row, the split combine and the
// cache append with rotary (and e4m3 quantisation: fp8.h). A Tile supplies kWaveLanes (64 on CDNA, 32 on
// RDNA) and kHeadDim; nothing here uses a matrix instruction.
#pragma once
#include <limits.h>
#include <math.h>

#include "cdna.h"  // first: hip_runtime.h defines __forceinline__ for the common headers

#include "../../common/decode_sequence.h"
#include "../../common/online_softmax.h"
#include "../../common/params.h"
#include "../../common/rotary.h"
#include "fp8.h"
#include "tiles.h"

namespace portattn {
namespace rocm {
namespace PORTATTN_ROCM_ARCH_NS {

// Where the key reads of one (sequence, KV head) go, with the wave-uniform
// values in VGPRs (in_vgpr, cdna.h): the per-key address arithmetic needs
// them every stage, and as SGPRs they would take ~20 of the ~100 a wave has,
// which the kernel's other uniform values (window, scale, softcap, output
// addressing) and the unrolled D = 256 loop already nearly fill. Elem: uint16_t
// (a cache of the query's dtype) or uint8_t (e4m3; strides count bytes).
template <class Elem>
struct KeySource {
  const Elem* gK;  // head hk of k and v
  const Elem* gV;
  PortattnTensor4 k_strides, v_strides;  // batch (page) and row strides
  decode::KeyRowAddress at;
  int seqlen_k, key_base, cache_row, headdim;

  __device__ __forceinline__ static KeySource of(const PortattnDecodeParams& p, const decode::Sequence& seq, int b,
                                                 int hk) {
    auto vgpr64 = [](int64_t x) { return static_cast<int64_t>(in_vgpr(static_cast<uint64_t>(x))); };
    auto vgpr32 = [](int x) { return static_cast<int>(in_vgpr(static_cast<uint32_t>(x))); };
    const Elem* k = static_cast<const Elem*>(p.k) + hk * p.k_strides.head_stride;
    const Elem* v = static_cast<const Elem*>(p.v) + hk * p.v_strides.head_stride;
    KeySource src;
    src.gK = reinterpret_cast<const Elem*>(in_vgpr(reinterpret_cast<uint64_t>(k)));
    src.gV = reinterpret_cast<const Elem*>(in_vgpr(reinterpret_cast<uint64_t>(v)));
    src.k_strides = PortattnTensor4{vgpr64(p.k_strides.batch_stride), vgpr64(p.k_strides.row_stride), 0};
    src.v_strides = PortattnTensor4{vgpr64(p.v_strides.batch_stride), vgpr64(p.v_strides.row_stride), 0};
    const int32_t* pages = p.block_table != nullptr ? p.block_table + b * p.block_table_batch_stride : nullptr;
    src.at = decode::KeyRowAddress{
        reinterpret_cast<const int32_t*>(in_vgpr(reinterpret_cast<uint64_t>(pages))), vgpr32(p.page_size),
        vgpr32(p.num_pages)};
    src.seqlen_k = vgpr32(seq.seqlen_k);
    src.key_base = vgpr32(seq.key_base);
    src.cache_row = vgpr32(seq.cache_row);
    src.headdim = vgpr32(p.headdim);
    return src;
  }
};

// The FP8 descales of (b, hk) as both decode kernels apply them (Note [portattn fp8 kv cache]):
// k_descale folded into the score scale, v_descale multiplying the output. Read once and kept in
// VGPRs (in_vgpr): their pointers, strides and values as SGPRs spilled 6-10 SGPRs of the D = 256
// kernel on gfx942 and 2 on gfx1201. 16-bit caches: the softmax scale and 1.
struct KvScales {
  float score;
  float v;
};

template <bool kFp8>
__device__ __forceinline__ KvScales kv_scales(const PortattnDecodeParams& p, int b, int hk) {
  if constexpr (!kFp8) {
    return {p.softmax_scale, 1.f};
  } else {
    const PortattnKvDescale& kv = p.kv;
    auto vgpr_float = [](float x) { return __builtin_bit_cast(float, in_vgpr(__builtin_bit_cast(uint32_t, x))); };
    return {vgpr_float(p.softmax_scale * fp8::descale_of(kv.k_descale, kv.k_descale_batch_stride,
                                                         kv.k_descale_head_stride, b, hk)),
            vgpr_float(fp8::descale_of(kv.v_descale, kv.v_descale_batch_stride, kv.v_descale_head_stride, b, hk))};
  }
}

// Whether `predicate` holds for some lane of the workgroup; every lane must
// call it. `lds_word` is one int of the caller's LDS that no lane touches
// between the call and the caller's next barrier. (HIP's __syncthreads_or
// would add the device library's 256-byte reduction buffer to every decode
// kernel's LDS.)
__device__ __forceinline__ bool workgroup_any(bool predicate, int* lds_word) {
  if (threadIdx.x == 0) *lds_word = 0;
  __syncthreads();
  if (predicate) atomicOr(lds_word, 1);
  __syncthreads();
  return *lds_word != 0;
}

// Sequence b, contained when its metadata is out of range (Note [portattn decode
// errors] in params.h). Every workgroup of the sequence scans the block-table
// slots its keys occupy (kThreads lanes share the scan), so all its splits agree
// and no key of another sequence's page is read; `reporter` (one workgroup per
// sequence) records the offending argument. Every lane of the workgroup must call
// it; `lds_word` as for workgroup_any.
template <int kThreads>
__device__ __forceinline__ decode::Sequence contained_sequence(const PortattnDecodeParams& p, int b, bool reporter,
                                                               int* lds_word) {
  decode::Sequence seq = decode::Sequence::of(p, b);
  if (p.block_table != nullptr) {
    const int32_t* pages = p.block_table + b * p.block_table_batch_stride;
    const int bad_slot =
        decode::first_bad_page_slot(pages, p.page_size, p.num_pages, seq.key_base, seq.seqlen_k, threadIdx.x, kThreads);
    if (workgroup_any(bad_slot >= 0, lds_word)) {
      if (reporter && bad_slot >= 0) decode::record_error(p.errors, PORTATTN_ERR_BLOCK_TABLE, b, pages[bad_slot]);
      seq.contain();
    }
  }
  if (reporter && threadIdx.x == 0 && seq.seqlen_k == 0 && p.errors != nullptr) {
    int value = 0;
    const int argument = decode::metadata_error(p, b, &value);
    if (argument >= 0) decode::record_error(p.errors, argument, b, value);
  }
  return seq;
}

// ---- split combine ---------------------------------------------------------------

constexpr int kCombineWaves = 4;

// Max / sum across the kLanes lanes of a wave (softmax::merged_lse's LaneReduce).
template <int kLanes>
struct WaveReduce {
  static __device__ __forceinline__ float max(float x) {
#pragma unroll
    for (int mask = kLanes / 2; mask > 0; mask /= 2) x = fmaxf(x, __shfl_xor(x, mask));
    return x;
  }
  static __device__ __forceinline__ float sum(float x) {
#pragma unroll
    for (int mask = kLanes / 2; mask > 0; mask /= 2) x += __shfl_xor(x, mask);
    return x;
  }
};

// One wave per output row (sequence, head, query): the LSE-weighted sum of the
// splits' normalised partial outputs (Note [portattn LSE merge] in
// online_softmax.h). A row no split saw (every partial LSE
// -inf) gets out = 0 and lse = -inf, the forward kernels' convention. The
// weights are recomputed per column group from the partial LSEs (cached
// reads, one exp each) rather than staged in LDS: no barrier, no split limit.
// Templated on the tile only so every instantiation unit has its own symbol.
template <class Tile>
__global__ void PORTATTN_LAUNCH_BOUNDS(kCombineWaves * Tile::kWaveLanes, 2)
    decode_combine_kernel(const PortattnDecodeParams p) {
  constexpr int kLanes = Tile::kWaveLanes;
  const int wave = threadIdx.x / kLanes, lane = threadIdx.x % kLanes;
  const int64_t rows_total = static_cast<int64_t>(p.batch) * p.nheads * p.seqlen_q;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kCombineWaves + wave;
  if (row >= rows_total) return;  // whole waves: the shuffles below stay wave-uniform
  const decode::PartialRow partial = decode::PartialRow::of(p, row);
  if (!partial.in_sequence) return;
  const int splits = p.num_splits;
  uint16_t* gO = static_cast<uint16_t*>(p.out) + partial.out.out_offset(p);
  // A split that met an out-of-range page number (the CDNA decode reads none of its rows) left a
  // +inf partial LSE, which no attended key gives: the row is contained, out 0 and lse -inf.
  float top = softmax::neg_inf();
  for (int s = lane; s < splits; s += kLanes) top = fmaxf(top, p.lse_partial[s * rows_total + row]);
  if (WaveReduce<kLanes>::max(top) == __builtin_huge_valf()) {
    for (int col = lane * 4; col < p.headdim; col += kLanes * 4) store<u16x4>(gO + col, u16x4{0, 0, 0, 0});
    if (lane == 0 && p.lse != nullptr) p.lse[partial.out.lse_offset(p)] = softmax::neg_inf();
    return;
  }
  const float lse = softmax::merged_lse<WaveReduce<kLanes>>(p.lse_partial + row, rows_total, splits, lane, kLanes);

  for (int col = lane * 4; col < p.headdim; col += kLanes * 4) {
    f32x4 acc{0.f, 0.f, 0.f, 0.f};
    for (int s = 0; s < splits; ++s) {
      const float l = p.lse_partial[s * rows_total + row];
      if (lse == softmax::neg_inf() || l == softmax::neg_inf()) continue;  // an empty split
      const float weight = softmax::merge_weight(l, lse);
      acc += weight * load<f32x4>(p.o_partial + (s * rows_total + row) * p.headdim + col);
    }
    store<u16x4>(gO + col, pack4<Tile::kIsBf16>(acc.x, acc.y, acc.z, acc.w));
  }
  if (lane == 0 && p.lse != nullptr) p.lse[partial.out.lse_offset(p)] = lse;
}

// ---- append + rotary -------------------------------------------------------------

// The vendor part of rotary::Rotary (common/rotary.h): rows and tables as 16-bit words.
template <bool kIsBf16>
struct RocmRotaryFloats {
  using Elem = uint16_t;
  using Bf16 = uint16_t;
  using Fp16 = uint16_t;
  static __device__ __forceinline__ float of_elem(uint16_t bits) { return Dtype<kIsBf16>::to_float(bits); }
  static __device__ __forceinline__ float of_bf16(uint16_t bits) { return Dtype<true>::to_float(bits); }
  static __device__ __forceinline__ float of_fp16(uint16_t bits) { return Dtype<false>::to_float(bits); }
};

template <bool kIsBf16>
using Rotary = rotary::Rotary<RocmRotaryFloats<kIsBf16>>;

// One workgroup per (token, head) row, one lane per column: the new keys /
// values first (written into the cache at cache_seqlens[b] + i, keys rotated
// there), then the queries (rotated into q_out). Every lane reads before the
// barrier and writes after it, so q_out may alias q. Its own launch before
// the decode keeps one writer per cache element. A null cache_seqlens counts
// as 0 (the ABI requires it; this only keeps a bad call from faulting). An e4m3
// cache (p.kv.cache_dtype) takes e4m3(x / descale) bytes (fp8::quantize) of the
// rotated key rounded to the query's dtype first, as the reference path and the
// CUDA append.
template <class Tile>
__global__ void PORTATTN_LAUNCH_BOUNDS(Tile::kHeadDim, 1) kvcache_append_kernel(const PortattnAppendParams p) {
  using T = Dtype<Tile::kIsBf16>;
  const int e = threadIdx.x;
  const int64_t kv_rows = p.k_new != nullptr ? static_cast<int64_t>(p.batch) * p.seqlen_new * p.nheads_k : 0;
  int64_t row = blockIdx.x;
  const Rotary<Tile::kIsBf16> rotary{p};
  bool write = e < p.headdim;
  if (row < kv_rows) {
    const int hk = static_cast<int>(row % p.nheads_k);
    const int i = static_cast<int>((row / p.nheads_k) % p.seqlen_new);
    const int b = static_cast<int>(row / (static_cast<int64_t>(p.nheads_k) * p.seqlen_new));
    // Out-of-range metadata writes nothing (Note [portattn decode errors] in params.h).
    const int filled = p.cache_seqlens != nullptr ? p.cache_seqlens[b] : 0;
    const bool reporter = e == 0 && hk == 0;
    const bool filled_ok = filled >= 0 && filled <= p.kv_capacity - p.seqlen_new;
    if (!filled_ok && reporter && i == 0) decode::record_error(p.errors, PORTATTN_ERR_CACHE_SEQLENS, b, filled);
    const int pos = filled + i;
    write = write && filled_ok;
    const int safe_pos = write ? pos : 0;
    int64_t k_off, v_off;
    if (p.block_table != nullptr) {
      const decode::KeyRowAddress at{p.block_table + b * p.block_table_batch_stride, p.page_size, p.num_pages};
      const int page = filled_ok ? at.pages[at.page_of_slot(pos)] : 0;
      if (page < 0 || page >= p.num_pages) {
        if (reporter) decode::record_error(p.errors, PORTATTN_ERR_BLOCK_TABLE, b, page);
        write = false;
      }
      k_off = at.offset(p.k_cache_strides, 0, safe_pos);
      v_off = at.offset(p.v_cache_strides, 0, safe_pos);
    } else {
      const int raw_entry = p.cache_batch_idx != nullptr ? p.cache_batch_idx[b] : b;
      if (raw_entry < 0 || raw_entry >= p.cache_batches) {
        if (reporter && i == 0 && filled_ok) decode::record_error(p.errors, PORTATTN_ERR_CACHE_BATCH_IDX, b, raw_entry);
        write = false;
      }
      const int entry = decode::clamp_int(raw_entry, 0, p.cache_batches - 1);
      k_off = entry * p.k_cache_strides.batch_stride + static_cast<int64_t>(safe_pos) * p.k_cache_strides.row_stride;
      v_off = entry * p.v_cache_strides.batch_stride + static_cast<int64_t>(safe_pos) * p.v_cache_strides.row_stride;
    }
    const uint16_t* k_src = static_cast<const uint16_t*>(p.k_new) + b * p.k_new_strides.batch_stride +
                            static_cast<int64_t>(i) * p.k_new_strides.row_stride + hk * p.k_new_strides.head_stride;
    const uint16_t* v_src = static_cast<const uint16_t*>(p.v_new) + b * p.v_new_strides.batch_stride +
                            static_cast<int64_t>(i) * p.v_new_strides.row_stride + hk * p.v_new_strides.head_stride;
    uint16_t k_value = 0, v_value = 0;
    if (write) {
      k_value = T::from_float(rotary.apply(k_src, e, pos));
      v_value = v_src[e];
    }
    __syncthreads();  // uniform: reads before writes (see above)
    k_off += hk * p.k_cache_strides.head_stride + e;
    v_off += hk * p.v_cache_strides.head_stride + e;
    if (write && p.kv.cache_dtype == PORTATTN_CACHE_FP8_E4M3) {
      const PortattnKvDescale& kv = p.kv;
      static_cast<uint8_t*>(p.k_cache)[k_off] = fp8::quantize(
          T::to_float(k_value), fp8::descale_of(kv.k_descale, kv.k_descale_batch_stride, kv.k_descale_head_stride, b, hk));
      static_cast<uint8_t*>(p.v_cache)[v_off] = fp8::quantize(
          T::to_float(v_value), fp8::descale_of(kv.v_descale, kv.v_descale_batch_stride, kv.v_descale_head_stride, b, hk));
    } else if (write) {
      static_cast<uint16_t*>(p.k_cache)[k_off] = k_value;
      static_cast<uint16_t*>(p.v_cache)[v_off] = v_value;
    }
    return;
  }
  row -= kv_rows;
  const int h = static_cast<int>(row % p.nheads);
  const int i = static_cast<int>((row / p.nheads) % p.seqlen_q);
  const int b = static_cast<int>(row / (static_cast<int64_t>(p.nheads) * p.seqlen_q));
  const int pos = (p.cache_seqlens != nullptr ? p.cache_seqlens[b] : 0) + (p.q_position_per_token ? i : 0);
  const uint16_t* q_src = static_cast<const uint16_t*>(p.q) + b * p.q_strides.batch_stride +
                          static_cast<int64_t>(i) * p.q_strides.row_stride + h * p.q_strides.head_stride;
  const uint16_t q_value = write ? T::from_float(rotary.apply(q_src, e, pos)) : 0;
  __syncthreads();
  if (write) {
    static_cast<uint16_t*>(p.q_out)[b * p.q_out_strides.batch_stride +
                                    static_cast<int64_t>(i) * p.q_out_strides.row_stride +
                                    h * p.q_out_strides.head_stride + e] = q_value;
  }
}

// The split combine after a decode launch with p.num_splits > 1.
template <class Tile>
hipError_t launch_decode_combine(const PortattnDecodeParams& p) {
  const int64_t rows = static_cast<int64_t>(p.batch) * p.nheads * p.seqlen_q;
  const dim3 combine_grid(static_cast<unsigned>((rows + kCombineWaves - 1) / kCombineWaves));
  hipLaunchKernelGGL(decode_combine_kernel<Tile>, combine_grid, dim3(kCombineWaves * Tile::kWaveLanes), 0,
                     static_cast<hipStream_t>(p.stream), p);
  return hipGetLastError();
}

template <class Tile>
hipError_t launch_kvcache_append(const PortattnAppendParams& p) {
  const int64_t kv_rows = p.k_new != nullptr ? static_cast<int64_t>(p.batch) * p.seqlen_new * p.nheads_k : 0;
  const int64_t q_rows = p.q != nullptr ? static_cast<int64_t>(p.batch) * p.seqlen_q * p.nheads : 0;
  if (kv_rows + q_rows == 0) return hipSuccess;
  hipLaunchKernelGGL(kvcache_append_kernel<Tile>, dim3(static_cast<unsigned>(kv_rows + q_rows)),
                     dim3(Tile::kHeadDim), 0, static_cast<hipStream_t>(p.stream), p);
  return hipGetLastError();
}

}  // namespace PORTATTN_ROCM_ARCH_NS
}  // namespace rocm
}  // namespace portattn
