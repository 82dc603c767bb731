// Host side of the decode kernel (decode_kernel.cuh): grid, shared-memory
// opt-in, launch, then the split combine (decode_entry.cu) when the key range
// is split. Included by the generated per-(head dim, dtype) translation units
// (variants.py, family "decode"), each of which instantiates run_decode.
#pragma once
#include <cuda_runtime.h>

#include <utility>

#include "decode_kernel.cuh"
#include "variant_table.h"

namespace portattn {
namespace cuda {

// Merges the num_splits partial results of a decode call (decode_entry.cu).
cudaError_t launch_decode_combine(const PortattnDecodeParams& params);

// Whether the current device takes programmatic dependent launches (sm90+), asked once per device.
bool pdl_supported();

// Which FP8 path the decode_fp8 family launches (PORTATTN_DECODE_FP8_PATH, decode_entry.cu):
// the conversion pass through a 16-bit stage, or the register fragments (kFp8Regs).
enum DecodeFp8Path : int { kDecodeFp8Smem = 0, kDecodeFp8Regs = 1, kDecodeFp8Invalid = -1 };
DecodeFp8Path decode_fp8_path();

// Launches `kernel` so that it may be scheduled while the previous kernel of the stream
// finishes (its prologue then overlaps that kernel's tail and our launch latency); the
// kernels wait for it (wait_for_previous_grid) before reading anything it may write.
template <typename... KernelArgs, typename... Args>
cudaError_t launch_overlapped(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
                              cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = pdl_supported() ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

template <int kHeadDim, typename Elem, bool kExtras, bool kFp8, bool kFp8Regs>
cudaError_t launch_decode(const PortattnDecodeParams& params) {
  using Config = DecodeTileConfig<kHeadDim, kFp8, kFp8Regs>;
  auto kernel = &decode_kernel<kHeadDim, Elem, kExtras, kFp8, kFp8Regs>;
  constexpr int kSmem = Config::kSmemBytes;
  cudaError_t err = ensure_dynamic_smem(reinterpret_cast<const void*>(kernel), kSmem,
                                        &DecodeSmemOptIn<kHeadDim, Elem, kExtras, kFp8, kFp8Regs>::state);
  if (err != cudaSuccess) return err;
  const int group = params.nheads / params.nheads_k;
  const int m_tiles = (params.seqlen_q * group + Config::kBlockM - 1) / Config::kBlockM;
  const dim3 grid(params.num_splits, params.nheads_k * m_tiles, params.batch);
  return launch_overlapped(kernel, grid, dim3(Config::kThreads), kSmem, static_cast<cudaStream_t>(params.stream),
                           params);
}

template <int kHeadDim, typename Elem, bool kFp8, bool kFp8Regs = false>
cudaError_t run_decode_of(const PortattnDecodeParams& params) {
  if (params.seqlen_q == 0 || params.batch == 0 || params.nheads == 0) return cudaSuccess;
  const bool extras = params.softcap > 0.f || params.alibi_slopes != nullptr;
  cudaError_t err = extras ? launch_decode<kHeadDim, Elem, true, kFp8, kFp8Regs>(params)
                           : launch_decode<kHeadDim, Elem, false, kFp8, kFp8Regs>(params);
  if (err != cudaSuccess || params.num_splits == 1) return err;
  return launch_decode_combine(params);
}

// The decode family: k/v of the query's dtype.
template <int kHeadDim, typename Elem>
cudaError_t run_decode(const PortattnDecodeParams& params) {
  return run_decode_of<kHeadDim, Elem, false>(params);
}

// The decode_fp8 family: e4m3 k/v with a query of Elem (Note [portattn fp8 kv cache]). Both
// paths are built, so one build can time them against each other (bench/tools/ab_decode_fp8.py).
template <int kHeadDim, typename Elem>
cudaError_t run_decode_fp8(const PortattnDecodeParams& params) {
  return decode_fp8_path() == kDecodeFp8Regs ? run_decode_of<kHeadDim, Elem, true, true>(params)
                                             : run_decode_of<kHeadDim, Elem, true, false>(params);
}

}  // namespace cuda
}  // namespace portattn
