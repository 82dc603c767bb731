// C entry points of libportattn_cuda.so (forward + shared helpers). The
// pybind11 module _C (binding.cpp) is the only caller; it is built per Python
// version while this library is not (see build.py).
#include <stdio.h>

#include <atomic>
#include <mutex>

#include "fwd_kernel.cuh"
#include "fwd_launch.cuh"
#include "variant_table.h"

namespace portattn {
namespace cuda {

namespace {
thread_local char g_detail[256] = {0};
std::mutex g_smem_mutex;
}  // namespace

const char* last_error_detail() { return g_detail; }

void set_error_detail(const char* text) { snprintf(g_detail, sizeof(g_detail), "%s", text); }

namespace {
std::atomic<int> g_smem_cap{0};
constexpr int kMaxDevices = 64;
std::atomic<int> g_device_optin[kMaxDevices];  // 0: not read yet
}  // namespace

void set_smem_cap_bytes(int bytes) { g_smem_cap.store(bytes > 0 ? bytes : 0, std::memory_order_relaxed); }
int smem_cap_bytes() { return g_smem_cap.load(std::memory_order_relaxed); }

cudaError_t smem_budget(int* bytes) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  int optin = device >= 0 && device < kMaxDevices ? g_device_optin[device].load(std::memory_order_relaxed) : 0;
  if (optin == 0) {
    err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (err != cudaSuccess) return err;
    if (device >= 0 && device < kMaxDevices) g_device_optin[device].store(optin, std::memory_order_relaxed);
  }
  const int cap = smem_cap_bytes();
  *bytes = cap > 0 && cap < optin ? cap : optin;
  return cudaSuccess;
}

cudaError_t ensure_dynamic_smem(const void* kernel, int bytes, SmemOptInState* state) {
  int budget = 0;
  cudaError_t err = smem_budget(&budget);
  if (err != cudaSuccess) return err;
  if (bytes > budget) {
    char text[256];
    const int cap = smem_cap_bytes();
    snprintf(text, sizeof(text),
             "this kernel needs %d bytes of shared memory per block; the budget is %d%s", bytes, budget,
             cap > 0 && cap == budget ? " (capped by PORTATTN_MAX_SMEM_KIB)" : " (the device's opt-in limit)");
    set_error_detail(text);
    return cudaErrorInvalidConfiguration;
  }
  int device = 0;
  err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const unsigned long long bit = device < 64 ? (1ull << device) : 0ull;
  if (bit != 0 && (__atomic_load_n(&state->done_devices, __ATOMIC_ACQUIRE) & bit)) return cudaSuccess;
  std::lock_guard<std::mutex> lock(g_smem_mutex);
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess && bit != 0) __atomic_fetch_or(&state->done_devices, bit, __ATOMIC_RELEASE);
  return err;
}

// 16-byte vector loads/stores need 16-byte aligned rows. Python passes any
// strided view; views of real models (packed qkv, slices along seqlen or
// heads) keep this, and a view that does not gets a clear error.
bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }
bool strides_aligned(const PortattnTensor4& s) {
  return (s.batch_stride % 8) == 0 && (s.row_stride % 8) == 0 && (s.head_stride % 8) == 0;
}

int fail(char* message, int message_len, int code, const char* text) {
  if (message != nullptr && message_len > 0) snprintf(message, message_len, "%s", text);
  return code == 0 ? -1 : code;
}

// The tile loaders step through rows with 32-bit offsets (fwd_kernel.cuh:
// TileLoader); 2^24 elements per row leaves room for 128-row tiles.
constexpr int64_t kMaxRowStride = int64_t{1} << 24;
bool row_stride_fits(const PortattnTensor4& s) { return s.row_stride < kMaxRowStride && s.row_stride > -kMaxRowStride; }

namespace {

// The least shared memory of the forward tiles of an instantiable head dim (multiple of
// 32): its smallest candidate (FwdConfigsFor).
int fwd_smem_bytes_of(int head_dim) {
  int bytes = -1;
  with_instantiable_head_dim(head_dim, [&](auto hd) {
    bytes = min_smem_bytes(typename FwdConfigsFor<decltype(hd)::value>::type{});
  });
  return bytes;
}

struct FwdTileFacts {
  int block_m, block_n, warps, smem_bytes, narrow;
};

template <class Cfg>
FwdTileFacts fwd_tile_facts() {
  return FwdTileFacts{Cfg::kBlockM, Cfg::kBlockN, Cfg::kWarps, Cfg::kSmemBytes, Cfg::kNarrow ? 1 : 0};
}

template <int kHeadDim>
FwdTileFacts fwd_tile_for(const PortattnFwdParams& params, int budget, bool extras) {
  const bool narrow = extras ? fwd_runs_narrow<kHeadDim, true>(params, budget)
                             : fwd_runs_narrow<kHeadDim, false>(params, budget);
  return narrow ? fwd_tile_facts<FwdTileConfig<kHeadDim, true>>() : fwd_tile_facts<FwdTileConfig<kHeadDim, false>>();
}

}  // namespace
}  // namespace cuda
}  // namespace portattn

