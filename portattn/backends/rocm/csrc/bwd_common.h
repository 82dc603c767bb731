// What both backward families share (Note [portattn rocm backward] in
// bwd_kernel.h; the CDNA kernels there, the RDNA ones in wmma_bwd_kernel.h):
// the workspace rowsum kernel, the per-element probability and softcap
// derivative, the LSE in log2 units, and the launch of the three kernels.
// No matrix instruction here, so one source serves wave64 and wave32.
#pragma once
#include <limits.h>
#include <math.h>

#include "cdna.h"  // first: hip_runtime.h defines __forceinline__ for the common headers

#include "../../common/online_softmax.h"
#include "../../common/params.h"
#include "../../common/philox.h"
#include "registry.h"
#include "tiles.h"

namespace portattn {
namespace rocm {
namespace PORTATTN_ROCM_ARCH_NS {

__device__ __forceinline__ float* rowdot_row(const PortattnBwdParams& p, int b, int h) {
  return static_cast<float*>(p.workspace) + bwd_rowdot_offset(p.fwd.nheads, p.fwd.seqlen_q, b, h);
}

// Per-lane LSE in log2 units; rows without a visible key (lse = -inf) and
// rows past the sequence get +inf, which turns every exp2 of the row into 0.
__device__ __forceinline__ float lse_log2_or_inf(const PortattnFwdParams& p, const SeqBounds& seq, int b,
                                                 int h, int i) {
  if (i >= seq.len_q) return __builtin_huge_valf();
  const float lse = p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + seq.q_start + i];
  return lse == -__builtin_huge_valf() ? __builtin_huge_valf() : lse * softmax::kLog2e;
}

// ---------------------------------------------------------------------------
// 1. Dr = rowsum(dO * O): one lane per (query row, head), 16-byte reads.

constexpr int kRowdotThreads = 256;

template <bool kIsBf16>
__global__ void PORTATTN_LAUNCH_BOUNDS(kRowdotThreads, 4) bwd_rowdot_kernel(const PortattnBwdParams p) {
  using T = Dtype<kIsBf16>;
  const int b = blockIdx.z, h = blockIdx.y;
  const SeqBounds seq = seq_bounds(p.fwd, b);
  const int i = blockIdx.x * kRowdotThreads + threadIdx.x;
  if (i >= seq.len_q) return;
  const uint16_t* gO = head_row(p.fwd.out, p.fwd.out_strides, b, seq.q_start + i, h);
  const uint16_t* gdO = head_row(p.dout, p.dout_strides, b, seq.q_start + i, h);
  float sum = 0.f;
  for (int d = 0; d < p.fwd.headdim; d += 8) {
    const u32x4 o = load<u32x4>(gO + d), dout = load<u32x4>(gdO + d);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int shift = 16 * (e % 2);
      sum += T::to_float(static_cast<uint16_t>(o[e / 2] >> shift)) *
             T::to_float(static_cast<uint16_t>(dout[e / 2] >> shift));
    }
  }
  rowdot_row(p, b, h)[i] = sum;
}

// Per-element score transform shared by every backward kernel: returns the
// probability (0 where masked) and, with softcap, the tanh factor of its
// derivative. `x` is q.k.
struct ScoreOptions {
  float scale, softcap, slope;
  bool use_softcap, use_alibi;
};

__device__ __forceinline__ ScoreOptions score_options(const PortattnFwdParams& p, int b, int h) {
  return ScoreOptions{p.softmax_scale, p.softcap,
                      p.alibi_slopes != nullptr ? p.alibi_slopes[b * p.alibi_batch_stride + h] : 0.f,
                      p.softcap > 0.f, p.alibi_slopes != nullptr};
}

__device__ __forceinline__ float probability(float qk, const ScoreOptions& o, int rel, float lse_log2,
                                             bool visible, float& dtanh) {
  float x = qk * o.scale;
  dtanh = 1.f;
  if (o.use_softcap) {
    const float t = tanhf(x / o.softcap);
    x = o.softcap * t;
    dtanh = 1.f - t * t;
  }
  if (o.use_alibi) x -= o.slope * fabsf(static_cast<float>(rel));
  return visible ? softmax::exp2_fast(x * softmax::kLog2e - lse_log2) : 0.f;
}

// Launches rowdot, dq (when there are queries) and dkdv (when there are keys).
// Every valid dK/dV row is written by the dkdv kernel (zeros where no query
// sees the key) and every dQ row by the dq kernel, so nothing is memset.
template <class DqTile, class DkdvTile>
hipError_t launch_bwd_kernels(const PortattnBwdParams& p, void (*dq_kernel)(const PortattnBwdParams),
                              void (*dkdv_kernel)(const PortattnBwdParams)) {
  static_assert(DqTile::kIsBf16 == DkdvTile::kIsBf16, "one dtype per variant");
  const hipStream_t stream = static_cast<hipStream_t>(p.fwd.stream);
  if (p.fwd.seqlen_q > 0) {
    const dim3 rowdot_grid((p.fwd.seqlen_q + kRowdotThreads - 1) / kRowdotThreads, p.fwd.nheads, p.fwd.batch);
    hipLaunchKernelGGL(bwd_rowdot_kernel<DqTile::kIsBf16>, rowdot_grid, dim3(kRowdotThreads), 0, stream, p);
    const hipError_t status = hipGetLastError();
    if (status != hipSuccess) return status;
    const dim3 dq_grid((p.fwd.seqlen_q + DqTile::kBlockM - 1) / DqTile::kBlockM * DqTile::kDimSplit, p.fwd.nheads,
                       p.fwd.batch);
    hipLaunchKernelGGL(dq_kernel, dq_grid, dim3(DqTile::kThreads), 0, stream, p);
    const hipError_t dq_status = hipGetLastError();
    if (dq_status != hipSuccess) return dq_status;
  }
  if (p.fwd.seqlen_k == 0) return hipSuccess;
  const dim3 dkdv_grid((p.fwd.seqlen_k + DkdvTile::kBlockN - 1) / DkdvTile::kBlockN * DkdvTile::kDimSplit,
                       p.fwd.nheads_k, p.fwd.batch);
  hipLaunchKernelGGL(dkdv_kernel, dkdv_grid, dim3(DkdvTile::kThreads), 0, stream, p);
  return hipGetLastError();
}

}  // namespace PORTATTN_ROCM_ARCH_NS
}  // namespace rocm
}  // namespace portattn
