// CPU stand-in for the HIP subset the ROCm kernels and module.cpp use, so the
// kernels' logic (indexing, LDS layout, masking, online softmax, dropout,
// varlen, GQA, stores) runs in CI without an AMD GPU.
//
// One workgroup at a time, one std::thread per lane. __shared__ becomes a
// function-local static (one workgroup is live, so it is that workgroup's
// LDS). Wave-wide operations (MFMA, __shfl_xor) exchange operands through a
// per-wave buffer between two wave barriers, so they need what the hardware
// needs anyway: every lane of the wave reaches them in the same order.
//
// What this cannot check: that Note [portattn MFMA layout] and Note [portattn
// MFMA double depth] (cdna.h) match the hardware (they are emulated with the
// same assumed layouts), the compiler's
// code generation, timing, or races the hardware would expose but a CPU with
// barriers hides. Those are for the self-check on a real device.
#pragma once
#include <stdint.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <barrier>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define PORTATTN_LAUNCH_BOUNDS(threads, waves_per_simd)

using std::max;
using std::min;

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

typedef int hipError_t;
typedef void* hipStream_t;
constexpr hipError_t hipSuccess = 0;
constexpr hipError_t hipErrorInvalidValue = 1;
#define HIP_VERSION 0

struct hipDeviceProp_t {
  char gcnArchName[256];
};

inline hipError_t hipGetDevice(int* device) {
  *device = 0;
  return hipSuccess;
}
inline hipError_t hipGetDeviceCount(int* count) {
  *count = 1;
  return hipSuccess;
}
// One emulated module per kernel family (tests/test_rocm_emulated.py): its
// pseudo-arch names the registry rows and its wave size the lanes per wave.
#ifndef PORTATTN_EMU_ARCH
#define PORTATTN_EMU_ARCH "emu"
#endif
#ifndef PORTATTN_EMU_WAVE
#define PORTATTN_EMU_WAVE 64
#endif

inline hipError_t hipGetDeviceProperties(hipDeviceProp_t* props, int) {
  std::strcpy(props->gcnArchName, PORTATTN_EMU_ARCH);
  return hipSuccess;
}
inline hipError_t hipGetLastError() { return hipSuccess; }
inline const char* hipGetErrorName(hipError_t status) { return status ? "hipErrorEmulated" : "hipSuccess"; }
inline const char* hipGetErrorString(hipError_t status) { return hipGetErrorName(status); }

