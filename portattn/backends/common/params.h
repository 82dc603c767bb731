// portattn C ABI: the one boundary between Python and every compiled kernel.
//
// Both vendor backends (backends/cuda, backends/rocm) implement the same two
// entry points over these structs. Kernels see raw pointers, element strides
// and a stream handle only: no libtorch types cross this line, so one binary
// works with every torch version and the ROCm backend builds without torch.
//
// Conventions (Note [portattn semantics], mirrored in docs/ARCHITECTURE.md):
// - Layout (batch, seqlen, heads, headdim); strides are in elements, the last
//   dimension is contiguous. Varlen calls pack sequences along the seqlen axis
//   and pass cu_seqlens (int32, batch + 1 entries); their batch strides are 0.
// - Masking is one rule: key j is visible to query i when
//     i + seqlen_k - seqlen_q - window_left <= j   (if window_left  >= 0)
//     j <= i + seqlen_k - seqlen_q + window_right  (if window_right >= 0)
//   "causal" is window_right == 0 (bottom-right aligned, as flash-attn >= 2.1).
// - Scores: s = scale * q.k; if softcap > 0: s = softcap * tanh(s / softcap);
//   then ALiBi adds -slope * |i + seqlen_k - seqlen_q - j|; then the mask.
// - LSE is the natural-log log-sum-exp of the masked scores, fp32, layout
//   (batch, heads, seqlen_q) or (heads, total_q) for varlen. A row with no
//   visible key gets out = 0 and lse = -inf.
// - Dropout acts on the normalised probabilities; kept entries are scaled by
//   1 / (1 - p). The keep decision is philox.h's, so forward, backward and
//   the reference backend agree bit for bit on the mask.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum PortattnDtype { PORTATTN_FP16 = 0, PORTATTN_BF16 = 1 };

typedef struct PortattnTensor4 {
  // Strides (elements) of a (batch, seqlen, heads, headdim) tensor; the
  // headdim stride is 1 by contract and therefore absent.
  int64_t batch_stride;
  int64_t row_stride;
  int64_t head_stride;
} PortattnTensor4;

typedef struct PortattnFwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;  // null: not wanted (inference calls); else written for every row

  PortattnTensor4 q_strides, k_strides, v_strides, out_strides;
  int64_t lse_batch_stride;  // lse[b * lse_batch_stride + h * lse_head_stride + i]
  int64_t lse_head_stride;

  int dtype;  // PortattnDtype
  int batch;
  int nheads;
  int nheads_k;  // nheads % nheads_k == 0 (GQA/MQA), checked in Python
  int headdim;   // multiple of 8, <= the backend's maximum
  int seqlen_q;  // max over the batch for varlen
  int seqlen_k;

  // Varlen: non-null cu_seqlens_q/k switch the kernel to packed sequences. Their
  // values (and seqused_k's) are device data no kernel trusts: seq_bounds.h.
  const int32_t* cu_seqlens_q;
  const int32_t* cu_seqlens_k;
  const int32_t* seqused_k;  // optional: keys actually used per sequence (kv cache)

  float softmax_scale;
  float softcap;     // 0 = off
  int window_left;   // -1 = unbounded
  int window_right;  // -1 = unbounded; 0 = causal

  const float* alibi_slopes;  // null = off; (nheads,) or (batch, nheads) fp32
  int64_t alibi_batch_stride; // 0 for (nheads,)

  float dropout_p;  // 0 = off
  uint64_t philox_seed;
  uint64_t philox_offset;

  void* stream;  // cudaStream_t / hipStream_t

  // Rows along the sequence axis of q (out, dq) and k/v (dk, dv): the packed
  // total over the batch for varlen, seqlen_q / seqlen_k per batch entry
  // otherwise; filled for every call (abi.py). Varlen kernels clamp each
  // sequence's rows to them on the device (seq_bounds.h), and the Hopper
  // kernels' tensor maps take them as the extent.
  int64_t total_q;
  int64_t total_k;
} PortattnFwdParams;

typedef struct PortattnBwdParams {
  PortattnFwdParams fwd;  // the forward call's inputs (out and lse as produced)

  const void* dout;
  PortattnTensor4 dout_strides;
  void* dq;
  void* dk;
  void* dv;
  PortattnTensor4 dq_strides, dk_strides, dv_strides;

  // Scratch owned by the caller (allocated in Python through torch so the
  // caching allocator serves it): sizes come from the backend's
  // bwd_workspace_bytes(), never computed twice.
  void* workspace;
  int64_t workspace_bytes;

  int deterministic;  // 1: bitwise reproducible dq (no fp32 atomics race)
} PortattnBwdParams;

#ifdef __cplusplus
}
#endif
