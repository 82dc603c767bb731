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
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <mutex>

#include "bwd_launch.cuh"
#include "hopper_host.h"

namespace portattn {
namespace hopper {
namespace {

// PORTATTN_HOPPER_BWD_DQ (tuning; README): how the default mode adds dQ into its fp32
// accumulator. "auto" (unset, the default): bulk reductions wherever the staging tiles
// fit (head dims 64, 96, 128; 192 and 256 add per element, Traits::kBulkDqFits). Measured on the H100 (archive:2026-11-24-687cbc7/ab_H64.md and ab_H128.md),
// forward+backward at seqlen 1k-16k: hd64 bulk 1.02-1.11x the per-element v2
// reductions, as bulk adds one swizzled tile a step (the threshold kBulkDqMinHeadDim
// is kept for another head dim); "atomic" and "bulk" force
// one path (Note [portattn hopper bulk dQ]). Read once, at the first call;
// portattn_cuda_hopper_bwd_dq_mode changes it afterwards (tests and A/B
// scripts time both in one process). The deterministic mode takes the same choice and
// orders the adds by key block (Note [portattn hopper ordered dQ]).
enum HopperBwdDqMode : int { kDqModeAtomic = 0, kDqModeBulk = 1, kDqModeAuto = 2, kDqModeInvalid = -1 };
constexpr const char* kDqModeEnv = "PORTATTN_HOPPER_BWD_DQ";
constexpr int kBulkDqMinHeadDim = 64;
std::atomic<int> g_dq_mode{kDqModeAuto};
std::once_flag g_dq_mode_once;

int dq_mode_from_text(const char* text) {
  if (text == nullptr || *text == '\0' || strcmp(text, "auto") == 0) return kDqModeAuto;
  if (strcmp(text, "atomic") == 0) return kDqModeAtomic;
  if (strcmp(text, "bulk") == 0) return kDqModeBulk;
  return kDqModeInvalid;
}

int dq_mode() {
  std::call_once(g_dq_mode_once, [] { g_dq_mode.store(dq_mode_from_text(getenv(kDqModeEnv))); });
  return g_dq_mode.load();
}

}  // namespace

bool hopper_bwd_bulk_dq(int head_dim) {
  const int mode = dq_mode();
  return mode == kDqModeBulk || (mode == kDqModeAuto && head_dim >= kBulkDqMinHeadDim);
}

}  // namespace hopper
}  // namespace portattn

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
  if (dq_mode() == kDqModeInvalid) {
    char text[200];
    snprintf(text, sizeof(text), "portattn cuda hopper: %s is '%s'; expected 'auto' (default), 'atomic' or 'bulk'",
             kDqModeEnv, getenv(kDqModeEnv) ? getenv(kDqModeEnv) : "");
    return fail(message, message_len, -1, text);
  }
  char refusal[200];
  if (refuses(f, refusal, sizeof(refusal), /*varlen_served=*/true))
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
// 1 = bulk, 2 = auto sets it for the calls that follow; any other value only reads it.
// Returns the mode now in effect (-1: the environment variable holds neither
// name, and calls fail until a mode is set).
extern "C" int portattn_cuda_hopper_bwd_dq_mode(int mode) {
  using namespace portattn::hopper;
  dq_mode();  // the environment's value first, so a later first read cannot undo the set
  if (mode == kDqModeAtomic || mode == kDqModeBulk || mode == kDqModeAuto) g_dq_mode.store(mode);
  return g_dq_mode.load();
}
