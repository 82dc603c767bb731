// C entry point of the Hopper forward kernel (hopper_fwd_kernel.cuh):
//   int portattn_cuda_hopper_fwd(const PortattnFwdParams*, char* message, int message_len)
// 0 on success; otherwise nonzero with the reason in `message`, including for
// every call this first version does not serve (it is not in dispatch; the
// sm80+ entry portattn_cuda_fwd serves everything).
//
// Compiled only when the build opts in (PORTATTN_CUDA_HOPPER=1, variants.py),
// and then only for sm_90a: wgmma and setmaxnreg exist nowhere else.
//
// Tensor maps and the calls it refuses: hopper_host.h.
#include <stdio.h>

#include "hopper_fwd_kernel.cuh"
#include "hopper_host.h"
#include "variant_table.h"

namespace portattn {
namespace hopper {
namespace {

using HopperFn = cudaError_t (*)(const PortattnFwdParams&);

// Its own opt-in flags: the sm80+ kernels' SmemOptIn<hd, Elem, bool> would alias.
template <int kHeadDim, typename Elem, bool kCausal>
struct HopperSmemOptIn {
  static portattn::cuda::SmemOptInState state;
};
template <int kHeadDim, typename Elem, bool kCausal>
portattn::cuda::SmemOptInState HopperSmemOptIn<kHeadDim, Elem, kCausal>::state = {0ull};

template <int kHeadDim, typename Elem, bool kCausal>
cudaError_t launch(const PortattnFwdParams& params) {
  using Traits = HopperFwdTraits<kHeadDim>;
  auto kernel = &hopper_fwd_kernel<kHeadDim, Elem, kCausal>;
  cudaError_t err = portattn::cuda::ensure_dynamic_smem(
      reinterpret_cast<const void*>(kernel), Traits::kSmemBytes,
      &HopperSmemOptIn<kHeadDim, Elem, kCausal>::state);
  if (err != cudaSuccess) return err;
  CUtensorMap tm_q, tm_k, tm_v;
  err = encode_bshd(&tm_q, params.q, params.q_strides, params.dtype, params.batch,
                    params.seqlen_q, params.nheads, kHeadDim, Traits::kBlockM);
  if (err == cudaSuccess)
    err = encode_bshd(&tm_k, params.k, params.k_strides, params.dtype, params.batch,
                      params.seqlen_k, params.nheads_k, kHeadDim, Traits::kBlockN);
  if (err == cudaSuccess)
    err = encode_bshd(&tm_v, params.v, params.v_strides, params.dtype, params.batch,
                      params.seqlen_k, params.nheads_k, kHeadDim, Traits::kBlockN);
  if (err != cudaSuccess) return err;
  HopperFwdArgs args;
  args.out = params.out;
  args.out_strides = params.out_strides;
  args.lse = params.lse;
  args.lse_batch_stride = params.lse_batch_stride;
  args.lse_head_stride = params.lse_head_stride;
  args.seqlen_q = params.seqlen_q;
  args.seqlen_k = params.seqlen_k;
  args.heads_per_kv = params.nheads / params.nheads_k;
  args.scale_log2 = params.softmax_scale * softmax::kLog2e;
  const dim3 grid((params.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, params.nheads,
                  params.batch);
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, static_cast<cudaStream_t>(params.stream)>>>(
      tm_q, tm_k, tm_v, args);
  return cudaGetLastError();
}

template <int kHeadDim, typename Elem>
cudaError_t run(const PortattnFwdParams& params) {
  if (params.seqlen_q == 0 || params.batch == 0 || params.nheads == 0) return cudaSuccess;
  return params.window_right == 0 ? launch<kHeadDim, Elem, true>(params)
                                  : launch<kHeadDim, Elem, false>(params);
}

struct HopperVariant {
  int head_dim;
  int dtype;  // PortattnDtype
  HopperFn run;
};

// The instantiated (head dim, dtype) pairs; causal is a run-time choice inside run().
constexpr HopperVariant kVariants[] = {
    {64, PORTATTN_FP16, &run<64, __half>},
    {64, PORTATTN_BF16, &run<64, __nv_bfloat16>},
    {128, PORTATTN_FP16, &run<128, __half>},
    {128, PORTATTN_BF16, &run<128, __nv_bfloat16>},
};

const HopperVariant* find(int head_dim, int dtype) {
  for (const HopperVariant& v : kVariants)
    if (v.head_dim == head_dim && v.dtype == dtype) return &v;
  return nullptr;
}

}  // namespace
}  // namespace hopper
}  // namespace portattn

extern "C" int portattn_cuda_hopper_fwd(const PortattnFwdParams* params, char* message,
                                        int message_len) {
  using namespace portattn::hopper;
  using portattn::cuda::fail;
  const HopperVariant* variant = find(params->headdim, params->dtype);
  if (variant == nullptr) {
    char text[160];
    snprintf(text, sizeof(text),
             "portattn cuda hopper: no kernel for head_dim %d dtype %d (built: 64, 128; fp16, bf16)",
             params->headdim, params->dtype);
    return fail(message, message_len, -1, text);
  }
  char refusal[200];
  if (refuses(*params, refusal, sizeof(refusal))) return fail(message, message_len, -1, refusal);
  portattn::cuda::set_error_detail("");
  const cudaError_t err = variant->run(*params);
  if (err != cudaSuccess) {
    char text[400];
    snprintf(text, sizeof(text), "portattn cuda hopper forward: %s%s%s", cudaGetErrorString(err),
             portattn::cuda::last_error_detail()[0] ? ": " : "", portattn::cuda::last_error_detail());
    return fail(message, message_len, static_cast<int>(err), text);
  }
  return 0;
}

// What this build contains, for build_config()["hopper"] (the support matrix's head dims).
extern "C" int portattn_cuda_hopper_num_variants() {
  return static_cast<int>(sizeof(portattn::hopper::kVariants) / sizeof(portattn::hopper::kVariants[0]));
}

extern "C" void portattn_cuda_hopper_variant(int index, int* head_dim, int* dtype) {
  *head_dim = portattn::hopper::kVariants[index].head_dim;
  *dtype = portattn::hopper::kVariants[index].dtype;
}
