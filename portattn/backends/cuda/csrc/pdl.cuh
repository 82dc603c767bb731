// Programmatic dependent launch (sm90+): a kernel launched with the stream-serialization
// attribute may be scheduled while the kernel before it in the stream is still finishing; its
// CTAs then wait for that grid (wait_for_previous_grid) before touching global memory, and say
// when the next kernel may be scheduled the same way (allow_next_grid). Without the attribute,
// or before sm90, both instructions are no-ops, so every kernel that calls them stays correct
// when launched plainly.
//
// Note [portattn programmatic dependent launch]
// Every kernel of the forward, backward and decode paths waits at its very top, before any
// global access, and allows the next grid right after: a grid that follows one of ours starts
// only when all of our CTAs have started, and reads nothing before our grid has completed and
// its writes are visible. What it buys is the gap between two kernels of one stream: the next
// grid's CTAs are placed on the SMs our last CTAs free, instead of after the launch that
// follows our grid's completion. pdl_supported() says whether launches take the attribute
// (sm90+, and not PORTATTN_PDL=0, the switch to turn it off).
#pragma once
#include <cuda_runtime.h>

#include <utility>

namespace portattn {
namespace cuda {

__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::);
#endif
}

// Whether launches on the current device take programmatic dependent launch: sm90+ and not
// PORTATTN_PDL=0 (decode_entry.cu; asked once per device).
bool pdl_supported();

// Launches `kernel` with the programmatic stream-serialization attribute where pdl_supported().
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

}  // namespace cuda
}  // namespace portattn
