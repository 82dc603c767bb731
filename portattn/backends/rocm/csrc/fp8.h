// float8 e4m3 ("fn": bias 7, no infinities, max 448) <-> the 16-bit types of the ROCm decode
// (Note [portattn fp8 kv cache] in common/params.h; docs/rocm.md, "FP8 KV caches").
//
// Reading: e4m3 -> fp16 / bf16 is exact (both have more exponent and mantissa bits), done with
// integer shifts and one multiply by a power of two, the same code on every arch (gfx90a,
// gfx942, gfx950, gfx1100, gfx1201): the sign moves to bit 31, the 7 exponent-and-mantissa bits
// under the fp32 exponent field, which rebiases the value by 2^-120 (bias 127 against 7);
// multiplying by 2^120 undoes that exactly, subnormals included (a shifted e4m3 subnormal is an
// fp32 subnormal scaled by the same power: the kernels keep fp32 denormals,
// `.amdhsa_float_denorm_mode_32 3`, which tests/test_rocm_isa.py checks). The fp32 value has
// at most 4 significant bits, so its bf16 is its high half and its fp16 conversion exact. The
// bit patterns 0x7f / 0xff (e4m3's NaN) read as +-480, not NaN, as on CUDA: the append never
// writes them from a finite value.
// The native FP8 conversions are not used. gfx942's e4m3 is "fnuz" (bias 8, max 240, one NaN
// 0x80, no -0): an OCP byte read as fnuz is half its value, except 0x80 (OCP -0, which the
// append writes for small negative values) reading as NaN and 0x7f / 0xff as +-240, so the
// native path needs a fix-up per byte besides the factor 2; gfx90a and RDNA3 have no FP8
// conversion at all, and gfx950 / gfx1201's OCP conversions would be a second code path.
// One integer path keeps every arch on the code the CPU emulation runs.
//
// Writing: e4m3(x / descale), the division IEEE-rounded (HIP's default
// -fhip-fp32-correctly-rounded-divide-sqrt; torch's on the reference path), then round to
// nearest even saturating to +-448, as portattn/kvcache.py's quantize_fp8 (clamp, then
// torch's cast): +-inf gives +-448, NaN gives 0x7f / 0xff.
#pragma once
#include <math.h>
#include <stdint.h>

#include "cdna.h"

