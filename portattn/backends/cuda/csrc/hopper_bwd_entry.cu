// C entry point of the Hopper backward kernel (hopper_bwd_kernel.cuh):
//   int portattn_cuda_hopper_bwd(const PortattnBwdParams*, char* message, int message_len)
// 0 on success; otherwise nonzero with the reason in `message`, including for
// every call it does not serve (hopper_host.h: refuses; dispatch sends those
// to the sm80+ entry portattn_cuda_bwd through capability/specs/cuda_sm90.py).
//
// The kernels it runs are the generated "hopper_bwd" family (Note [portattn cuda
// variants]; launch, workspace and launch sequence: hopper_bwd_launch.cuh), found in
// kHopperBwdVariants.
#include <stdio.h>

#include "bwd_launch.cuh"
#include "hopper_host.h"

extern "C" int portattn_cuda_hopper_bwd(const PortattnBwdParams* params, char* message, int message_len) {
  using namespace portattn::hopper;
  using namespace portattn::cuda;
  const PortattnFwdParams& f = params->fwd;
  const Variant<BwdFn>* variant = find_exact_variant(kHopperBwdVariants, kNumHopperBwdVariants, f.headdim, f.dtype);
  if (variant == nullptr) {
    char built[160], text[256];
    describe_variants(kHopperBwdVariants, kNumHopperBwdVariants, built, sizeof(built));
    snprintf(text, sizeof(text), "portattn cuda hopper: no backward kernel for head_dim %d dtype %s (built: %s)",
             f.headdim, dtype_name(f.dtype), built);
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
