// Host side of the forward kernel: grid shape, shared-memory opt-in, launch.
// Included by the generated per-(head dim, dtype) translation units
// (variants.py), each of which instantiates run_fwd for one variant.
#pragma once
#include <cuda_runtime.h>

#include "fwd_kernel.cuh"
#include "variant_table.h"

namespace portattn {
namespace cuda {

template <int kHeadDim, typename Elem, bool kExtras>
cudaError_t launch_fwd(const PortattnFwdParams& params) {
  using Traits = FwdKernelTraits<kHeadDim, Elem>;
  auto kernel = &fwd_kernel<kHeadDim, Elem, kExtras>;
  constexpr int kSmem = Traits::kSmemBytes;
  cudaError_t err = ensure_dynamic_smem(reinterpret_cast<const void*>(kernel), kSmem,
                                        &SmemOptIn<kHeadDim, Elem, kExtras>::state);
  if (err != cudaSuccess) return err;
  const dim3 grid((params.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, params.nheads,
                  params.batch);
  kernel<<<grid, Traits::kThreads, kSmem, static_cast<cudaStream_t>(params.stream)>>>(params);
  return cudaGetLastError();
}

template <int kHeadDim, typename Elem>
cudaError_t run_fwd(const PortattnFwdParams& params) {
  if (params.seqlen_q == 0 || params.batch == 0 || params.nheads == 0) return cudaSuccess;
  const bool extras =
      params.softcap > 0.f || params.alibi_slopes != nullptr || params.dropout_p > 0.f;
  return extras ? launch_fwd<kHeadDim, Elem, true>(params)
                : launch_fwd<kHeadDim, Elem, false>(params);
}

}  // namespace cuda
}  // namespace portattn
