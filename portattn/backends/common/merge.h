// Note [portattn merge attention states]
//
// merge(out, lse, block_out, block_lse) folds one partial attention result (block_out,
// block_lse: attention of the same queries over another set of keys) into an accumulated
// one (out, lse), in place. Every (batch, token, head) row is independent:
//
//   w    = sigmoid(block_lse - lse)                 (block's share of the merged softmax)
//   out  = out - w * (out - block_out)              (= (1 - w) out + w block_out)
//   lse  = lse - logsigmoid(lse - block_lse)        (= log(exp(lse) + exp(block_lse)))
//
// This is ring-flash-attn's update_out_and_lse (utils._update_out_and_lse), op for op in
// fp32 with the same roundings (no fused multiply-add), so installing the kernel in its
// place changes no result beyond the exp/log1p implementations' last bit. An infinite
// LSE marks a partial result over no keys (portattn writes -inf; flash-attn 2 writes
// +inf): it contributes nothing, so an empty block leaves the row as it is and an empty
// accumulator takes the block's row exactly, never NaN; two empty ones give lse = -inf.
//
// One pass: each row's out and block_out are read once and out written once (rows whose
// block is empty are not written), in 16-byte accesses where the layout allows.
#pragma once
#include <math.h>
#include <stdint.h>

#include "host_device.h"
#include "params.h"

#ifdef __cplusplus
extern "C" {
#endif

// Element types of out / block_out: PortattnDtype's fp16 and bf16, and fp32.
#define PORTATTN_MERGE_FP32 2

typedef struct PortattnMergeParams {
  void* out;              // (batch, seqlen, nheads, headdim), updated in place
  float* lse;             // one fp32 per (batch, token, head), updated in place
  const void* block_out;  // same shape as out
  const float* block_lse;
  int out_dtype;    // PORTATTN_FP16, PORTATTN_BF16 or PORTATTN_MERGE_FP32
  int block_dtype;  // the same three
  int batch, seqlen, nheads, headdim;  // varlen: batch 1, seqlen = total tokens
  // Element strides; the head dim of out / block_out is contiguous by contract. The LSEs
  // use the same three roles (PortattnTensor4's names) for their (batch, token, head).
  PortattnTensor4 out_strides, block_out_strides, lse_strides, block_lse_strides;
  void* stream;
} PortattnMergeParams;

#ifdef __cplusplus
}  // extern "C"

namespace portattn {
namespace merge {

// Unfused fp32 arithmetic: nvcc contracts a - w * b into one FMA by default, whose single
// rounding would differ from the two roundings of torch's separate elementwise kernels.
#if defined(__CUDA_ARCH__)
PORTATTN_HD float add_rn(float a, float b) { return __fadd_rn(a, b); }
PORTATTN_HD float sub_rn(float a, float b) { return __fsub_rn(a, b); }
PORTATTN_HD float mul_rn(float a, float b) { return __fmul_rn(a, b); }
PORTATTN_HD float div_rn(float a, float b) { return __fdiv_rn(a, b); }
#else
// clang (hipcc) contracts only within one expression; each of these is one operation.
PORTATTN_HD float add_rn(float a, float b) { return a + b; }
PORTATTN_HD float sub_rn(float a, float b) { return a - b; }
PORTATTN_HD float mul_rn(float a, float b) { return a * b; }
PORTATTN_HD float div_rn(float a, float b) { return a / b; }
#endif

enum MergeMode { kBlend = 0, kKeep = 1, kTake = 2 };

struct MergeWeights {
  float w;    // the block's weight (kBlend)
  float lse;  // the merged LSE
  int mode;   // kBlend; kKeep: out unchanged (empty block); kTake: out = block_out (empty out)
};

PORTATTN_HD bool is_empty(float lse) { return lse == INFINITY || lse == -INFINITY; }

PORTATTN_HD MergeWeights merge_weights(float lse, float block_lse) {
  const bool empty = is_empty(lse);
  if (is_empty(block_lse)) return MergeWeights{0.f, empty ? -INFINITY : lse, kKeep};
  if (empty) return MergeWeights{1.f, block_lse, kTake};
  // torch's CUDA sigmoid: 1 / (1 + exp(-x)); its logsigmoid: min(0, x) - log1p(exp(-|x|)).
  const float d = sub_rn(block_lse, lse);
  const float w = div_rn(1.f, add_rn(1.f, expf(-d)));
  const float x = sub_rn(lse, block_lse);
  const float log_sigmoid = sub_rn(fminf(0.f, x), log1pf(expf(-fabsf(x))));
  return MergeWeights{w, sub_rn(lse, log_sigmoid), kBlend};
}

PORTATTN_HD float merge_value(float out, float block_out, float w) {
  return sub_rn(out, mul_rn(w, sub_rn(out, block_out)));
}

}  // namespace merge
}  // namespace portattn
#endif  // __cplusplus
