// C entry point of the LSE merge (Note [portattn merge attention states] in common/merge.h):
// portattn.merge_attention_states on NVIDIA GPUs. No allocation, no host read of tensor
// values, the caller's stream: safe inside CUDA-graph capture.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

namespace portattn {
namespace merge {
__device__ __forceinline__ float half_bits_to_float(uint16_t bits) { return __half2float(__ushort_as_half(bits)); }
__device__ __forceinline__ uint16_t float_to_half_bits(float x) { return __half_as_ushort(__float2half_rn(x)); }
}  // namespace merge
}  // namespace portattn

#define PORTATTN_MERGE_SYNC() __syncthreads()
#include "../../common/merge_kernel.h"

namespace {

struct Launcher {
  const PortattnMergeParams& p;
  const portattn::merge::MergeLaunch& launch;
  template <typename OutT, typename BlockT, int kVec>
  void run() const {
    portattn::merge::merge_kernel<OutT, BlockT, kVec>
        <<<static_cast<unsigned>(launch.blocks), portattn::merge::kMergeThreads, 0,
           static_cast<cudaStream_t>(p.stream)>>>(p, launch.group_log2);
  }
};

}  // namespace

extern "C" int portattn_cuda_merge(const PortattnMergeParams* params, char* message, int message_len) {
  const PortattnMergeParams& p = *params;
  const char* invalid = portattn::merge::merge_invalid(p);
  if (invalid[0] != '\0') {
    snprintf(message, message_len, "portattn CUDA %s", invalid);
    return -1;
  }
  const portattn::merge::MergeLaunch launch = portattn::merge::merge_launch(p);
  if (launch.blocks == 0) return 0;
  if (launch.blocks > 0x7fffffff) {
    snprintf(message, message_len, "portattn CUDA merge: %lld rows exceed one launch",
             static_cast<long long>(p.batch) * p.seqlen * p.nheads);
    return -1;
  }
  portattn::merge::dispatch_merge(p, launch.vec, Launcher{p, launch});
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) {
    snprintf(message, message_len, "portattn CUDA merge: launch failed: %s", cudaGetErrorString(status));
    return static_cast<int>(status);
  }
  return 0;
}
