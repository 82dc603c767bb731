// The Hopper backward's host side (hopper_bwd_kernel.cuh): the main kernel's launch
// and `run_hopper_bwd<kHeadDim, Elem>`, the run template of the "hopper_bwd" family
// (Note [portattn cuda variants]): each generated hopper_bwd_hd<D>_<dtype>.cu
// instantiates it once; hopper_bwd_entry.cu looks the call up in the generated table.
//
// The workspace is laid out by the sm80+ backward's bwd_workspace_layout with
// ordered_dq (Python sizes it with bwd_workspace_bytes(..., ordered_dq=True): the deterministic
// mode keeps one dQ accumulator and its dq_order counts instead of slices) and the
// launch sequence is its run_bwd_sequence (memset, preprocess, main, convert per
// chunk of KV heads); only the main kernel is this file's. The accumulators' row pitch is
// the kernel's head dim, also for a call served padded (Note [portattn hopper padded head
// dims], backward part; Python sizes it the same way, hopper_bwd_acc_head_dim).
#pragma once
#include "bwd_launch.cuh"
#include "hopper_bwd_kernel.cuh"
#include "hopper_host.h"

namespace portattn {
namespace hopper {

template <int kHeadDim, typename Elem, int kMask, bool kSoftcap, bool kBulkDq, bool kOrderedDq, int kPart>
struct HopperBwdSmemOptIn {
  static cuda::SmemOptInState state;
};
template <int kHeadDim, typename Elem, int kMask, bool kSoftcap, bool kBulkDq, bool kOrderedDq, int kPart>
cuda::SmemOptInState HopperBwdSmemOptIn<kHeadDim, Elem, kMask, kSoftcap, kBulkDq, kOrderedDq, kPart>::state = {0ull};

// Whether the default (non-deterministic) mode adds dQ with bulk reductions at this head
// dim (Note [portattn hopper bulk dQ]; PORTATTN_HOPPER_BWD_DQ, hopper_bwd_entry.cu).
bool hopper_bwd_bulk_dq(int head_dim);

struct TensorMaps {
  CUtensorMap q, k, v, dout;
  CUtensorMap dk, dv;  // 64-row boxes: one consumer warpgroup's keys (Note [portattn hopper dK/dV store])
};

template <int kHeadDim, typename Elem, int kMask, bool kSoftcap, bool kBulkDq, bool kOrderedDq, int kPart = 0>
cudaError_t launch_main(const TensorMaps& maps, const cuda::BwdArgs& args, cudaStream_t stream) {
  using Traits =
      HopperBwdTraits<kHeadDim, kBulkDq, false, kPart, wide_steps(kHeadDim, kMask, kSoftcap, kBulkDq, kOrderedDq)>;
  // hd192 in one launch of both parts (kBothParts), or one launch per part (Note [portattn hopper
  // hd192 backward]); the shared memory layout is the same for both parts.
  constexpr bool kOneLaunch = Traits::kParts > 1 && hd192_one_launch(kMask == kBwdMaskLocal, kSoftcap, kOrderedDq);
  constexpr int kKernelPart = kOneLaunch ? kBothParts : kPart;
  const PortattnFwdParams& f = args.p.fwd;
  if constexpr (kPart > 0 && !kOneLaunch) {
    // hd192's second launch (Note [portattn hopper hd192 backward]) orders its dQ adds from a
    // count of zero again; the first launch left each count at its query block's key blocks.
    if (args.dq_order != nullptr) {
      const int64_t counts = static_cast<int64_t>(f.batch) * args.heads *
                             ((f.seqlen_q + cuda::kDqOrderRows - 1) / cuda::kDqOrderRows);
      const cudaError_t err = cudaMemsetAsync(args.dq_order, 0, counts * sizeof(int), stream);
      if (err != cudaSuccess) return err;
    }
  }
  auto kernel = &hopper_bwd_kernel<kHeadDim, Elem, kMask, kSoftcap, kBulkDq, kOrderedDq, kKernelPart>;
  const cudaError_t err = cuda::ensure_dynamic_smem(
      reinterpret_cast<const void*>(kernel), Traits::kSmemBytes,
      &HopperBwdSmemOptIn<kHeadDim, Elem, kMask, kSoftcap, kBulkDq, kOrderedDq, kKernelPart>::state);
  if (err != cudaSuccess) return err;
  const int n_blocks = (f.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
  const bool det = args.p.deterministic != 0;
  // Deterministic: per (key block, KV head), walking the group's query heads, so dK/dV
  // sum in registers; dQ adds ordered by key block (Note [portattn hopper ordered dQ]).
  // The dependences point to lower blockIdx.x of the same (y, z), which the hardware
  // starts first, so a waiting CTA's predecessors are running or done.
  // Split head dim (Note [portattn hopper split head dim]): the key block's halves side by side.
  // Note [portattn hopper key blocks per CTA]: the default mode may give a CTA several key blocks
  // (n, n + the grid's width, ...); the deterministic one keeps one, which its dQ order needs.
  const int per_cta = det ? 1 : kHopperBwdBlocksPerCta;
  const dim3 grid(((n_blocks + per_cta - 1) / per_cta) * (kOneLaunch ? 2 : Traits::kHalves),
                  det ? args.heads_k : args.heads, f.batch);
  if (grid.x == 0) return cudaSuccess;
  // tanhf's argument as the forward computes it (hopper_fwd_launch.cuh), so both see
  // the same value; a kernel parameter, read from the constant bank, holds no register.
  const float softcap_scale = kSoftcap ? f.softmax_scale / f.softcap : 0.f;
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(maps.q, maps.k, maps.v, maps.dout, maps.dk,
                                                                 maps.dv, args, softcap_scale);
  const cudaError_t launched = cudaGetLastError();
  if constexpr (!kOneLaunch && kPart + 1 < Traits::kParts) {
    if (launched != cudaSuccess) return launched;
    return launch_main<kHeadDim, Elem, kMask, kSoftcap, kBulkDq, kOrderedDq, kPart + 1>(maps, args, stream);
  }
  return launched;
}

// The main kernel of this call's mask (window) with or without softcap.
template <int kHeadDim, typename Elem, bool kSoftcap, bool kBulkDq, bool kOrderedDq>
cudaError_t launch_masked(const TensorMaps& maps, const cuda::BwdArgs& args, cudaStream_t stream) {
  const PortattnFwdParams& f = args.p.fwd;
  if (f.window_left < 0 && f.window_right < 0)
    return launch_main<kHeadDim, Elem, kBwdMaskNone, kSoftcap, kBulkDq, kOrderedDq>(maps, args, stream);
  if (f.window_left < 0 && f.window_right == 0)
    return launch_main<kHeadDim, Elem, kBwdMaskCausal, kSoftcap, kBulkDq, kOrderedDq>(maps, args, stream);
  return launch_main<kHeadDim, Elem, kBwdMaskLocal, kSoftcap, kBulkDq, kOrderedDq>(maps, args, stream);
}

// The family's run template: the mask and softcap are run-time choices here.
template <int kHeadDim, typename Elem>
cudaError_t run_hopper_bwd(const PortattnBwdParams& params) {
  using Traits = HopperBwdTraits<kHeadDim>;
  const PortattnFwdParams& f = params.fwd;
  if (f.batch == 0 || f.nheads == 0) return cudaSuccess;
  // A head dim below kHeadDim runs padded (Note [portattn hopper padded head dims], backward
  // part): the workspace Python sized has rows of hopper_bwd_acc_head_dim(f.headdim), which
  // must be this kernel's; a padded row is read back in whole groups of 8 swizzled chunks
  // (bwd_convert_dq), hence multiples of 32. Anything else is a table error
  // (variants.HOPPER_BWD_PADDED), refused before it could overrun the workspace.
  if (cuda::hopper_bwd_acc_head_dim(f.headdim) != kHeadDim || f.headdim % 32 != 0) {
    char text[128];
    snprintf(text, sizeof(text), "head_dim %d cannot run on the hd%d backward kernel", f.headdim, kHeadDim);
    cuda::set_error_detail(text);
    return cudaErrorInvalidValue;
  }
  // The call's head dim, not kHeadDim, is every map's innermost extent: loads zero-fill
  // the padded columns, the dK/dV stores clip them.
  const bool softcap = f.softcap > 0.f;
  // Both modes take the bulk or per-element adds as PORTATTN_HOPPER_BWD_DQ says; the
  // deterministic one orders either by key block (Note [portattn hopper ordered dQ]).
  const bool det = params.deterministic != 0;
  // The split head dim adds dQ per element (its staging tiles do not fit).
  const bool bulk = Traits::kBulkDqFits && hopper_bwd_bulk_dq(kHeadDim);
  // Q / dO boxes of the kernel's query step (Note [portattn hopper 80-query steps]).
  const bool no_mask = f.window_left < 0 && f.window_right < 0;
  const int q_box = wide_steps(kHeadDim, no_mask ? kBwdMaskNone : kBwdMaskCausal, softcap, bulk, det)
                        ? kWideStepRows
                        : Traits::kBlockM;
  MapExtents extents;
  cudaError_t err = map_extents(f, &extents);
  TensorMaps maps;
  if (err == cudaSuccess)
    err = encode_bshd(&maps.q, f.q, f.q_strides, f.dtype, extents.batch, extents.rows_q, f.nheads, f.headdim, q_box);
  if (err == cudaSuccess)
    err = encode_bshd(&maps.dout, params.dout, params.dout_strides, f.dtype, extents.batch, extents.rows_q,
                      f.nheads, f.headdim, q_box);
  if (err == cudaSuccess)
    err = encode_bshd(&maps.k, f.k, f.k_strides, f.dtype, extents.batch, extents.rows_k, f.nheads_k,
                      f.headdim, Traits::kBlockN);
  if (err == cudaSuccess)
    err = encode_bshd(&maps.v, f.v, f.v_strides, f.dtype, extents.batch, extents.rows_k, f.nheads_k,
                      f.headdim, Traits::kBlockN);
  if (err == cudaSuccess)
    err = encode_bshd(&maps.dk, params.dk, params.dk_strides, f.dtype, extents.batch, extents.rows_k, f.nheads_k,
                      f.headdim, 64);
  if (err == cudaSuccess)
    err = encode_bshd(&maps.dv, params.dv, params.dv_strides, f.dtype, extents.batch, extents.rows_k, f.nheads_k,
                      f.headdim, 64);
  if (err != cudaSuccess) return err;
  return cuda::run_bwd_sequence<Elem>(
      params,
      [&maps, softcap, bulk, det](const cuda::BwdArgs& args, cudaStream_t stream) {
        if constexpr (Traits::kBulkDqFits) {
          if (det && bulk)
            return softcap ? launch_masked<kHeadDim, Elem, true, true, true>(maps, args, stream)
                           : launch_masked<kHeadDim, Elem, false, true, true>(maps, args, stream);
          if (bulk)
            return softcap ? launch_masked<kHeadDim, Elem, true, true, false>(maps, args, stream)
                           : launch_masked<kHeadDim, Elem, false, true, false>(maps, args, stream);
        }
        if (det)
          return softcap ? launch_masked<kHeadDim, Elem, true, false, true>(maps, args, stream)
                         : launch_masked<kHeadDim, Elem, false, false, true>(maps, args, stream);
        return softcap ? launch_masked<kHeadDim, Elem, true, false, false>(maps, args, stream)
                       : launch_masked<kHeadDim, Elem, false, false, false>(maps, args, stream);
      },
      /*ordered_dq=*/true, /*dq_swizzled=*/bulk, /*acc_head_dim=*/kHeadDim);
}

}  // namespace hopper
}  // namespace portattn