using namespace portattn::cuda;

// The tile a forward call at an instantiable head dim would run under a shared-memory budget
// (bytes), as launch_fwd_shape picks it (fwd_runs_narrow): seqlen_q / seqlen_k (the longest of a
// varlen batch), masked != 0 for a causal or windowed call, extras != 0 for one with softcap,
// ALiBi or dropout. out[0..4] = block M, block N, warps, kSmemBytes, 1 for the narrow shape.
// Returns 0, or -1 for a head dim without a forward tile. No CUDA call: the host tests read the
// selection on a CPU.
extern "C" int portattn_cuda_fwd_tile(int head_dim, int seqlen_q, int seqlen_k, int masked, int extras, int budget,
                                      int* out) {
  PortattnFwdParams params{};
  params.seqlen_q = seqlen_q;
  params.seqlen_k = seqlen_k;
  params.window_left = -1;
  params.window_right = masked != 0 ? 0 : -1;
  FwdTileFacts t{};
  const bool known = with_instantiable_head_dim(head_dim, [&](auto hd) {
    t = fwd_tile_for<decltype(hd)::value>(params, budget, extras != 0);
  });
  if (!known) return -1;
  const int values[5] = {t.block_m, t.block_n, t.warps, t.smem_bytes, t.narrow};
  for (int k = 0; k < 5; ++k) out[k] = values[k];
  return 0;
}

// Bytes of dynamic shared memory the smallest forward tile serving `head_dim` needs
// (the same for both dtypes), or -1 when no built variant serves it. The
// support matrix compares it with the budget (the device's opt-in limit, or the cap).
extern "C" int portattn_cuda_fwd_smem_bytes(int head_dim) {
  const Variant<FwdFn>* variant = find_variant(kFwdVariants, kNumFwdVariants, head_dim, PORTATTN_FP16);
  if (variant == nullptr) variant = find_variant(kFwdVariants, kNumFwdVariants, head_dim, PORTATTN_BF16);
  return variant == nullptr ? -1 : fwd_smem_bytes_of(variant->head_dim);
}

extern "C" int portattn_cuda_fwd(const PortattnFwdParams* params, char* message, int message_len) {
  const Variant<FwdFn>* variant =
      find_variant(kFwdVariants, kNumFwdVariants, params->headdim, params->dtype);
  if (variant == nullptr) {
    char text[160];
    snprintf(text, sizeof(text), "portattn cuda: no forward kernel built for head_dim %d dtype %d",
             params->headdim, params->dtype);
    return fail(message, message_len, -1, text);
  }
  if (!aligned16(params->q) || !aligned16(params->k) || !aligned16(params->v) ||
      !aligned16(params->out) || !strides_aligned(params->q_strides) ||
      !strides_aligned(params->k_strides) || !strides_aligned(params->v_strides) ||
      !strides_aligned(params->out_strides)) {
    return fail(message, message_len, -1,
                "portattn cuda: q, k, v and out need 16-byte aligned data pointers and strides "
                "that are multiples of 8 elements (call .contiguous() on the input)");
  }
  if (!row_stride_fits(params->q_strides) || !row_stride_fits(params->k_strides) ||
      !row_stride_fits(params->v_strides)) {
    return fail(message, message_len, -1,
                "portattn cuda: a q/k/v row stride of 2^24 elements or more is not supported "
                "(call .contiguous() on the input)");
  }
  set_error_detail("");
  const cudaError_t err = variant->run(*params);
  if (err != cudaSuccess) {
    char text[400];
    snprintf(text, sizeof(text), "portattn cuda forward: %s%s%s", cudaGetErrorString(err),
             last_error_detail()[0] ? ": " : "", last_error_detail());
    return fail(message, message_len, static_cast<int>(err), text);
  }
  return 0;
}

// Note [portattn smem budget]: PORTATTN_MAX_SMEM_KIB, parsed by Python, in bytes (0: no cap).
extern "C" void portattn_cuda_set_smem_cap(int bytes) { set_smem_cap_bytes(bytes); }
extern "C" int portattn_cuda_smem_cap() { return smem_cap_bytes(); }

extern "C" const char* portattn_cuda_build_archs() { return kBuildArchs; }
extern "C" const char* portattn_cuda_build_ptx() { return kBuildPtx; }
extern "C" int portattn_cuda_num_fwd_variants() { return kNumFwdVariants; }
extern "C" void portattn_cuda_fwd_variant(int index, int* head_dim, int* dtype) {
  *head_dim = kFwdVariants[index].head_dim;
  *dtype = kFwdVariants[index].dtype;
}
