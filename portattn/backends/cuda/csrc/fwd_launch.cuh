// Host side of the forward kernel: grid shape, shared-memory opt-in, launch.
// Included by the generated per-(head dim, dtype) translation units
// (variants.py), each of which instantiates run_fwd for one variant.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>
#ifdef PORTATTN_FWD_TUNING
#include <stdlib.h>
#endif

#include "fwd_kernel.cuh"
#include "variant_table.h"

namespace portattn {
namespace cuda {

template <int kHeadDim, typename Elem, bool kExtras, bool kNarrow>
cudaError_t launch_fwd(const PortattnFwdParams& params) {
  using Traits = FwdKernelTraits<kHeadDim, Elem, kNarrow>;
  auto kernel = &fwd_kernel<kHeadDim, Elem, kExtras, kNarrow>;
  constexpr int kSmem = Traits::kSmemBytes;
  cudaError_t err = ensure_dynamic_smem(reinterpret_cast<const void*>(kernel), kSmem,
                                        &SmemOptIn<kHeadDim, Elem, kExtras, kNarrow ? 1 : 0>::state);
  if (err != cudaSuccess) return err;
  const dim3 grid((params.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, params.nheads,
                  params.batch);
  kernel<<<grid, Traits::kThreads, kSmem, static_cast<cudaStream_t>(params.stream)>>>(params);
  return cudaGetLastError();
}

// Note [portattn sm80 narrow tiles] (fwd_kernel.cuh): when the narrow shape runs
// (head dims <= 128; lengths are the longest of the batch for varlen). Measured on an
// H100, wide against narrow (with its early V), batch 512, 16 heads, hd 16/32/64, two
// rounds (archive:2026-11-26-ea1a3ea/narrow_ab):
//  * masked calls (causal, windows) up to 512 keys: narrow 1.03-2.8x (finer blocks
//    skip more of the masked triangle, and more CTAs hide each tile's latency);
//  * unmasked calls up to 256 keys: 1.01-2.8x (at 50 rows a quarter of the padded
//    area; at 100-256 rows parallelism);
//  * unmasked calls from 257 to 512: narrow wins where 64-row padding saves area (300:
//    1.32-1.38x) and loses where it does not (384, 512: 0.93-0.97).
// So: masked or <= 256, or an unmasked call whose 64-padded area is at most 7/8 of its
// 128-padded one; never past kNarrowMaxSeqlen (not measured there). At head dim 32 the
// narrow kernel runs five CTAs an SM (fwd_kernel.cuh) and wins further
// (archive:2026-11-26-49058fb/summary.md): every point up to 512 (1.05-3.1x, unmasked 384-512 included)
// and masked calls up to 1024 (768: 1.04-1.17x, 1024: 1.03-1.12x; unmasked 1024 0.97-1.00x,
// 2048 0.88-0.97x), so there it runs up to 512, and masked up to kNarrowMaskedMaxSeqlenHd32.
// Tuning builds (-DPORTATTN_FWD_TUNING) take PORTATTN_FWD_SHAPE=wide|narrow on every call
// instead, so one process can time both shapes.
constexpr int kNarrowMaxHeadDim = 128;
constexpr int kNarrowMaxSeqlen = 512;
// Head dims 96 and 128 (three CTAs an SM, 168 registers, 0 spills; archive:2026-11-26-a27a15a/n128_ab, the
// same A/B): narrow 1.64x at 50 rows, masked 100-300 1.00-1.42x (512: 0.94), unmasked 1.20x at 150 and
// 1.01x at 300 where 64-row padding saves a quarter of the area or more, 0.86-0.99x where it does not
// (100, 200, 256, 512). So there: at most kNarrowMaxSeqlenWide rows, masked or saving a quarter.
constexpr int kNarrowMaxSeqlenWide = 320;
constexpr int kNarrowAlwaysSeqlen = 256;
constexpr int kNarrowMaskedMaxSeqlenHd32 = 1024;

template <int kHeadDim>
inline bool narrow_pays(const PortattnFwdParams& params) {
#ifdef PORTATTN_FWD_TUNING
  const char* forced = getenv("PORTATTN_FWD_SHAPE");
  if (forced != nullptr && forced[0] == 'w') return false;
  if (forced != nullptr && forced[0] == 'n') return true;
#endif
  const int longest = params.seqlen_q > params.seqlen_k ? params.seqlen_q : params.seqlen_k;
  const bool masked = params.window_left >= 0 || params.window_right >= 0;
  auto padded = [](int length, int block) { return int64_t{(length + block - 1) / block} * block; };
  const int64_t wide_area = padded(params.seqlen_q, 128) * padded(params.seqlen_k, 128);
  const int64_t narrow_area = padded(params.seqlen_q, 64) * padded(params.seqlen_k, 64);
  if constexpr (kHeadDim <= 32) {
    return longest <= kNarrowMaxSeqlen || (masked && longest <= kNarrowMaskedMaxSeqlenHd32);
  } else if constexpr (kHeadDim > 64) {
    return longest <= kNarrowMaxSeqlenWide && (masked || 4 * narrow_area <= 3 * wide_area);
  }
  if (longest > kNarrowMaxSeqlen) return false;
  if (masked || longest <= kNarrowAlwaysSeqlen) return true;
  return 8 * narrow_area <= 7 * wide_area;
}

// Note [portattn sm80 narrow tiles above 128]
// Above head dim 128 the wide tile is 128 x 64 with 8 warps, one CTA an SM (222-255 registers,
// 80-128 KB). The narrow tile (64 x 64, 4 warps, the same registers a thread, 60-96 KB) runs two
// CTAs an SM where two fit the SM's shared memory (H100: every head dim; A100: 160 and 192), and
// then one CTA's barriers and softmax overlap the other's MMAs. FlashAttention-2 runs hd256 this
// way on sm90. Measured on an H200, plain calls, narrow against wide, one run (16k tokens a batch):
//   hd192: 1.05-1.21x at 512-16k, causal and not;   hd224: 1.00-1.14x at 512-16k;
//   hd160: <= 1k 1.02-1.13x; 4k 1.00x, causal 1.03x; 16k 0.99x, causal 0.99x;
//   hd256: <= 1k 1.01-1.14x; 4k 0.98x, causal 1.05x; 16k 0.99x, causal 0.98x
// and hd256 causal 8k 1.04x (the cuda_fwd_bwd_hd256 table against its previous version).
// So: narrow where two CTAs fit, at head dims 192 and 224 always, at 160 and 256 for calls of at
// most kNarrowLargeMaxSeqlen and masked calls of at most kNarrowLargeMaskedMaxSeqlen. Calls with
// softcap, ALiBi or dropout keep the wide tile (not measured).
// One CTA reserves 1 KiB of the SM's shared memory beside its own, and an SM holds the opt-in
// limit plus that 1 KiB (sm80 164 KiB, sm86/sm89 100, sm90 228), hence the test below; under
// PORTATTN_MAX_SMEM_KIB it reads the cap as the part's limit, like every other tile choice.
constexpr int kNarrowLargeMaxSeqlen = 1024;
constexpr int kNarrowLargeMaskedMaxSeqlen = 8192;
constexpr int kSmemReservedPerCta = 1024;

template <int kHeadDim>
inline bool narrow_pays_above_128(const PortattnFwdParams& params, int budget) {
#ifdef PORTATTN_FWD_TUNING
  const char* forced = getenv("PORTATTN_FWD_SHAPE");
  if (forced != nullptr && forced[0] == 'w') return false;
  if (forced != nullptr && forced[0] == 'n') return true;
#endif
  constexpr int kNarrowSmem = FwdTileConfig<kHeadDim, true>::kSmemBytes;
  if (2 * (kNarrowSmem + kSmemReservedPerCta) > budget + kSmemReservedPerCta) return false;
  const bool masked = params.window_left >= 0 || params.window_right >= 0;
  const int longest = params.seqlen_q > params.seqlen_k ? params.seqlen_q : params.seqlen_k;
  return kHeadDim == 192 || kHeadDim == 224 || longest <= kNarrowLargeMaxSeqlen ||
         (masked && longest <= kNarrowLargeMaskedMaxSeqlen);
}

// Whether a call runs the narrow tile: short sequences first (narrow_pays; above head dim 128
// narrow_pays_above_128), then the budget: the first of the head dim's candidates
// (FwdConfigsFor, fwd_kernel.cuh) that fits `budget` (Note [portattn smem budget]), so a 99 KiB
// part, or any GPU under PORTATTN_MAX_SMEM_KIB=99, runs the narrow tile at head dims 224 and 256.
// No CUDA call: launches and the host-side query (portattn_cuda_fwd_tile) share it.
template <int kHeadDim, bool kExtras>
bool fwd_runs_narrow(const PortattnFwdParams& params, int budget) {
  if constexpr (kHeadDim <= kNarrowMaxHeadDim) {
    if (narrow_pays<kHeadDim>(params)) return true;
  } else if constexpr (!kExtras) {
    if (narrow_pays_above_128<kHeadDim>(params, budget)) return true;
  }
  return with_first_fitting(budget, typename FwdConfigsFor<kHeadDim>::type{},
                            [](auto config) { return decltype(config)::kNarrow; });
}

// Whether fwd_runs_narrow can pick the narrow tile at all: where it cannot (calls with extras
// at 160 and 192), its kernel is not instantiated.
template <int kHeadDim, bool kExtras>
constexpr bool fwd_narrow_possible() {
  return kHeadDim <= kNarrowMaxHeadDim || !kExtras || FwdConfigsFor<kHeadDim>::kHasNarrow;
}

template <int kHeadDim, typename Elem, bool kExtras>
cudaError_t launch_fwd_shape(const PortattnFwdParams& params) {
  int budget = 0;  // up to head dim 128 one wide candidate fits every part: no budget read
  if constexpr (kHeadDim > kNarrowMaxHeadDim) {
    const cudaError_t err = smem_budget(&budget);
    if (err != cudaSuccess) return err;
  }
  if constexpr (fwd_narrow_possible<kHeadDim, kExtras>()) {
    if (fwd_runs_narrow<kHeadDim, kExtras>(params, budget)) return launch_fwd<kHeadDim, Elem, kExtras, true>(params);
  }
  return launch_fwd<kHeadDim, Elem, kExtras, false>(params);
}

template <int kHeadDim, typename Elem>
cudaError_t run_fwd(const PortattnFwdParams& params) {
  if (params.seqlen_q == 0 || params.batch == 0 || params.nheads == 0) return cudaSuccess;
  const bool extras =
      params.softcap > 0.f || params.alibi_slopes != nullptr || params.dropout_p > 0.f;
  return extras ? launch_fwd_shape<kHeadDim, Elem, true>(params)
                : launch_fwd_shape<kHeadDim, Elem, false>(params);
}

}  // namespace cuda
}  // namespace portattn
