// C entry point of the Hopper forward kernel (hopper_fwd_kernel.cuh):
//   int portattn_cuda_hopper_fwd(const PortattnFwdParams*, char* message, int message_len)
// 0 on success; otherwise nonzero with the reason in `message`, including for
// every call the Hopper path does not serve (dispatch never sends those here:
// capability/specs/cuda_sm90.py declares them; the sm80+ entry
// portattn_cuda_fwd serves everything).
//
// Compiled whenever the build's archs include sm_90 (variants.py), and then
// only for sm_90a: wgmma and setmaxnreg exist nowhere else. The kernels it
// runs are the generated "hopper_fwd" family (Note [portattn cuda variants];
// launch and schedules: hopper_fwd_launch.cuh), found in kHopperFwdVariants.
//
// Tensor maps and the calls it refuses: hopper_host.h.
#include <stdio.h>

#include "hopper_host.h"
#include "variant_table.h"

extern "C" int portattn_cuda_hopper_fwd(const PortattnFwdParams* params, char* message,
                                        int message_len) {
  using namespace portattn::cuda;
  const Variant<FwdFn>* variant =
      find_exact_variant(kHopperFwdVariants, kNumHopperFwdVariants, params->headdim, params->dtype);
  if (variant == nullptr) {
    char built[160], text[256];
    describe_variants(kHopperFwdVariants, kNumHopperFwdVariants, built, sizeof(built));
    snprintf(text, sizeof(text), "portattn cuda hopper: no kernel for head_dim %d dtype %s (built: %s)",
             params->headdim, dtype_name(params->dtype), built);
    return fail(message, message_len, -1, text);
  }
  char refusal[200];
  if (portattn::hopper::refuses(*params, refusal, sizeof(refusal), /*varlen_served=*/true))
    return fail(message, message_len, -1, refusal);
  set_error_detail("");
  const cudaError_t err = variant->run(*params);
  if (err != cudaSuccess) {
    char text[400];
    snprintf(text, sizeof(text), "portattn cuda hopper forward: %s%s%s", cudaGetErrorString(err),
             last_error_detail()[0] ? ": " : "", last_error_detail());
    return fail(message, message_len, static_cast<int>(err), text);
  }
  return 0;
}

// What this build contains, for build_config()["hopper"] (the support matrix's head dims):
// the forward's pairs. The backward family holds those of them whose head dim is in
// variants.HOPPER_BWD_HEAD_DIMS (no hd256); the spec's forward_only_head_dims names the rest.
extern "C" int portattn_cuda_hopper_num_variants() { return portattn::cuda::kNumHopperFwdVariants; }

extern "C" void portattn_cuda_hopper_variant(int index, int* head_dim, int* dtype) {
  *head_dim = portattn::cuda::kHopperFwdVariants[index].head_dim;
  *dtype = portattn::cuda::kHopperFwdVariants[index].dtype;
}
