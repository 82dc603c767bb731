// Sequence bounds: where sequence b of a call lives in the q/k/v (and out, lse,
// dq/dk/dv) tensors and how many rows it has. The one copy of this rule for every
// kernel (sm80 forward and backward, the Hopper forward, the ROCm kernels), host
// and device, CUDA and HIP.
//
// Safety never depends on a host check (issue 12 item 4): cu_seqlens_q/k and
// seqused_k are device data the Python layer does not read by default
// (PORTATTN_DEBUG_CHECKS=1 adds a host check) and cannot under CUDA-graph capture, so whatever they hold
// (decreasing offsets, offsets past the tensor, negative lengths) the bounds below
// stay inside the tensors the kernel was given:
//   - varlen q: start = clamp(cu_seqlens_q[b], 0, total_q), end = clamp(cu_seqlens_q[b + 1],
//     start, total_q), len = min(end - start, seqlen_q). The cap at seqlen_q (the
//     call's maximum) matters as much as the one at total_q: grids, the backward's
//     workspace rows (delta, fp32 dQ) and the GQA dK/dV accumulators are sized
//     from the maxima, so a longer sequence would run into its neighbour's rows.
//   - varlen k: the same with cu_seqlens_k, total_k and seqlen_k.
//   - seqused_k: len_k = clamp(seqused_k[b], 0, len_k) (keys actually used, never
//     more than the sequence's rows).
//   - dense calls: start 0, lengths seqlen_q / seqlen_k (host ints read from the
//     tensors' shapes, trusted).
// For valid inputs (what the host check accepts) every clamp is the identity, so
// results are unchanged; for invalid ones the result is unspecified but every
// read and write stays in bounds. Only per-CTA setup calls this: a handful of
// integer operations next to the two or three loads it already did.
#pragma once
#include <stdint.h>

#include "params.h"

#include "host_device.h"

namespace portattn {

struct SeqBounds {
  int q_start, k_start;  // first row of the sequence in q/out/dq and k/v/dk/dv (varlen: packed row; else 0)
  int len_q, len_k;      // its rows: 0 <= len_q <= seqlen_q, q_start + len_q <= total_q (varlen); k alike
};

PORTATTN_HD int64_t clamp_rows(int64_t value, int64_t lo, int64_t hi) {
  return value < lo ? lo : (value > hi ? hi : value);
}

// Rows [start, start + len) of sequence b of a packed tensor of `total` rows.
PORTATTN_HD void packed_rows(const int32_t* cu_seqlens, int b, int64_t total, int max_len, int& start,
                             int& len) {
  const int64_t begin = clamp_rows(cu_seqlens[b], 0, total);
  const int64_t end = clamp_rows(cu_seqlens[b + 1], begin, total);
  start = static_cast<int>(begin);  // <= cu_seqlens[b] (an int32) or 0
  len = static_cast<int>(clamp_rows(end - begin, 0, max_len));
}

// The rule above from its inputs (for kernels whose arguments are not a PortattnFwdParams).
PORTATTN_HD SeqBounds seq_bounds(const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k,
                                 const int32_t* seqused_k, int seqlen_q, int seqlen_k, int64_t total_q,
                                 int64_t total_k, int b) {
  SeqBounds s{0, 0, seqlen_q, seqlen_k};
  if (cu_seqlens_q != nullptr) packed_rows(cu_seqlens_q, b, total_q, seqlen_q, s.q_start, s.len_q);
  if (cu_seqlens_k != nullptr) packed_rows(cu_seqlens_k, b, total_k, seqlen_k, s.k_start, s.len_k);
  if (seqused_k != nullptr) s.len_k = static_cast<int>(clamp_rows(seqused_k[b], 0, s.len_k));
  return s;
}

PORTATTN_HD SeqBounds seq_bounds(const PortattnFwdParams& p, int b) {
  return seq_bounds(p.cu_seqlens_q, p.cu_seqlens_k, p.seqused_k, p.seqlen_q, p.seqlen_k, p.total_q, p.total_k, b);
}

}  // namespace portattn