namespace portattn {
namespace rocm {
namespace PORTATTN_ROCM_ARCH_NS {
namespace fp8 {

// A constant the widening uses, as a VGPR on CDNA (gfx9). gfx9's VOP3 instructions
// (v_and_or_b32, v_pk_mul_f32) take no literal, so the compiler hoists the conversion's masks and
// 2^120 out of the key loop into SGPRs (4, 2^120 as v_pk_mul_f32's pair), which spilled 2 SGPRs
// of the gfx942 bf16 D = 256 decode; VGPRs are the plentiful file there (in_vgpr, cdna.h). The
// asm is not volatile, so it is hoisted and merged like the constant. RDNA's VOP3 takes literals.
template <uint32_t kValue>
__device__ __forceinline__ uint32_t widening_constant() {
#if defined(__HIP_DEVICE_COMPILE__) && defined(__GFX9__)
  uint32_t y;
  asm("v_mov_b32 %0, %1" : "=v"(y) : "i"(kValue));
  return y;
#else
  return kValue;
#endif
}

template <int kShift>
__device__ __forceinline__ uint32_t shifted(uint32_t x) {
  if constexpr (kShift >= 0) {
    return x << kShift;
  } else {
    return x >> -kShift;
  }
}

// The e4m3 byte at bits [8 kByte, 8 kByte + 8) of `word`, as fp32 (exact).
template <int kByte>
__device__ __forceinline__ float e4m3_at(uint32_t word) {
  const uint32_t bits = (shifted<24 - 8 * kByte>(word) & widening_constant<0x80000000u>()) |  // sign to bit 31
                        (shifted<20 - 8 * kByte>(word) & widening_constant<0x7f00000u>());  // value * 2^-120
  return __builtin_bit_cast(float, bits) * __builtin_bit_cast(float, widening_constant<0x7b800000u>());  // 2^120
}

// The e4m3 byte in the low 8 bits of `byte`, as fp32 (exact).
__device__ __forceinline__ float e4m3_to_float(uint32_t byte) { return e4m3_at<0>(byte); }

template <bool kIsBf16>
__device__ __forceinline__ uint16_t e4m3_to_16(float x) {
  if constexpr (kIsBf16) {
    return static_cast<uint16_t>(__builtin_bit_cast(uint32_t, x) >> 16);  // 4 significant bits
  } else {
    return Dtype<false>::from_float(x);
  }
}

// ... as the 16-bit pattern of fp16 / bf16 (exact).
template <bool kIsBf16>
__device__ __forceinline__ uint16_t e4m3_to(uint32_t byte) {
  return e4m3_to_16<kIsBf16>(e4m3_to_float(byte));
}

// Bytes kByte, kByte + 1 of `word` -> one word of two 16-bit values, in order.
template <bool kIsBf16, int kByte>
__device__ __forceinline__ uint32_t e4m3x2_at(uint32_t word) {
  const float lo = e4m3_at<kByte>(word), hi = e4m3_at<kByte + 1>(word);
  if constexpr (kIsBf16) {
#if defined(__HIP_DEVICE_COMPILE__)
    // The high halves of hi and lo (selector bytes 7, 6 of hi; 3, 2 of lo): no mask register.
    return __builtin_amdgcn_perm(__builtin_bit_cast(uint32_t, hi), __builtin_bit_cast(uint32_t, lo), 0x07060302u);
#else
    return (__builtin_bit_cast(uint32_t, hi) & 0xffff0000u) | (__builtin_bit_cast(uint32_t, lo) >> 16);
#endif
  } else {
    return static_cast<uint32_t>(e4m3_to_16<false>(lo)) | static_cast<uint32_t>(e4m3_to_16<false>(hi)) << 16;
  }
}

// Bytes 0, 1 of `bytes` -> one word of two 16-bit values, in order.
template <bool kIsBf16>
__device__ __forceinline__ uint32_t e4m3x2_to(uint32_t bytes) {
  return e4m3x2_at<kIsBf16, 0>(bytes);
}

// 8 e4m3 values (one 8-byte read) -> 8 16-bit values (one 16-byte chunk), in order.
template <bool kIsBf16>
__device__ __forceinline__ u32x4 e4m3x8_to(u32x2 bytes) {
  return u32x4{e4m3x2_at<kIsBf16, 0>(bytes.x), e4m3x2_at<kIsBf16, 2>(bytes.x), e4m3x2_at<kIsBf16, 0>(bytes.y),
               e4m3x2_at<kIsBf16, 2>(bytes.y)};
}

// Round to nearest even, saturating to +-448; NaN -> 0x7f with x's sign.
__device__ __forceinline__ uint8_t e4m3_of(float x) {
  const uint32_t u = __builtin_bit_cast(uint32_t, x);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7fu);
  if (a >= 0x43e00000u) return static_cast<uint8_t>(sign | 0x7eu);  // >= 448, inf included
  if (a < 0x3c800000u) {  // below 2^-6: multiples of 2^-9 (8 * 2^-9 is the smallest normal, 0x08)
    const float steps = __builtin_rintf(__builtin_bit_cast(float, a) * 512.f);
    return static_cast<uint8_t>(sign | static_cast<uint32_t>(steps));
  }
  // 3 of fp32's 23 mantissa bits, rounded to nearest even (a carry moves into the exponent),
  // then the exponent rebiased from 127 to 7; values below 448 round to at most 448 (0x7e).
  const uint32_t rounded = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
  return static_cast<uint8_t>(sign | (rounded - (120u << 3)));
}

__device__ __forceinline__ uint8_t quantize(float x, float descale) { return e4m3_of(x / descale); }

// The descale of (batch entry b, KV head hk), 1 when none is given.
__device__ __forceinline__ float descale_of(const float* descale, int64_t batch_stride, int64_t head_stride, int b,
                                            int hk) {
  return descale == nullptr ? 1.f : descale[b * batch_stride + hk * head_stride];
}

}  // namespace fp8
}  // namespace PORTATTN_ROCM_ARCH_NS
}  // namespace rocm
}  // namespace portattn
