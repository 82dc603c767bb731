// The merge kernel (Note [portattn merge attention states] in merge.h), one body for CUDA
// and HIP. The including file provides, in namespace portattn::merge, before the include:
//   float half_bits_to_float(uint16_t);  uint16_t float_to_half_bits(float);
// and defines PORTATTN_MERGE_SYNC() as its block-wide barrier.
//
// Thread layout: a group of G = 2^group_log2 consecutive threads (G <= 32, so a group never
// crosses a block) owns one (batch, token, head) row; its lanes stride over the row's
// chunks of kVec elements. Rows are numbered head fastest, so consecutive groups touch
// consecutive memory of a (batch, seqlen, nheads, headdim) tensor.
#pragma once
#include <stdint.h>

#include "merge.h"

namespace portattn {
namespace merge {

struct Bf16 {
  uint16_t bits;
};
struct Fp16 {
  uint16_t bits;
};

union FloatBits {
  float f;
  uint32_t u;
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(Bf16 x) {
  FloatBits v;
  v.u = static_cast<uint32_t>(x.bits) << 16;  // exact
  return v.f;
}
__device__ __forceinline__ float to_float(Fp16 x) { return half_bits_to_float(x.bits); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ Bf16 from_float<Bf16>(float x) {
  // Round to nearest even, as torch's .to(torch.bfloat16); NaN stays a quiet NaN.
  FloatBits v;
  v.f = x;
  if ((v.u & 0x7fffffffu) > 0x7f800000u) return Bf16{static_cast<uint16_t>((v.u >> 16) | 0x40u)};
  v.u += 0x7fffu + ((v.u >> 16) & 1u);
  return Bf16{static_cast<uint16_t>(v.u >> 16)};
}
template <>
__device__ __forceinline__ Fp16 from_float<Fp16>(float x) { return Fp16{float_to_half_bits(x)}; }

template <typename T>
struct alignas(16) Pack16 {
  T e[16 / sizeof(T)];
};

// kVec elements at p into v: 16-byte accesses when kVec == 8 (the caller checked alignment).
template <typename T, int kVec>
__device__ __forceinline__ void load(const T* p, float (&v)[kVec]) {
  if (kVec == 8) {
    constexpr int kPer = 16 / sizeof(T);
#pragma unroll
    for (int i = 0; i < kVec / kPer; ++i) {
      const Pack16<T> pack = reinterpret_cast<const Pack16<T>*>(p)[i];
#pragma unroll
      for (int j = 0; j < kPer; ++j) v[i * kPer + j] = to_float(pack.e[j]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kVec; ++i) v[i] = to_float(p[i]);
  }
}

template <typename T, int kVec>
__device__ __forceinline__ void store(T* p, const float (&v)[kVec]) {
  if (kVec == 8) {
    constexpr int kPer = 16 / sizeof(T);
#pragma unroll
    for (int i = 0; i < kVec / kPer; ++i) {
      Pack16<T> pack;
#pragma unroll
      for (int j = 0; j < kPer; ++j) pack.e[j] = from_float<T>(v[i * kPer + j]);
      reinterpret_cast<Pack16<T>*>(p)[i] = pack;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kVec; ++i) p[i] = from_float<T>(v[i]);
  }
}

constexpr int kMergeThreads = 256;

template <typename OutT, typename BlockT, int kVec>
__global__ void __launch_bounds__(kMergeThreads) merge_kernel(const PortattnMergeParams p, int group_log2) {
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * kMergeThreads + threadIdx.x;
  const int64_t row = thread >> group_log2;
  const int lane = static_cast<int>(thread & ((1 << group_log2) - 1));
  const int64_t rows = static_cast<int64_t>(p.batch) * p.seqlen * p.nheads;
  const bool valid = row < rows;
  int64_t b = 0, t = 0, h = 0;
  float lse = 0.f, block_lse = 0.f;
  if (valid) {
    h = row % p.nheads;
    const int64_t bt = row / p.nheads;
    t = bt % p.seqlen;
    b = bt / p.seqlen;
    lse = p.lse[b * p.lse_strides.batch_stride + t * p.lse_strides.row_stride + h * p.lse_strides.head_stride];
    block_lse = p.block_lse[b * p.block_lse_strides.batch_stride + t * p.block_lse_strides.row_stride +
                            h * p.block_lse_strides.head_stride];
  }
  // Every lane of a row reads its LSE before the row's first lane overwrites it.
  PORTATTN_MERGE_SYNC();
  if (!valid) return;
  const MergeWeights m = merge_weights(lse, block_lse);
  if (lane == 0)
    p.lse[b * p.lse_strides.batch_stride + t * p.lse_strides.row_stride + h * p.lse_strides.head_stride] = m.lse;
  if (m.mode == kKeep) return;
  OutT* out = static_cast<OutT*>(p.out) + b * p.out_strides.batch_stride + t * p.out_strides.row_stride +
              h * p.out_strides.head_stride;
  const BlockT* block = static_cast<const BlockT*>(p.block_out) + b * p.block_out_strides.batch_stride +
                        t * p.block_out_strides.row_stride + h * p.block_out_strides.head_stride;
  const int chunks = p.headdim / kVec;
  for (int c = lane; c < chunks; c += 1 << group_log2) {
    float o[kVec], x[kVec];
    load<BlockT, kVec>(block + c * kVec, x);
    if (m.mode == kBlend) {
      load<OutT, kVec>(out + c * kVec, o);
#pragma unroll
      for (int i = 0; i < kVec; ++i) o[i] = merge_value(o[i], x[i], m.w);
    } else {
#pragma unroll
      for (int i = 0; i < kVec; ++i) o[i] = x[i];
    }
    store<OutT, kVec>(out + c * kVec, o);
  }
}

// Launch shape and vector width of a call; 0 = served, else a message index (merge_error).
struct MergeLaunch {
  int vec;         // 8 (16-byte accesses of 16-bit data) or 1
  int group_log2;  // threads per row = 1 << group_log2
  int64_t blocks;
};

inline int element_bytes(int dtype) { return dtype == PORTATTN_MERGE_FP32 ? 4 : 2; }

inline bool aligned16(const void* pointer, const PortattnTensor4& s, int bytes) {
  return reinterpret_cast<uintptr_t>(pointer) % 16 == 0 && (s.batch_stride * bytes) % 16 == 0 &&
         (s.row_stride * bytes) % 16 == 0 && (s.head_stride * bytes) % 16 == 0;
}

inline MergeLaunch merge_launch(const PortattnMergeParams& p) {
  MergeLaunch launch;
  const bool vector = p.headdim % 8 == 0 && aligned16(p.out, p.out_strides, element_bytes(p.out_dtype)) &&
                      aligned16(p.block_out, p.block_out_strides, element_bytes(p.block_dtype));
  launch.vec = vector ? 8 : 1;
  const int chunks = p.headdim / launch.vec;
  launch.group_log2 = 0;
  while ((1 << launch.group_log2) < chunks && launch.group_log2 < 5) ++launch.group_log2;
  const int64_t rows = static_cast<int64_t>(p.batch) * p.seqlen * p.nheads;
  launch.blocks = ((rows << launch.group_log2) + kMergeThreads - 1) / kMergeThreads;
  return launch;
}

// "" when the shape and dtypes are served (the Python wrapper checked them with named errors).
inline const char* merge_invalid(const PortattnMergeParams& p) {
  if (p.out_dtype < 0 || p.out_dtype > PORTATTN_MERGE_FP32 || p.block_dtype < 0 ||
      p.block_dtype > PORTATTN_MERGE_FP32)
    return "merge: out and block_out must be float16, bfloat16 or float32";
  if (p.batch < 0 || p.seqlen < 0 || p.nheads < 0 || p.headdim < 0) return "merge: negative shape";
  if (!p.out || !p.lse || !p.block_out || !p.block_lse) return "merge: null pointer";
  return "";
}

// Calls f.template operator()<OutT, BlockT, kVec>() for the call's types and vector width.
template <typename F>
inline void dispatch_merge(const PortattnMergeParams& p, int vec, F&& f) {
#define PORTATTN_MERGE_BLOCK(OutT)                                      \
  switch (p.block_dtype) {                                              \
    case PORTATTN_FP16:                                                 \
      vec == 8 ? f.template run<OutT, Fp16, 8>() : f.template run<OutT, Fp16, 1>();   \
      break;                                                            \
    case PORTATTN_BF16:                                                 \
      vec == 8 ? f.template run<OutT, Bf16, 8>() : f.template run<OutT, Bf16, 1>();   \
      break;                                                            \
    default:                                                            \
      vec == 8 ? f.template run<OutT, float, 8>() : f.template run<OutT, float, 1>(); \
  }
  switch (p.out_dtype) {
    case PORTATTN_FP16:
      PORTATTN_MERGE_BLOCK(Fp16)
      break;
    case PORTATTN_BF16:
      PORTATTN_MERGE_BLOCK(Bf16)
      break;
    default:
      PORTATTN_MERGE_BLOCK(float)
  }
#undef PORTATTN_MERGE_BLOCK
}

}  // namespace merge
}  // namespace portattn
