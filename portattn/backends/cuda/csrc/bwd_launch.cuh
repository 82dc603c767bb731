// Host side of the backward pass (Note [portattn cuda backward] in
// bwd_kernel.cuh): block-shape choice per head dim and device, workspace
// carve-up, and the launch sequence. Included by the generated per-(head dim,
// dtype) translation units (variants.py, family "bwd"), each of which
// instantiates run_bwd for one variant.
#pragma once
#include <cuda_runtime.h>

#include "bwd_kernel.cuh"
#include "bwd_wide_kernel.cuh"
#include "variant_table.h"

namespace portattn {
namespace cuda {

// ---- block shapes ------------------------------------------------------------------
//
// Candidates per head dim, fastest first; the first whose shared memory fits
// the budget (the device's opt-in limit, read from the device, never assumed
// from the arch, lowered by PORTATTN_MAX_SMEM_KIB: Note [portattn smem budget])
// runs (with_first_fitting, smem_budget.h). Budgets (bytes, kStages x Q/dO buffers included):
//   hd 32   128x64x2   49 KB   fits every sm80+ part
//   hd 64   128x64x2   81 KB   fits sm86/sm89 (99 KB)
//   hd 96   128x64x2  113 KB   sm80/sm90;   128x64x1  89 KB elsewhere
//   hd 128  128x64x2  145 KB   sm80/sm90;    64x64x1  73 KB elsewhere
//   hd 160   64x64x1   89 KB   (head-dim halves over grid.z from here on)
//   hd 192   64x32x1   77 KB
//   hd 224   64x32x1   89 KB
//   hd 256   64x32x1  100 KB   sm80/sm90;    48x32x1  83 KB elsewhere (3 warps)
// Each warp owns 16 keys, so kBlockN = 128 means 8 warps; the dK + dV
// accumulators then cost kDOut registers per thread (<= 128), which is what
// caps the unsplit head dim at 128. Two Q/dO stages are worth a full tile of
// shared memory where it exists: the next query block then loads during the
// whole step instead of only during the dQ product.
// portattn_cuda_bwd_smem_bytes() (bwd_entry.cu) reports the smallest budget
// per head dim to the support matrix through build_config()["smem_bytes"].
// Registers (ptxas -v, sm_90, nvcc 13.0, no extras): 255 per thread for every
// shape except hd 32 (172); spills are small and sit outside the S/dP loop
// (hd 64: none; hd 96-256: 36-152 bytes of stores). Alternatives measured on
// an H100 and rejected (docs/kernels-sm80.md): square
// 32x32 warp tiles with P^T/dS^T through shared memory (fewer ldmatrix, one
// more barrier: 4-20% slower), 64-key CTAs at 2 per SM (3-7% slower),
// 128x128 blocks at hd 64 (spills inside the main loop).
template <class... Cfgs>
using BwdCandidates = TileCandidates<Cfgs...>;

template <int kHeadDim>
struct BwdConfigsFor;
template <>
struct BwdConfigsFor<32> {
  using type = BwdCandidates<BwdTileConfig<32, 128, 64, 2>>;
};
template <>
struct BwdConfigsFor<64> {
  using type = BwdCandidates<BwdTileConfig<64, 128, 64, 2>>;
};
template <>
struct BwdConfigsFor<96> {
  using type = BwdCandidates<BwdTileConfig<96, 128, 64, 2>, BwdTileConfig<96, 128, 64, 1>>;
};
template <>
struct BwdConfigsFor<128> {
  using type = BwdCandidates<BwdTileConfig<128, 128, 64, 2>, BwdTileConfig<128, 64, 64, 1>>;
};
template <>
struct BwdConfigsFor<160> {
  using type = BwdCandidates<BwdTileConfig<160, 64, 64, 1>>;
};
template <>
struct BwdConfigsFor<192> {
  using type = BwdCandidates<BwdTileConfig<192, 64, 32, 1>>;
};
template <>
struct BwdConfigsFor<224> {
  using type = BwdCandidates<BwdTileConfig<224, 64, 32, 1>>;
};
template <>
struct BwdConfigsFor<256> {
  using type = BwdCandidates<BwdTileConfig<256, 64, 32, 1>, BwdTileConfig<256, 48, 32, 1>>;
};

// The full-head-dim kernel (Note [portattn sm80 wide backward] in bwd_wide_kernel.cuh), run
// instead of BwdConfigsFor's tiles where one of its candidates fits the budget, unless
// PORTATTN_SM80_BWD_WIDE=0 (bwd_wide_enabled). BwdWideConfig<head dim, block N, block M, Q/dO
// stages, warps, warps sharing the keys in the dK/dV products>, fastest first (FlashAttention-2's
// shapes: 128 x 64 at 96/128 and 64 x 64 above, 8 warps; one Q/dO buffer where two do not fit;
// 32-query blocks under 99 KiB). Shared memory (bytes; sm90 227 KiB = 232448, sm80 163 KiB =
// 166912, sm86/sm89 99 KiB = 101376) and dK + dV fp32 registers a thread:
//   hd  64 128x128x2 165888 | 128x64x2 99328                  dK/dV warps 4 x 2: 32 x  32, 64 regs
//   hd  96 128x64x2 132096                                    dK/dV warps 4 x 2: 32 x  48, 96 regs
//   hd 128 128x64x2 164864                                    dK/dV warps 4 x 2: 32 x  64, 128 regs
//   hd 160  64x64x2 140288 | 64x64x1  98816                   dK/dV warps 4 x 2: 16 x  80, 80 regs
//   hd 192  64x64x2 164864 | 64x64x1 115200 | 64x32x1  82176   dK/dV warps 2 x 4: 32 x  48, 96 regs
//   hd 224  64x64x2 189440 | 64x64x1 131584 | 64x32x1  94464   dK/dV warps 4 x 2: 16 x 112, 112 regs
//   hd 256  64x64x2 214016 | 64x64x1 147968 | 48x32x1  88320   dK/dV warps 2 x 4: 32 x  64, 128 regs
//                                                 (6 warps: 3 x 2, 16 x 128, 128 regs)
// so sm90 runs the first column, sm80 too except 64x64x1 at 224/256, the 99 KiB parts the last
// column above 128 (64x64x1 at 160) and 128x64x2 at 64. hd 256 under 99 KiB: neither 64 x 32 nor
// 32 x 64 fits (106752, 107008 bytes), hence 48 keys and 6 warps. At 96 and 128 the 99 KiB parts
// keep bwd_kernel (its 128 x 64 x 1 and 64 x 64 x 1 tiles): the wide kernel's 64 x 64 x 1 at hd128
// ran 0.86-0.90x of them (H200 at a 99 KiB cap, fwd+bwd 1k-16k). Forward+backward against
// bwd_kernel on an H200, 1k-16k (docs/kernels-sm80.md): hd64 128 x 128 x 2 (FA2's hd64 tile)
// 1.07-1.12x, 128 x 64 x 2 1.00-1.02x (also under a 99 KiB cap); the 128 x 64 x 2 tile 1.04-1.08x at
// 128 and 1.01-1.07x at 96, before its 32 x 32 phase-1 warp tiles (1.02-1.04x more).
// A head dim without an entry keeps bwd_kernel.
template <int kHeadDim>
struct BwdWideConfigsFor {
  static constexpr bool kDefined = false;
};
// The 128-key tiles run phase 1 on 32-key warp tiles (BwdWideConfig::kSRows; 32 x 32 at 128 x 64),
// unless built with -DPORTATTN_SM80_BWD_WIDE_S32=0 (16 x 64 at 96/128, the A/B: 0.96-0.99x).
#ifndef PORTATTN_SM80_BWD_WIDE_S32
#define PORTATTN_SM80_BWD_WIDE_S32 1
#endif
constexpr int kWide128SRows = PORTATTN_SM80_BWD_WIDE_S32 ? 32 : 16;
template <>
struct BwdWideConfigsFor<64> {
  static constexpr bool kDefined = true;
  // 128 x 128 for plain calls only: its extras kernel (232 B of spills at sm_90) ran 0.73-0.85x
  // bwd_kernel's with dropout or softcap, where 128 x 64 ran 1.02-1.03x (H200, 1k-16k).
  using type = BwdCandidates<BwdWideConfig<64, 128, 128, 2, 8, 4, 32, true>, BwdWideConfig<64, 128, 64, 2, 8, 4, 32>>;
};
template <>
struct BwdWideConfigsFor<96> {
  static constexpr bool kDefined = true;
  using type = BwdCandidates<BwdWideConfig<96, 128, 64, 2, 8, 4, kWide128SRows>>;
};
template <>
struct BwdWideConfigsFor<128> {
  static constexpr bool kDefined = true;
  using type = BwdCandidates<BwdWideConfig<128, 128, 64, 2, 8, 4, kWide128SRows>>;
};
template <>
struct BwdWideConfigsFor<160> {
  static constexpr bool kDefined = true;
  using type = BwdCandidates<BwdWideConfig<160, 64, 64, 2, 8, 4>, BwdWideConfig<160, 64, 64, 1, 8, 4>>;
};
template <>
struct BwdWideConfigsFor<192> {
  static constexpr bool kDefined = true;
  using type = BwdCandidates<BwdWideConfig<192, 64, 64, 2, 8, 2>, BwdWideConfig<192, 64, 64, 1, 8, 2>,
                             BwdWideConfig<192, 64, 32, 1, 8, 2>>;
};
template <>
struct BwdWideConfigsFor<224> {
  static constexpr bool kDefined = true;
  using type = BwdCandidates<BwdWideConfig<224, 64, 64, 2, 8, 4>, BwdWideConfig<224, 64, 64, 1, 8, 4>,
                             BwdWideConfig<224, 64, 32, 1, 8, 4>>;
};
template <>
struct BwdWideConfigsFor<256> {
  static constexpr bool kDefined = true;
  using type = BwdCandidates<BwdWideConfig<256, 64, 64, 2, 8, 2>, BwdWideConfig<256, 64, 64, 1, 8, 2>,
                             BwdWideConfig<256, 48, 32, 1, 6, 3>>;
};

// PORTATTN_SM80_BWD_WIDE (default on; "0" runs bwd_kernel: the halves above 128): read once, at the first backward call or workspace
// query; portattn_cuda_sm80_bwd_wide (bwd_entry.cu) changes it afterwards (tests, A/B scripts).
// It also sets the deterministic split count (det_splits: no head-dim halves), so the
// workspace query and the call must see the same value.
bool bwd_wide_enabled();

// Whether a call at kHeadDim runs the wide kernel: the switch is on and one of its tiles fits the
// budget. Below its smallest tile (only under a PORTATTN_MAX_SMEM_KIB cap: every sm80+ part offers
// 99 KiB) the halves run, whose smallest tiles are what the support matrix was told
// (portattn_cuda_bwd_smem_bytes).
template <int kHeadDim>
bool bwd_wide_runs(bool enabled, int budget) {
  if constexpr (BwdWideConfigsFor<kHeadDim>::kDefined)
    return enabled && budget >= min_smem_bytes(typename BwdWideConfigsFor<kHeadDim>::type{});
  else
    return false;
}

// Tile facts of a config for the host-side queries (portattn_cuda_bwd_tile).
struct BwdTileFacts {
  int block_n, block_m, stages, warps, smem_bytes, dsplit, wide;
};
template <class Cfg>
constexpr BwdTileFacts bwd_tile_facts() {
  return BwdTileFacts{Cfg::kBlockN, Cfg::kBlockM, Cfg::kStages, Cfg::kWarps, Cfg::kSmemBytes, Cfg::kDSplit,
                      Cfg::kWide ? 1 : 0};
}

// ---- workspace -------------------------------------------------------------------------

// Byte offsets into PortattnBwdParams::workspace, sized for one chunk of
// heads. Everything from `dq_order` on (the ordered mode's counts and the fp32 accumulators)
// is zeroed before each chunk's main kernel, by the preprocess or a memset
// (Note [portattn backward zeroing]); delta and lse2 come first, outside that region.
struct BwdWorkspace {
  int64_t delta, lse2, dq_order, dq, dk, dv, total;
  int64_t dq_slice;   // elements of one dQ slice
  int slices;         // 1, or the deterministic split count
  bool dkv_accum;     // GQA in the default mode
  int chunk_heads_k;  // KV heads per chunk (nheads_k when not chunked)
  int ws_rows;        // rows per (batch, head): seqlen_q, padded to 8 for the blocked dQ (BwdArgs)
};

// Defined in bwd_entry.cu (one definition: the size Python allocates and the
// carve-up the launch uses cannot disagree).
// ordered_dq: the Hopper backward's layout (Note [portattn hopper ordered dQ]).
// acc_head_dim: the fp32 accumulators' row pitch (BwdArgs::acc_head_dim), >= f.headdim.
BwdWorkspace bwd_workspace_layout(const PortattnBwdParams& params, bool ordered_dq, int acc_head_dim);
// Every tensor of the call (q, k, v, out, dout, dq, dk, dv): 16-byte aligned
// pointer and strides, as the 16-byte loads and TMA need.
bool bwd_operands_aligned(const PortattnBwdParams& params);

template <typename Elem>
cudaError_t launch_bwd_preprocess(const BwdArgs& args, cudaStream_t stream);
template <typename Elem>
cudaError_t launch_bwd_convert(const BwdArgs& args, int slices, bool dkv_accum, cudaStream_t stream);

template <class Cfg, typename Elem, bool kExtras>
struct BwdSmemState {
  static SmemOptInState state;
};
template <class Cfg, typename Elem, bool kExtras>
SmemOptInState BwdSmemState<Cfg, Elem, kExtras>::state = {0ull};

template <class Cfg, typename Elem, bool kExtras>
cudaError_t launch_bwd_main(const BwdArgs& args, cudaStream_t stream) {
  void (*kernel)(const BwdArgs);
  if constexpr (Cfg::kWide)
    kernel = &bwd_wide_kernel<Cfg, Elem, kExtras>;
  else
    kernel = &bwd_kernel<Cfg, Elem, kExtras>;
  cudaError_t err = ensure_dynamic_smem(reinterpret_cast<const void*>(kernel), Cfg::kSmemBytes,
                                        &BwdSmemState<Cfg, Elem, kExtras>::state);
  if (err != cudaSuccess) return err;
  const PortattnFwdParams& f = args.p.fwd;
  const int n_blocks = (f.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN;
  const bool det = args.p.deterministic != 0;
  const dim3 grid(det ? args.splits : n_blocks, det ? args.heads_k : args.heads, f.batch * Cfg::kDSplit);
  if (grid.x == 0) return cudaSuccess;
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(args);
  return cudaGetLastError();
}

// with_first_fitting (smem_budget.h) for the backward: an extras call also skips the kPlainOnly
// candidates, which are never last.
template <class Cfg, class... Rest, class Fn>
auto with_first_serving(int budget, bool extras, TileCandidates<Cfg, Rest...>, Fn&& fn) {
  if constexpr (sizeof...(Rest) > 0) {
    if (Cfg::kSmemBytes > budget || (extras && Cfg::kPlainOnly))
      return with_first_serving(budget, extras, TileCandidates<Rest...>{}, fn);
  } else {
    static_assert(!Cfg::kPlainOnly, "the last candidate serves every call");
  }
  return fn(Cfg{});
}

// The first candidate that fits `budget` and serves the call (with_first_serving); the last one
// runs regardless, and ensure_dynamic_smem reports a clear error if even it does not fit.
template <class Candidates, typename Elem>
cudaError_t launch_first_fitting(const BwdArgs& args, int budget, cudaStream_t stream) {
  const PortattnFwdParams& f = args.p.fwd;
  const bool extras = f.softcap > 0.f || f.alibi_slopes != nullptr || f.dropout_p > 0.f;
  return with_first_serving(budget, extras, Candidates{}, [&](auto config) {
    using Cfg = decltype(config);
    if constexpr (Cfg::kPlainOnly)
      return launch_bwd_main<Cfg, Elem, false>(args, stream);  // never an extras call
    else
      return extras ? launch_bwd_main<Cfg, Elem, true>(args, stream) : launch_bwd_main<Cfg, Elem, false>(args, stream);
  });
}

// The launch sequence of Note [portattn cuda backward] around a main-kernel
// launcher `main(args, stream) -> cudaError_t`: shared by run_bwd below and the
// Hopper backward (hopper_bwd_launch.cuh), which differ only in that launch.
// `ordered_dq` (the Hopper backward): its layout (bwd_workspace_layout), where the
// deterministic mode adds into one dQ accumulator in key-block order through the
// dq_order counts instead of into one slice per split.
// `dq_swizzled`: the main kernel adds dQ in the swizzled row layout of its bulk mode
// (Note [portattn hopper bulk dQ]), which the convert kernel then reads.
// `acc_head_dim`: the accumulators' row pitch, 0 = f.headdim (the sm80+ kernels); the
// Hopper backward passes its kernel's head dim (hopper_bwd_acc_head_dim).
template <typename Elem, class MainLaunch>
cudaError_t run_bwd_sequence(const PortattnBwdParams& params, MainLaunch&& main, bool ordered_dq = false,
                             bool dq_swizzled = false, int acc_head_dim = 0) {
  const PortattnFwdParams& f = params.fwd;
  if (f.batch == 0 || f.nheads == 0) return cudaSuccess;
  if (acc_head_dim == 0) acc_head_dim = f.headdim;
  const BwdWorkspace ws = bwd_workspace_layout(params, ordered_dq, acc_head_dim);
  if (params.workspace_bytes < ws.total || (ws.total > 0 && params.workspace == nullptr)) {
    set_error_detail("backward workspace smaller than bwd_workspace_bytes() reported");
    return cudaErrorInvalidValue;
  }
  char* base = static_cast<char*>(params.workspace);
  BwdArgs args;
  args.p = params;
  args.delta = reinterpret_cast<float*>(base + ws.delta);
  args.lse2 = reinterpret_cast<float*>(base + ws.lse2);
  args.dq_accum = reinterpret_cast<float*>(base + ws.dq);
  args.dk_accum = ws.dkv_accum ? reinterpret_cast<float*>(base + ws.dk) : nullptr;
  args.dv_accum = ws.dkv_accum ? reinterpret_cast<float*>(base + ws.dv) : nullptr;
  args.dq_slice = ws.dq_slice;
  args.ws_rows = ws.ws_rows;
  args.splits = ws.slices;
  args.dq_order = ordered_dq && params.deterministic != 0 ? reinterpret_cast<int*>(base + ws.dq_order) : nullptr;
  args.dq_swizzled = dq_swizzled;
  args.dq_blocked = !ordered_dq;  // the sm80+ kernels (Note [portattn sm80 blocked dQ])
  args.acc_head_dim = acc_head_dim;
  args.zero_begin = base + ws.dq_order;
  args.zero_bytes = ws.total - ws.dq_order;
  cudaStream_t stream = static_cast<cudaStream_t>(f.stream);
  const int group = f.nheads / f.nheads_k;
  for (int head_k0 = 0; head_k0 < f.nheads_k; head_k0 += ws.chunk_heads_k) {
    args.heads_k = ws.chunk_heads_k < f.nheads_k - head_k0 ? ws.chunk_heads_k : f.nheads_k - head_k0;
    args.heads = args.heads_k * group;
    args.head0 = head_k0 * group;
    // The preprocess zeroes the accumulators, or a memset before it does (Note [portattn backward
    // zeroing] in bwd_kernel.cuh; launch_bwd_preprocess decides).
    cudaError_t err = launch_bwd_preprocess<Elem>(args, stream);
    if (err != cudaSuccess) return err;
    err = main(static_cast<const BwdArgs&>(args), stream);
    if (err != cudaSuccess) return err;
    err = launch_bwd_convert<Elem>(args, ws.slices, ws.dkv_accum, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

template <int kHeadDim, typename Elem>
cudaError_t run_bwd(const PortattnBwdParams& params) {
  return run_bwd_sequence<Elem>(params, [](const BwdArgs& args, cudaStream_t stream) {
    int budget = 0;
    const cudaError_t err = smem_budget(&budget);
    if (err != cudaSuccess) return err;
    if constexpr (BwdWideConfigsFor<kHeadDim>::kDefined) {
      if (bwd_wide_runs<kHeadDim>(bwd_wide_enabled(), budget))
        return launch_first_fitting<typename BwdWideConfigsFor<kHeadDim>::type, Elem>(args, budget, stream);
    }
    return launch_first_fitting<typename BwdConfigsFor<kHeadDim>::type, Elem>(args, budget, stream);
  });
}

}  // namespace cuda
}  // namespace portattn
