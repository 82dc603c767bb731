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

#include "hopper_fwd_schedule.h"
#include "hopper_host.h"
#include "variant_table.h"

extern "C" int portattn_cuda_fwd(const PortattnFwdParams* params, char* message, int message_len);

namespace {

// Note [portattn hopper short calls on narrow tiles]
// A head-dim-64 call of at most 512 rows and keys runs the sm80+ kernel's narrow 64 x 64
// tiles (Note [portattn sm80 narrow tiles]) instead of the Hopper kernel when 64-row
// padding leaves at most 3/4 of the area that 128-row padding does. Why: the Hopper tile
// is 128 x 128, so a 50-row sequence computes 6.5x its area and a 300-row one 1.6x; per
// padded area the Hopper kernel is ~1.33x faster (bench_short.py on an H100 at 100 and
// 200 rows, where both pad alike: 128 against 97, 181 against 134 TFLOP/s), so the narrow
// tiles win where they pad 3/4 or less: measured at 50 rows 1.8x (no mask) and 2.0x
// (causal), at 300 rows 1.0x and 1.18x (archive:2026-11-26-ea1a3ea/short). With equal
// lengths the rule picks 1-64, 129-192 and 257-320 rows; the 129-192 band (9/16 of the
// area) is extrapolated, measured against cuDNN only: 1.15x and 1.30x at 150 rows
// (archive:2026-11-26-65fc311/summary.md).
// Varlen calls are judged by their longest sequences (the only lengths the host knows
// without reading cu_seqlens): 64k tokens in documents of 32-300 run 1.32x (no mask) and
// 1.5x (causal) faster on the narrow tiles (archive:2026-11-26-8afa150/varlen_short_r1.md). A packed batch
// whose longest document is 193-256 rows stays on the Hopper kernel, which is right for
// equal lengths and not measured for mixed ones.
// Windows other than causal and softcap stay on the Hopper kernel (not measured). The
// backward is unaffected: either forward pairs with either backward (the same O and LSE).
// Head dims 96 and 128: per padded area the Hopper kernel is 1.3-1.7x the narrow tiles (batch 512,
// 100 and 200 rows: 143 against 111, 259 against 153 TFLOP/s), so only dense calls of at most 64 rows
// and keys (a quarter of the area) go: 1.36x (no mask) and 1.5x (causal) at 50 rows; at 150 and 300
// rows the Hopper kernel is ahead or within 6%, and 64k tokens of documents of 32-300 run 1.12x faster
// narrow, but a packed batch of equal 200-row documents would run 1.7x slower there, and the host
// knows only the longest (archive:2026-11-26-a27a15a/n128_short).
bool short_call_prefers_narrow(const PortattnFwdParams& p) {
  if (p.headdim > 128 || p.softcap > 0.f || p.window_left >= 0 || p.window_right > 0) return false;
  if (p.seqlen_q > 512 || p.seqlen_k > 512) return false;
  const bool wide_head = p.headdim > 64;
  if (wide_head && (p.cu_seqlens_q != nullptr || p.cu_seqlens_k != nullptr)) return false;
  auto padded = [](int length, int block) { return int64_t{(length + block - 1) / block} * block; };
  const int64_t narrow_area = padded(p.seqlen_q, 64) * padded(p.seqlen_k, 64);
  const int64_t hopper_area = padded(p.seqlen_q, 128) * padded(p.seqlen_k, 128);
  return wide_head ? 4 * narrow_area <= hopper_area : 4 * narrow_area <= 3 * hopper_area;
}

}  // namespace

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
  // (Only layouts the sm80+ entry takes: a call it would refuse stays here.)
  if (short_call_prefers_narrow(*params) && row_stride_fits(params->q_strides) &&
      row_stride_fits(params->k_strides) && row_stride_fits(params->v_strides))
    return portattn_cuda_fwd(params, message, message_len);
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

// Tuning builds (-DPORTATTN_HOPPER_TUNING, hopper_fwd_schedule.h): the values
// PORTATTN_HOPPER_FWD_SCHEDULE accepts at `head_dim`, written to `out` (at most
// `capacity`); returns how many. `added` = 0: the single schedules (<bits>),
// 1: the additions to the defaults (+<bits>). 0 in every other build, and for
// a head dim this build has no kernel for.
extern "C" int portattn_cuda_hopper_fwd_tuning(int head_dim, int added, int* out, int capacity) {
  int count = 0;
#ifdef PORTATTN_HOPPER_TUNING
  bool built = false;
  for (int i = 0; i < portattn::cuda::kNumHopperFwdVariants; ++i)
    built = built || portattn::cuda::kHopperFwdVariants[i].head_dim == head_dim;
  if (!built) return 0;
  const int* list = added ? portattn::hopper::kTuningAdditions : portattn::hopper::kTuningSchedules;
  const int size = added ? portattn::hopper::kNumTuningAdditions : portattn::hopper::kNumTuningSchedules;
  for (int i = 0; i < size; ++i) {
    // An addition applies at every head dim (run_default drops what is not
    // admitted), but it adds nothing where no bit of it is admitted.
    const int bits = list[i];
    if (portattn::hopper::admitted_bits(head_dim, bits) != bits) continue;
    if (count < capacity) out[count] = bits;
    ++count;
  }
#else
  (void)head_dim;
  (void)added;
  (void)out;
  (void)capacity;
#endif
  return count;
}