namespace hipemu {

constexpr int kWave = PORTATTN_EMU_WAVE;
constexpr int kMaxWaves = 16;

struct WaveScratch {
  float a[32][8];  // one MFMA's A operand (32 x 8)
  float b[8][32];  // and B operand (8 x 32)
  float a16[16][16];  // the 16x16x16 shapes' A and B operands (MFMA and WMMA)
  float b16[16][16];
  float a_x16[32][16], b_x16[16][32];  // CDNA4's 32x32x16
  float a_x32[16][32], b_x32[32][16];  // CDNA4's 16x16x32
  uint16_t raw_a[64][16], raw_b[64][16];  // WMMA operand slots per lane (gfx11 replication check)
  float lanes[kWave];
  uint32_t words[kWave];
};

struct Workgroup {
  explicit Workgroup(int threads) : block(threads) {
    for (int w = 0; w < threads / kWave; ++w) waves.emplace_back(std::make_unique<std::barrier<>>(kWave));
  }
  std::barrier<> block;
  std::vector<std::unique_ptr<std::barrier<>>> waves;
  WaveScratch scratch[kMaxWaves];
};

struct Index3 {
  unsigned x, y, z;
};

inline thread_local Index3 thread_idx, block_idx;
inline thread_local Workgroup* workgroup = nullptr;

inline int wave() { return thread_idx.x / kWave; }
inline int lane() { return thread_idx.x % kWave; }
inline void wave_barrier() { workgroup->waves[wave()]->arrive_and_wait(); }

inline float shfl_xor(float x, int mask) {
  float* lanes = workgroup->scratch[wave()].lanes;
  lanes[lane()] = x;
  wave_barrier();
  const float y = lanes[lane() ^ mask];
  wave_barrier();
  return y;
}

inline uint32_t shfl_xor(uint32_t x, int mask) {
  uint32_t* words = workgroup->scratch[wave()].words;
  words[lane()] = x;
  wave_barrier();
  const uint32_t y = words[lane() ^ mask];
  wave_barrier();
  return y;
}

inline float half_to_float(_Float16 h) { return static_cast<float>(h); }
inline float half_to_float(short bf16_bits) {
  const uint32_t bits = static_cast<uint32_t>(static_cast<uint16_t>(bf16_bits)) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
typedef short i16x8 __attribute__((ext_vector_type(8)));  // CDNA4's bf16 operands, as bits

// D(32x32) += A(32x8) B(8x32) with Note [portattn MFMA layout]'s lane mapping.
template <class V4, class V16>
V16 mfma_32x32x8(V4 a, V4 b, V16 c) {
  WaveScratch& s = workgroup->scratch[wave()];
  const int l = lane();
  for (int k = 0; k < 4; ++k) {
    s.a[l % 32][4 * (l / 32) + k] = half_to_float(a[k]);
    s.b[4 * (l / 32) + k][l % 32] = half_to_float(b[k]);
  }
  wave_barrier();
  for (int r = 0; r < 16; ++r) {
    const int row = 8 * (r / 4) + 4 * (l / 32) + r % 4, col = l % 32;
    float acc = c[r];
    for (int k = 0; k < 8; ++k) acc += s.a[row][k] * s.b[k][col];
    c[r] = acc;
  }
  wave_barrier();
  return c;
}

// D(16x16) += A(16x16) B(16x16) with the 16x16x16 lane mapping of cdna.h.
template <class V4, class VC>
VC mfma_16x16x16(V4 a, V4 b, VC c) {
  WaveScratch& s = workgroup->scratch[wave()];
  const int l = lane();
  for (int k = 0; k < 4; ++k) {
    s.a16[l % 16][4 * (l / 16) + k] = half_to_float(a[k]);
    s.b16[4 * (l / 16) + k][l % 16] = half_to_float(b[k]);
  }
  wave_barrier();
  for (int r = 0; r < 4; ++r) {
    const int row = 4 * (l / 16) + r, col = l % 16;
    float acc = c[r];
    for (int k = 0; k < 16; ++k) acc += s.a16[row][k] * s.b16[k][col];
    c[r] = acc;
  }
  wave_barrier();
  return c;
}

// CDNA4's double-depth shapes, D(32x32) += A(32x16) B(16x32) and D(16x16) +=
// A(16x32) B(32x16), with the operand layout of the AMD Instinct CDNA4 ISA
// reference guide's dense-MFMA layout tables: A[i][k] is item k % 8 of lane
// i + M (k / 8), B[k][j] item k % 8 of lane j + N (k / 8) (M = N = 32 / 16);
// D as the 32x32x8 / 16x16x16 shapes above. The kernels rely only on A and B
// sharing that (lane, item) -> k map (Note [portattn MFMA double depth]).
template <int kM, class V8, class VC>
VC mfma_double_depth(V8 a, V8 b, VC c) {
  constexpr int kK = kM == 32 ? 16 : 32;  // depth
  WaveScratch& s = workgroup->scratch[wave()];
  float* sa = kM == 32 ? &s.a_x16[0][0] : &s.a_x32[0][0];  // [kM][kK]
  float* sb = kM == 32 ? &s.b_x16[0][0] : &s.b_x32[0][0];  // [kK][kM]
  const int l = lane();
  for (int e = 0; e < 8; ++e) {
    const int k = 8 * (l / kM) + e;
    sa[(l % kM) * kK + k] = half_to_float(a[e]);
    sb[k * kM + l % kM] = half_to_float(b[e]);
  }
  wave_barrier();
  for (int r = 0; r < (kM == 32 ? 16 : 4); ++r) {
    const int row = kM == 32 ? 8 * (r / 4) + 4 * (l / 32) + r % 4 : 4 * (l / 16) + r, col = l % kM;
    float acc = c[r];
    for (int k = 0; k < kK; ++k) acc += sa[row * kK + k] * sb[k * kM + col];
    c[r] = acc;
  }
  wave_barrier();
  return c;
}

// D(16x16) += A(16x16) B(16x16) per wave32 with Note [portattn WMMA layout]
// (csrc/rdna.h): gfx11 lanes hold all 16 depth slots, lanes 16-31 repeating
// lanes 0-15 (checked: the hardware reads one copy), D row 2r + l / 16;
// gfx12 lanes hold 8 slots at depth 8 (l / 16), D row 8 (l / 16) + r.
template <int kGen, class V, class VC>
VC wmma_16x16x16(V a, V b, VC c) {
  static_assert(kWave == 32, "WMMA is emulated in wave32");
  WaveScratch& s = workgroup->scratch[wave()];
  const int l = lane();
  constexpr int kSlots = kGen == 11 ? 16 : 8;
  for (int e = 0; e < kSlots; ++e) {
    const int k = kGen == 11 ? e : 8 * (l / 16) + e;
    s.raw_a[l][e] = __builtin_bit_cast(uint16_t, a[e]);
    s.raw_b[l][e] = __builtin_bit_cast(uint16_t, b[e]);
    if (kGen == 12 || l < 16) {
      s.a16[l % 16][k] = half_to_float(a[e]);
      s.b16[k][l % 16] = half_to_float(b[e]);
    }
  }
  wave_barrier();
  if (kGen == 11 && l >= 16 &&
      (std::memcmp(s.raw_a[l], s.raw_a[l - 16], sizeof(s.raw_a[l])) != 0 ||
       std::memcmp(s.raw_b[l], s.raw_b[l - 16], sizeof(s.raw_b[l])) != 0)) {
    std::fprintf(stderr, "hip_emu: gfx11 WMMA operands of lanes %d and %d differ\n", l, l - 16);
    std::abort();
  }
  for (int r = 0; r < 8; ++r) {
    const int row = kGen == 11 ? 2 * r + l / 16 : 8 * (l / 16) + r, col = l % 16;
    float acc = c[r];
    for (int k = 0; k < 16; ++k) acc += s.a16[row][k] * s.b16[k][col];
    c[r] = acc;
  }
  wave_barrier();
  return c;
}

template <class... Params, class... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, Args... args) {
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        Workgroup group(static_cast<int>(block.x));
        std::vector<std::thread> lanes;
        lanes.reserve(block.x);
        for (unsigned t = 0; t < block.x; ++t) {
          lanes.emplace_back([&, t]() {
            thread_idx = {t, 0, 0};
            block_idx = {x, y, z};
            workgroup = &group;
            kernel(args...);
            // A lane that returned early must not leave the others waiting.
            group.block.arrive_and_drop();
            group.waves[t / kWave]->arrive_and_drop();
          });
        }
        for (std::thread& lane : lanes) lane.join();
      }
}

}  // namespace hipemu

