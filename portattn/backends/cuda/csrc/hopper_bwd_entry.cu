// C entry point of the Hopper backward kernel (hopper_bwd_kernel.cuh):
//   int portattn_cuda_hopper_bwd(const PortattnBwdParams*, char* message, int message_len)
// 0 on success; otherwise nonzero with the reason in `message`, including for
// every call it does not serve (hopper_host.h: refuses; dispatch sends those
// to the sm80+ entry portattn_cuda_bwd through capability/specs/cuda_sm90.py).
//
// The workspace is the sm80+ backward's (bwd_workspace_layout, so Python sizes
// it with the same bwd_workspace_bytes) and the launch sequence is its
// run_bwd_sequence (memset, preprocess, main, convert per chunk of KV heads);
// only the main kernel is this file's.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <mutex>

#include "bwd_launch.cuh"
#include "hopper_bwd_kernel.cuh"
#include "hopper_host.h"

namespace portattn {
namespace hopper {
namespace {

using HopperBwdFn = cudaError_t (*)(const PortattnBwdParams&);

template <int kHeadDim, typename Elem, int kMask, bool kSoftcap, bool kBulkDq>
struct HopperBwdSmemOptIn {
  static cuda::SmemOptInState state;
};
template <int kHeadDim, typename Elem, int kMask, bool kSoftcap, bool kBulkDq>
cuda::SmemOptInState HopperBwdSmemOptIn<kHeadDim, Elem, kMask, kSoftcap, kBulkDq>::state = {0ull};

struct TensorMaps {
  CUtensorMap q, k, v, dout;
};

template <int kHeadDim, typename Elem, int kMask, bool kSoftcap, bool kBulkDq>
cudaError_t launch_main(const TensorMaps& maps, const cuda::BwdArgs& args, cudaStream_t stream) {
  using Traits = HopperBwdTraits<kHeadDim, kBulkDq>;
  auto kernel = &hopper_bwd_kernel<kHeadDim, Elem, kMask, kSoftcap, kBulkDq>;
  const cudaError_t err = cuda::ensure_dynamic_smem(
      reinterpret_cast<const void*>(kernel), Traits::kSmemBytes,
      &HopperBwdSmemOptIn<kHeadDim, Elem, kMask, kSoftcap, kBulkDq>::state);
  if (err != cudaSuccess) return err;
  const PortattnFwdParams& f = args.p.fwd;
  const int n_blocks = (f.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
  const bool det = args.p.deterministic != 0;
  const dim3 grid(det ? args.splits : n_blocks, det ? args.heads_k : args.heads, f.batch);
  if (grid.x == 0) return cudaSuccess;
  // tanhf's argument as the forward computes it (hopper_fwd_entry.cu), so both see
  // the same value; a kernel parameter, read from the constant bank, holds no register.
  const float softcap_scale = kSoftcap ? f.softmax_scale / f.softcap : 0.f;
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(maps.q, maps.k, maps.v, maps.dout, args,
                                                                 softcap_scale);
  return cudaGetLastError();
}

// The main kernel of this call's mask (window) with or without softcap.
template <int kHeadDim, typename Elem, bool kSoftcap, bool kBulkDq>
cudaError_t launch_masked(const TensorMaps& maps, const cuda::BwdArgs& args, cudaStream_t stream) {
  const PortattnFwdParams& f = args.p.fwd;
  if (f.window_left < 0 && f.window_right < 0)
    return launch_main<kHeadDim, Elem, kBwdMaskNone, kSoftcap, kBulkDq>(maps, args, stream);
  if (f.window_left < 0 && f.window_right == 0)
    return launch_main<kHeadDim, Elem, kBwdMaskCausal, kSoftcap, kBulkDq>(maps, args, stream);
  return launch_main<kHeadDim, Elem, kBwdMaskLocal, kSoftcap, kBulkDq>(maps, args, stream);
}

// PORTATTN_HOPPER_BWD_DQ (tuning; README): how the default mode adds dQ into
// its fp32 accumulator. "atomic" (unset, the default): v2 reductions from the
// consumers' registers; "bulk": Note [portattn hopper bulk dQ]. Read once, at
// the first call; portattn_cuda_hopper_bwd_dq_mode changes it afterwards (tests
// and bench/hopper_bwd_ab.py time both in one process). The deterministic mode
// always uses the atomic path.
enum HopperBwdDqMode : int { kDqModeAtomic = 0, kDqModeBulk = 1, kDqModeInvalid = -1 };
constexpr const char* kDqModeEnv = "PORTATTN_HOPPER_BWD_DQ";
std::atomic<int> g_dq_mode{kDqModeAtomic};
std::once_flag g_dq_mode_once;

int dq_mode_from_text(const char* text) {
  if (text == nullptr || *text == '\0' || strcmp(text, "atomic") == 0) return kDqModeAtomic;
  if (strcmp(text, "bulk") == 0) return kDqModeBulk;
  return kDqModeInvalid;
}

int dq_mode() {
  std::call_once(g_dq_mode_once, [] { g_dq_mode.store(dq_mode_from_text(getenv(kDqModeEnv))); });
  return g_dq_mode.load();
}

template <int kHeadDim, typename Elem>
cudaError_t run(const PortattnBwdParams& params) {
  using Traits = HopperBwdTraits<kHeadDim>;
  const PortattnFwdParams& f = params.fwd;
  if (f.batch == 0 || f.nheads == 0) return cudaSuccess;
  TensorMaps maps;
  cudaError_t err = encode_bshd(&maps.q, f.q, f.q_strides, f.dtype, f.batch, f.seqlen_q, f.nheads,
                                kHeadDim, Traits::kBlockM);
  if (err == cudaSuccess)
    err = encode_bshd(&maps.dout, params.dout, params.dout_strides, f.dtype, f.batch, f.seqlen_q,
                      f.nheads, kHeadDim, Traits::kBlockM);
  if (err == cudaSuccess)
    err = encode_bshd(&maps.k, f.k, f.k_strides, f.dtype, f.batch, f.seqlen_k, f.nheads_k, kHeadDim,
                      Traits::kBlockN);
  if (err == cudaSuccess)
    err = encode_bshd(&maps.v, f.v, f.v_strides, f.dtype, f.batch, f.seqlen_k, f.nheads_k, kHeadDim,
                      Traits::kBlockN);
  if (err != cudaSuccess) return err;
  const bool softcap = f.softcap > 0.f;
  const bool bulk = params.deterministic == 0 && dq_mode() == kDqModeBulk;
  return cuda::run_bwd_sequence<Elem>(params, [&maps, softcap, bulk](const cuda::BwdArgs& args,
                                                                     cudaStream_t stream) {
    if (bulk)
      return softcap ? launch_masked<kHeadDim, Elem, true, true>(maps, args, stream)
                     : launch_masked<kHeadDim, Elem, false, true>(maps, args, stream);
    return softcap ? launch_masked<kHeadDim, Elem, true, false>(maps, args, stream)
                   : launch_masked<kHeadDim, Elem, false, false>(maps, args, stream);
  });
}

struct HopperBwdVariant {
  int head_dim;
  int dtype;  // PortattnDtype
  HopperBwdFn run;
};

// The instantiated (head dim, dtype) pairs, the forward's (hopper_fwd_entry.cu);
// the mask and softcap are run-time choices inside run().
constexpr HopperBwdVariant kBwdVariants[] = {
    {64, PORTATTN_FP16, &run<64, __half>},
    {64, PORTATTN_BF16, &run<64, __nv_bfloat16>},
    {128, PORTATTN_FP16, &run<128, __half>},
    {128, PORTATTN_BF16, &run<128, __nv_bfloat16>},
};

}  // namespace
}  // namespace hopper
}  // namespace portattn

extern "C" int portattn_cuda_hopper_bwd(const PortattnBwdParams* params, char* message, int message_len) {
  using namespace portattn::hopper;
  using portattn::cuda::fail;
  const PortattnFwdParams& f = params->fwd;
  const HopperBwdVariant* variant = nullptr;
  for (const HopperBwdVariant& v : kBwdVariants)
    if (v.head_dim == f.headdim && v.dtype == f.dtype) variant = &v;
  if (variant == nullptr) {
    char text[160];
    snprintf(text, sizeof(text),
             "portattn cuda hopper: no backward kernel for head_dim %d dtype %d (built: 64, 128; fp16, bf16)",
             f.headdim, f.dtype);
    return fail(message, message_len, -1, text);
  }
  if (dq_mode() == kDqModeInvalid) {
    char text[200];
    snprintf(text, sizeof(text), "portattn cuda hopper: %s is '%s'; expected 'atomic' (default) or 'bulk'",
             kDqModeEnv, getenv(kDqModeEnv) ? getenv(kDqModeEnv) : "");
    return fail(message, message_len, -1, text);
  }
  char refusal[200];
  if (refuses(f, refusal, sizeof(refusal), /*varlen_served=*/false))
    return fail(message, message_len, -1, refusal);
  if (!portattn::cuda::bwd_operands_aligned(*params))
    return fail(message, message_len, -1,
                "portattn cuda hopper: dout, dq, dk and dv need 16-byte aligned data pointers and "
                "strides that are multiples of 8 elements");
  portattn::cuda::set_error_detail("");
  const cudaError_t err = variant->run(*params);
  if (err != cudaSuccess) {
    char text[400];
    snprintf(text, sizeof(text), "portattn cuda hopper backward: %s%s%s", cudaGetErrorString(err),
             portattn::cuda::last_error_detail()[0] ? ": " : "", portattn::cuda::last_error_detail());
    return fail(message, message_len, static_cast<int>(err), text);
  }
  return 0;
}

// The default mode's dQ path (PORTATTN_HOPPER_BWD_DQ; tuning): mode 0 = atomic,
// 1 = bulk sets it for the calls that follow; any other value only reads it.
// Returns the mode now in effect (-1: the environment variable holds neither
// name, and calls fail until a mode is set).
extern "C" int portattn_cuda_hopper_bwd_dq_mode(int mode) {
  using namespace portattn::hopper;
  dq_mode();  // the environment's value first, so a later first read cannot undo the set
  if (mode == kDqModeAtomic || mode == kDqModeBulk) g_dq_mode.store(mode);
  return g_dq_mode.load();
}
