// Host side of the forward kernel: grid shape, shared-memory opt-in, launch.
// Included by the generated per-(head dim, dtype) translation units
// (variants.py), each of which instantiates run_fwd for one variant.
#pragma once
#include <cuda_runtime.h>
#ifdef PORTATTN_FWD_TUNING
#include <stdlib.h>
#endif

#include "fwd_kernel.cuh"
#include "variant_table.h"

namespace portattn {
namespace cuda {

template <int kHeadDim, typename Elem, bool kExtras, bool kNarrow>
cudaError_t launch_fwd(const PortattnFwdParams& params) {
  using Traits = FwdKernelTraits<kHeadDim, Elem, kNarrow>;
  auto kernel = &fwd_kernel<kHeadDim, Elem, kExtras, kNarrow>;
  constexpr int kSmem = Traits::kSmemBytes;
  cudaError_t err = ensure_dynamic_smem(reinterpret_cast<const void*>(kernel), kSmem,
                                        &SmemOptIn<kHeadDim, Elem, kExtras, kNarrow ? 1 : 0>::state);
  if (err != cudaSuccess) return err;
  const dim3 grid((params.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, params.nheads,
                  params.batch);
  kernel<<<grid, Traits::kThreads, kSmem, static_cast<cudaStream_t>(params.stream)>>>(params);
  return cudaGetLastError();
}

// Note [portattn sm80 narrow tiles] (fwd_kernel.cuh): the narrow shape runs
// when both sequence lengths (the longest of the batch for varlen) are at most
// kNarrowMaxSeqlen. The value is the measured crossover on an H100
// (docs/cuda_fwd_notes.md, "Narrow tiles"); tuning builds
// (-DPORTATTN_FWD_TUNING) read PORTATTN_FWD_NARROW_MAX_SEQLEN on every call
// instead, so one process can time both shapes.
constexpr int kNarrowMaxSeqlen = 256;

inline int narrow_max_seqlen() {
#ifdef PORTATTN_FWD_TUNING
  const char* text = getenv("PORTATTN_FWD_NARROW_MAX_SEQLEN");
  if (text != nullptr && *text != '\0') return atoi(text);
#endif
  return kNarrowMaxSeqlen;
}

template <int kHeadDim, typename Elem, bool kExtras>
cudaError_t launch_fwd_shape(const PortattnFwdParams& params) {
  if constexpr (kHeadDim <= 64) {
    const int limit = narrow_max_seqlen();
    if (params.seqlen_q <= limit && params.seqlen_k <= limit)
      return launch_fwd<kHeadDim, Elem, kExtras, true>(params);
  }
  return launch_fwd<kHeadDim, Elem, kExtras, false>(params);
}

template <int kHeadDim, typename Elem>
cudaError_t run_fwd(const PortattnFwdParams& params) {
  if (params.seqlen_q == 0 || params.batch == 0 || params.nheads == 0) return cudaSuccess;
  const bool extras =
      params.softcap > 0.f || params.alibi_slopes != nullptr || params.dropout_p > 0.f;
  return extras ? launch_fwd_shape<kHeadDim, Elem, true>(params)
                : launch_fwd_shape<kHeadDim, Elem, false>(params);
}

}  // namespace cuda
}  // namespace portattn