// LDS atomics (the decode's workgroup vote, decode_common.h): lanes are threads here.
inline int atomicOr(int* address, int value) { return __atomic_fetch_or(address, value, __ATOMIC_SEQ_CST); }

#define threadIdx (::hipemu::thread_idx)
#define blockIdx (::hipemu::block_idx)
#define __syncthreads() (::hipemu::workgroup->block.arrive_and_wait())
#define __shfl_xor(x, mask) ::hipemu::shfl_xor((x), (mask))
#define __builtin_amdgcn_mfma_f32_32x32x8f16(a, b, c, cbsz, abid, blgp) ::hipemu::mfma_32x32x8((a), (b), (c))
#define __builtin_amdgcn_mfma_f32_32x32x8bf16_1k(a, b, c, cbsz, abid, blgp) ::hipemu::mfma_32x32x8((a), (b), (c))
#define __builtin_amdgcn_mfma_f32_16x16x16f16(a, b, c, cbsz, abid, blgp) ::hipemu::mfma_16x16x16((a), (b), (c))
#define __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(a, b, c, cbsz, abid, blgp) ::hipemu::mfma_16x16x16((a), (b), (c))
// The bf16 operands are read back as 16-bit integers: with __bf16 elements clang
// folds the kernels' float -> bf16 rounding into a conversion that needs
// compiler-rt's __truncsfbf2, which the host link (libgcc 12) lacks.
#define PORTATTN_EMU_BF16_BITS(x) __builtin_bit_cast(::hipemu::i16x8, (x))
#define __builtin_amdgcn_mfma_f32_32x32x16_f16(a, b, c, cbsz, abid, blgp) ::hipemu::mfma_double_depth<32>((a), (b), (c))
#define __builtin_amdgcn_mfma_f32_32x32x16_bf16(a, b, c, cbsz, abid, blgp) \
  ::hipemu::mfma_double_depth<32>(PORTATTN_EMU_BF16_BITS(a), PORTATTN_EMU_BF16_BITS(b), (c))
#define __builtin_amdgcn_mfma_f32_16x16x32_f16(a, b, c, cbsz, abid, blgp) ::hipemu::mfma_double_depth<16>((a), (b), (c))
#define __builtin_amdgcn_mfma_f32_16x16x32_bf16(a, b, c, cbsz, abid, blgp) \
  ::hipemu::mfma_double_depth<16>(PORTATTN_EMU_BF16_BITS(a), PORTATTN_EMU_BF16_BITS(b), (c))
#define __builtin_amdgcn_wmma_f32_16x16x16_f16_w32(a, b, c) ::hipemu::wmma_16x16x16<11>((a), (b), (c))
#define __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32(a, b, c) ::hipemu::wmma_16x16x16<11>((a), (b), (c))
#define __builtin_amdgcn_wmma_f32_16x16x16_f16_w32_gfx12(a, b, c) ::hipemu::wmma_16x16x16<12>((a), (b), (c))
#define __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32_gfx12(a, b, c) ::hipemu::wmma_16x16x16<12>((a), (b), (c))
#define hipLaunchKernelGGL(kernel, grid, block, shared_bytes, stream, ...) \
  ::hipemu::launch(kernel, grid, block, __VA_ARGS__)
