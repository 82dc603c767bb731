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
// the conversion pass through a 16-bit stage, the register fragments (kFp8Regs), or those with
// kFp8DeepStages stages.
enum DecodeFp8Path : int { kDecodeFp8Smem = 0, kDecodeFp8Regs = 1, kDecodeFp8RegsDeep = 2, kDecodeFp8Invalid = -1 };
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

template <int kHeadDim, typename Elem, bool kExtras, bool kFp8, bool kFp8Regs, int kStages>
cudaError_t launch_decode(const PortattnDecodeParams& params) {
  using Config = DecodeTileConfig<kHeadDim, kFp8, kFp8Regs, kStages>;
  auto kernel = &decode_kernel<kHeadDim, Elem, kExtras, kFp8, kFp8Regs, kStages>;
  constexpr int kSmem = Config::kSmemBytes;
  cudaError_t err = ensure_dynamic_smem(reinterpret_cast<const void*>(kernel), kSmem,
                                        &DecodeSmemOptIn<kHeadDim, Elem, kExtras, kFp8, kFp8Regs, kStages>::state);
  if (err != cudaSuccess) return err;
  const int group = params.nheads / params.nheads_k;
  const int m_tiles = (params.seqlen_q * group + Config::kBlockM - 1) / Config::kBlockM;
  const dim3 grid(params.num_splits, params.nheads_k * m_tiles, params.batch);
  return launch_overlapped(kernel, grid, dim3(Config::kThreads), kSmem, static_cast<cudaStream_t>(params.stream),
                           params);
}

// The facts of the kernel launch_decode<same arguments> launches, on the current device: its
// dynamic shared memory (opted in as the launch does), registers (ptxas's) and resident CTAs
// per SM (the occupancy calculator, which counts both). The split planner's input
// (portattn_cuda_decode_occupancy, portattn/decode.py).
template <int kHeadDim, typename Elem, bool kExtras, bool kFp8, bool kFp8Regs, int kStages>
cudaError_t decode_facts_of(DecodeTileFacts* facts) {
  using Config = DecodeTileConfig<kHeadDim, kFp8, kFp8Regs, kStages>;
  auto kernel = &decode_kernel<kHeadDim, Elem, kExtras, kFp8, kFp8Regs, kStages>;
  facts->stage_keys = Config::kStageKeys;
  facts->threads = Config::kThreads;
  facts->smem_bytes = Config::kSmemBytes;
  facts->stages = Config::kStages;
  facts->registers = facts->ctas_per_sm = -1;
  cudaFuncAttributes attributes;
  cudaError_t err = cudaFuncGetAttributes(&attributes, kernel);
  if (err != cudaSuccess) return err;
  facts->registers = attributes.numRegs;
  err = ensure_dynamic_smem(reinterpret_cast<const void*>(kernel), Config::kSmemBytes,
                            &DecodeSmemOptIn<kHeadDim, Elem, kExtras, kFp8, kFp8Regs, kStages>::state);
  if (err != cudaSuccess) return err;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&facts->ctas_per_sm, kernel, Config::kThreads,
                                                       Config::kSmemBytes);
}

template <int kHeadDim, typename Elem, bool kFp8, bool kFp8Regs = false, int kStages = 3>
cudaError_t run_decode_of(const PortattnDecodeParams& params) {
  if (params.seqlen_q == 0 || params.batch == 0 || params.nheads == 0) return cudaSuccess;
  const bool extras = params.softcap > 0.f || params.alibi_slopes != nullptr;
  cudaError_t err = extras ? launch_decode<kHeadDim, Elem, true, kFp8, kFp8Regs, kStages>(params)
                           : launch_decode<kHeadDim, Elem, false, kFp8, kFp8Regs, kStages>(params);
  if (err != cudaSuccess || params.num_splits == 1) return err;
  return launch_decode_combine(params);
}

template <int kHeadDim, typename Elem, bool kFp8, bool kFp8Regs = false, int kStages = 3>
cudaError_t decode_facts_for(bool extras, DecodeTileFacts* facts) {
  return extras ? decode_facts_of<kHeadDim, Elem, true, kFp8, kFp8Regs, kStages>(facts)
                : decode_facts_of<kHeadDim, Elem, false, kFp8, kFp8Regs, kStages>(facts);
}

// The decode family: k/v of the query's dtype.
template <int kHeadDim, typename Elem>
cudaError_t run_decode(const PortattnDecodeParams& params) {
  return run_decode_of<kHeadDim, Elem, false>(params);
}

template <int kHeadDim, typename Elem>
cudaError_t decode_facts(bool extras, DecodeTileFacts* facts) {
  return decode_facts_for<kHeadDim, Elem, false>(extras, facts);
}

// fn(Config{}) with the DecodeTileConfig of the FP8 path in effect: the one rule that both the
// launch and the planner's query follow. regs_deep needs kFp8DeepStages x 16 KiB; where the
// budget (Note [portattn smem budget]: a device or PORTATTN_MAX_SMEM_KIB below 80 KiB) does not
// hold it, the 3-stage register path runs.
template <int kHeadDim, class Fn>
cudaError_t with_fp8_config(Fn&& fn) {
  switch (decode_fp8_path()) {
    case kDecodeFp8Regs:
      return fn(DecodeTileConfig<kHeadDim, true, true>{});
    case kDecodeFp8RegsDeep: {
      int budget = 0;
      const cudaError_t err = smem_budget(&budget);
      if (err != cudaSuccess) return err;
      return with_first_fitting(budget,
                                TileCandidates<DecodeTileConfig<kHeadDim, true, true, kFp8DeepStages>,
                                               DecodeTileConfig<kHeadDim, true, true>>{},
                                fn);
    }
    default:
      return fn(DecodeTileConfig<kHeadDim, true, false>{});
  }
}

// The decode_fp8 family: e4m3 k/v with a query of Elem (Note [portattn fp8 kv cache]). Every
// path is built, so one build can time them against each other (bench/tools/ab_decode_fp8.py).
template <int kHeadDim, typename Elem>
cudaError_t run_decode_fp8(const PortattnDecodeParams& params) {
  return with_fp8_config<kHeadDim>([&](auto config) {
    using Config = decltype(config);
    return run_decode_of<kHeadDim, Elem, true, Config::kFp8Regs, Config::kStages>(params);
  });
}

template <int kHeadDim, typename Elem>
cudaError_t decode_fp8_facts(bool extras, DecodeTileFacts* facts) {
  return with_fp8_config<kHeadDim>([&](auto config) {
    using Config = decltype(config);
    return decode_facts_for<kHeadDim, Elem, true, Config::kFp8Regs, Config::kStages>(extras, facts);
  });
}

}  // namespace cuda
}  // namespace portattn
