// The shared-memory budget of a launch, and the one rule that picks a tile by it.
//
// Note [portattn smem budget]
// Every kernel of libportattn_cuda.so (sm80+ forward, backward and decode, the Hopper
// forward and backward) sizes and checks its dynamic shared memory against
// smem_budget(): the device's opt-in limit per block (cudaDevAttrMaxSharedMemoryPerBlockOptin:
// sm80 163 KiB, sm86/sm89/sm120 99 KiB, sm90 227 KiB), lowered to a process-wide cap.
// The cap comes from PORTATTN_MAX_SMEM_KIB: Python parses and range-checks the variable
// (portattn/capability/smem_cap.py) and sets the cap once when it loads the module
// (portattn_cuda_set_smem_cap, backends/cuda/__init__.py), so the support matrix, dispatch
// and the launches read one number. A setter rather than a field of the ABI structs: the
// budget is a property of the process, not of a call, and the params structs (shared with
// ROCm, marshalled on every call) stay as they are. With the cap an H100 runs exactly the
// tile configurations of a 99 KiB part (PORTATTN_MAX_SMEM_KIB=99) or of an A100 (163).
//
// Kernels with several tile configurations list them as TileCandidates, fastest first; the
// first whose kSmemBytes fits the budget runs (with_first_fitting). The smallest of them is
// what the support matrix is told the head dim needs (min_smem_bytes, build_config()).
#pragma once
#include <cuda_runtime.h>

namespace portattn {
namespace cuda {

// The cap in bytes (0: none). Set from Python before any launch; later changes apply to the
// next launch's tile choice and check.
void set_smem_cap_bytes(int bytes);
int smem_cap_bytes();

// min(the current device's opt-in limit per block, the cap), in bytes. The device's limit is
// read once per device.
cudaError_t smem_budget(int* bytes);

template <class... Cfgs>
struct TileCandidates {};

// fn(Cfg{}) for the first candidate whose shared memory fits `budget`; the last candidate
// runs when none fits (its launch then reports the shortfall: ensure_dynamic_smem).
template <class Fn, class Cfg, class... Rest>
auto with_first_fitting(int budget, TileCandidates<Cfg, Rest...>, Fn&& fn) {
  if constexpr (sizeof...(Rest) > 0) {
    if (Cfg::kSmemBytes > budget) return with_first_fitting(budget, TileCandidates<Rest...>{}, fn);
  }
  return fn(Cfg{});
}

// The least shared memory any candidate needs: what a device must offer for the head dim.
template <class... Cfgs>
constexpr int min_smem_bytes(TileCandidates<Cfgs...>) {
  int best = 1 << 30;
  for (int bytes : {Cfgs::kSmemBytes...}) best = bytes < best ? bytes : best;
  return best;
}

}  // namespace cuda
}  // namespace portattn
