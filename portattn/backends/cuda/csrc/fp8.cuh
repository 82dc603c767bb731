// float8 e4m3 ("fn": bias 7, no infinities, max 448) <-> the 16-bit types of the mma path
// (Note [portattn fp8 kv cache] in common/params.h).
//
// Reading: e4m3 -> fp16 and e4m3 -> bf16 are exact (both have more exponent and mantissa
// bits), done with integer shifts and one multiply by a power of two, the same code on every
// arch from sm80 up: the sign stays in bit 15, the 7 exponent-and-mantissa bits move
// under the target's exponent field, which rebiases the value by 2^-8 (fp16: bias 15
// against 7, exponent field 3 bits wider) or 2^-120 (bf16: bias 127); multiplying by 2^8
// or 2^120 undoes that, exactly, subnormals included (the shifted subnormal is a
// subnormal of the target, scaled by the same power). The bit pattern 0x7f / 0xff (e4m3's NaN)
// reads as +-480 here, not NaN: the append never writes it from a finite value.
// sm89+ has cvt.rn.f16x2.e4m3x2; it is not used so that every arch runs the code the
// H100 suite verifies (and bf16 would need a further f16 -> f32 -> bf16 step with it).
//
// Writing: round to nearest even, saturating to +-448 (__nv_cvt_float_to_fp8 with
// __NV_SATFINITE: a hardware cvt on sm89+, emulated by cuda_fp8.h before).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

namespace portattn {
namespace fp8 {

// The 16-bit lanes of two e4m3 bytes moved into the high byte of each lane: bytes (b0, b1)
// of w for `low`, (b2, b3) for the other half.
__device__ __forceinline__ uint32_t spread_low(uint32_t w) { return __byte_perm(w, 0u, 0x1404); }
__device__ __forceinline__ uint32_t spread_high(uint32_t w) { return __byte_perm(w, 0u, 0x3424); }

template <typename Elem>
__device__ __forceinline__ uint32_t e4m3x2_from_spread(uint32_t h);

template <>
__device__ __forceinline__ uint32_t e4m3x2_from_spread<__half>(uint32_t h) {
  const uint32_t bits = (h & 0x80008000u) | ((h >> 1) & 0x3f803f80u);  // value * 2^-8 as fp16
  const __half2 scaled = __hmul2(*reinterpret_cast<const __half2*>(&bits), __half2half2(__ushort_as_half(0x5c00)));
  return *reinterpret_cast<const uint32_t*>(&scaled);  // 0x5c00 = 2^8
}

template <>
__device__ __forceinline__ uint32_t e4m3x2_from_spread<__nv_bfloat16>(uint32_t h) {
  const uint32_t bits = (h & 0x80008000u) | ((h >> 4) & 0x07f007f0u);  // value * 2^-120 as bf16
  const __nv_bfloat162 scaled = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&bits),
                                        __bfloat162bfloat162(__ushort_as_bfloat16(0x7b80)));
  return *reinterpret_cast<const uint32_t*>(&scaled);  // 0x7b80 = 2^120
}

// 16 e4m3 values (one 16-byte chunk) -> 16 Elem values (two 16-byte chunks), in order.
template <typename Elem>
__device__ __forceinline__ void e4m3x16_to(const uint4& in, uint4& lo, uint4& hi) {
  lo.x = e4m3x2_from_spread<Elem>(spread_low(in.x));
  lo.y = e4m3x2_from_spread<Elem>(spread_high(in.x));
  lo.z = e4m3x2_from_spread<Elem>(spread_low(in.y));
  lo.w = e4m3x2_from_spread<Elem>(spread_high(in.y));
  hi.x = e4m3x2_from_spread<Elem>(spread_low(in.z));
  hi.y = e4m3x2_from_spread<Elem>(spread_high(in.z));
  hi.z = e4m3x2_from_spread<Elem>(spread_low(in.w));
  hi.w = e4m3x2_from_spread<Elem>(spread_high(in.w));
}

// e4m3(x / descale): the division rounds once (IEEE, as torch's on the reference path).
__device__ __forceinline__ uint8_t quantize(float x, float descale) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(__fdiv_rn(x, descale), __NV_SATFINITE, __NV_E4M3));
}

// 16-byte shared-memory accesses by 32-bit shared address (the conversion pass of the decode).
__device__ __forceinline__ uint4 ld_shared_16(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
__device__ __forceinline__ void st_shared_16(uint32_t addr, const uint4& v) {
  asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}

// The descale of (batch entry b, KV head hk), 1 when none is given.
__device__ __forceinline__ float descale_of(const float* descale, int64_t batch_stride, int64_t head_stride,
                                            int b, int hk) {
  return descale == nullptr ? 1.f : descale[b * batch_stride + hk * head_stride];
}

}  // namespace fp8
}  // namespace portattn
