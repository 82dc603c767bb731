// Online-softmax math shared by the vendor backends (CUDA and ROCm).
//
// Note [portattn online softmax]
// A thread holds a (kRows x kCols) slice of the score tile S and the matching
// (kRows x kOCols) slice of the output accumulator O, as plain register
// arrays; each row is spread over a few threads of one warp/wavefront, and
// the caller's `RowReduce` (max / sum across exactly those threads) is the
// only vendor-specific piece. Scores arrive either raw (q.k, scaled here by
// scale_log2 = softmax_scale * log2(e)) or already in log2 units (scale 1),
// so one exp2 per element suffices and the softmax scale costs nothing.
//
// Per key block:   m' = max(m, rowmax(S));   P = exp2(S * c - m' * c)
//                  l  = l * exp2((m - m') * c) + rowsum(P);   O *= exp2((m - m') * c)
// At the end:      O /= l,   lse = (m * c + log2(l)) * ln(2)
// Rows that have seen no visible key keep m = -inf; the subtracted maximum is
// then taken as 0 so that exp2(-inf - (-inf)) never produces NaN, and the
// finalisation writes O = 0, lse = -inf (Note [portattn semantics]).
// Row sums stay per-thread partial sums until `finalize`, which reduces them
// once instead of once per key block.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define PORTATTN_SOFTMAX_HD __host__ __device__ __forceinline__
#else
#define PORTATTN_SOFTMAX_HD inline
#endif

#if !defined(__CUDA_ARCH__) && !defined(__HIP_DEVICE_COMPILE__)
#include <math.h>

#include <cmath>
#endif

namespace portattn {
namespace softmax {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

PORTATTN_SOFTMAX_HD float neg_inf() { return -__builtin_huge_valf(); }

// exp2 on the hardware's fast path: one MUFU.EX2 on NVIDIA (ex2.approx flushes
// denormals, which only affects probabilities below 2^-126), v_exp_f32 on AMD.
PORTATTN_SOFTMAX_HD float exp2_fast(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#elif defined(__HIP_DEVICE_COMPILE__) && __has_builtin(__builtin_amdgcn_exp2f)
  return __builtin_amdgcn_exp2f(x);
#elif defined(__HIP_DEVICE_COMPILE__)
  // LLVM < 17 (Debian's hipcc 5.2) lacks the builtin; its llvm.exp2.f32 is
  // the same single v_exp_f32.
  return __builtin_exp2f(x);
#else
  return std::exp2(x);
#endif
}

// Note [portattn polynomial exp2]
// exp2 on the FMA pipe: 2^x = 2^round(x) * 2^f, f in [-0.5, 0.5], with a
// degree-3 minimax polynomial for 2^f (max relative error 7.7e-5, a fiftieth
// of a bf16 ulp and a sixth of an fp16 one: the probabilities are rounded to
// 16 bits before P V anyway). Adding 1.5 * 2^23 rounds x to an integer held
// in the low mantissa bits, which the final integer add moves into the
// exponent. Inputs are clamped at -125, so masked scores (-inf) give 2^-125
// (about 2e-38) where ex2.approx gives 0: invisible in P V and the row sums.
// Why: on Hopper the MUFU unit does 16 exp2 a clock per SM, which at head dim
// 64 takes as long as the tensor cores' matrix products for the same tile;
// computing a fraction of the exponentials here instead balances the two
// pipes (online_softmax_step_deferred's kPolyEvery).
PORTATTN_SOFTMAX_HD float exp2_poly(float x) {
#if defined(__CUDA_ARCH__)
  x = fmaxf(x, -125.f);
  const float shifted = x + 12582912.f;
  const float whole = shifted - 12582912.f;
  const float frac = x - whole;
  const float p = fmaf(fmaf(fmaf(0.05518098f, frac, 0.24263459f), frac, 0.69326133f), frac, 0.99992621f);
  return __int_as_float(__float_as_int(p) + (__float_as_int(shifted) << 23));
#else
  return exp2_fast(x);
#endif
}

PORTATTN_SOFTMAX_HD float log2_accurate(float x) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return log2f(x);
#else
  return std::log2(x);
#endif
}

// Note [portattn fast finalize]
// A tile's end: the LSE's log2 of the row sum and O's 1 / row sum. log2f and an IEEE division
// each carry a range-reduction and a slow path (about 25 instructions a row with their branches,
// in the SASS of the Hopper forward) where one MUFU instruction does: lg2.approx has an
// absolute error below 2^-22 (the LSE is stored in float32, whose spacing is 2^-21 at 8), and
// rcp.approx a relative one of about 1 ulp, which the rounding of O to 16 bits hides. The row
// sum is a sum of exponentials that includes the row maximum's exp2(0) = 1, so it is a normal
// number whenever it is used. Other targets keep the accurate forms.
// (Inline PTX, not __log2f / __fdividef: __fdividef adds a range check for huge divisors.)
#if defined(__CUDA_ARCH__)
#define PORTATTN_PTX_F32(INSTR) \
  float y;                      \
  asm(INSTR " %0, %1;" : "=f"(y) : "f"(x)); \
  return y
PORTATTN_SOFTMAX_HD float log2_fast(float x) { PORTATTN_PTX_F32("lg2.approx.f32"); }
PORTATTN_SOFTMAX_HD float rcp_fast(float x) { PORTATTN_PTX_F32("rcp.approx.ftz.f32"); }
#undef PORTATTN_PTX_F32
#else
PORTATTN_SOFTMAX_HD float log2_fast(float x) { return log2_accurate(x); }
PORTATTN_SOFTMAX_HD float rcp_fast(float x) { return 1.f / x; }
#endif

// expf / logf: the device libraries' and <math.h>'s alike (not the fast intrinsics).
PORTATTN_SOFTMAX_HD float exp_accurate(float x) { return expf(x); }
PORTATTN_SOFTMAX_HD float log_accurate(float x) { return logf(x); }

// fmaxf is one FMNMX on NVIDIA (the ?: form costs a compare and a select).
PORTATTN_SOFTMAX_HD float max2(float a, float b) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return fmaxf(a, b);
#else
  return a > b ? a : b;
#endif
}

template <int kRows>
struct RowState {
  float max[kRows];  // running row maximum of the raw (unscaled) scores
  float sum[kRows];  // this thread's partial sum of exp2(...)

  PORTATTN_SOFTMAX_HD void init() {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      max[r] = neg_inf();
      sum[r] = 0.f;
    }
  }
};

// P = exp2(S * scale_log2 - subtract) for one row, in place; returns the row's sum.
// kPolyEvery > 0: every kPolyEvery-th column through exp2_poly (Note
// [portattn polynomial exp2]), the rest through the hardware unit.
template <int kCols, int kPolyEvery = 0>
PORTATTN_SOFTMAX_HD float exp2_row(float (&s)[kCols], float scale_log2, float subtract) {
  float row_sum = 0.f;
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    const float x = s[c] * scale_log2 - subtract;
    constexpr int kEvery = kPolyEvery > 0 ? kPolyEvery : 1;  // (a zero modulus warns even when unused)
    s[c] = (kPolyEvery > 0 && c % kEvery == kEvery - 1) ? exp2_poly(x) : exp2_fast(x);
    row_sum += s[c];
  }
  return row_sum;
}

// The row's running maximum after this block (across the threads that share
// the row), and the amount the exponent subtracts for it: 0 while the row has
// seen no finite score, so that exp2(-inf - (-inf)) never produces NaN.
template <class RowReduce, int kCols>
PORTATTN_SOFTMAX_HD float block_row_max(const float (&s)[kCols], float running_max) {
  float m = running_max;
#pragma unroll
  for (int c = 0; c < kCols; ++c) m = max2(m, s[c]);
  return RowReduce::max(m);
}

PORTATTN_SOFTMAX_HD float max_offset(float row_max, float scale_log2) {
  return row_max == neg_inf() ? 0.f : row_max * scale_log2;
}

// One key block: turns S into unnormalised probabilities P (in place) and
// rescales O and the running sums. `kFirst` skips the rescale of O, which is
// still zero on the first block.
template <bool kFirst, int kRows, int kCols, int kOCols, class RowReduce>
PORTATTN_SOFTMAX_HD void online_softmax_step(float (&s)[kRows][kCols], float (&o)[kRows][kOCols],
                                             RowState<kRows>& state, float scale_log2) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const float block_max = block_row_max<RowReduce>(s[r], state.max[r]);
    const float subtract = max_offset(block_max, scale_log2);
    if (!kFirst) {
      const float correction = exp2_fast(state.max[r] * scale_log2 - subtract);
      state.sum[r] *= correction;
#pragma unroll
      for (int c = 0; c < kOCols; ++c) o[r][c] *= correction;
    }
    state.max[r] = block_max;
    state.sum[r] += exp2_row(s[r], scale_log2, subtract);
  }
}

// The same step for a pipeline in which O is still being accumulated
// asynchronously (the previous block's P V on Hopper's wgmma) while this
// block's softmax runs: the running sums are rescaled here, O is not; the
// caller multiplies row r of O by `correction[r]` once that product has
// landed (rescale_rows). kFirst: nothing to correct yet (correction = 1).
template <bool kFirst, int kRows, int kCols, class RowReduce, int kPolyEvery = 0>
PORTATTN_SOFTMAX_HD void online_softmax_step_deferred(float (&s)[kRows][kCols],
                                                      RowState<kRows>& state, float scale_log2,
                                                      float (&correction)[kRows]) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const float block_max = block_row_max<RowReduce>(s[r], state.max[r]);
    const float subtract = max_offset(block_max, scale_log2);
    correction[r] = kFirst ? 1.f : exp2_fast(state.max[r] * scale_log2 - subtract);
    state.sum[r] = kFirst ? 0.f : state.sum[r] * correction[r];
    state.max[r] = block_max;
    state.sum[r] += exp2_row<kCols, kPolyEvery>(s[r], scale_log2, subtract);
  }
}

template <int kRows, int kOCols>
PORTATTN_SOFTMAX_HD void rescale_rows(float (&o)[kRows][kOCols], const float (&correction)[kRows]) {
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int c = 0; c < kOCols; ++c) o[r][c] *= correction[r];
}

// Note [portattn lazy rescale]
// The same step, but O and the running sums are rescaled only when some row
// of the warp/wavefront sees its maximum grow by more than kLazyRescaleLog2
// (in log2 units); otherwise every row keeps its stale maximum and P may
// exceed 1 by up to 2^kLazyRescaleLog2. This is exact: O and the sum are
// always scaled by the same reference maximum, which cancels in O / sum and
// is folded back into the LSE. With long key sequences the maximum settles
// after a few blocks, so the per-block rescale of O (kOCols multiplies per
// row) mostly disappears. RowReduce must also provide `any(bool)` across the
// threads that share the branch (the whole warp on NVIDIA).
constexpr float kLazyRescaleLog2 = 8.f;

template <int kRows, int kCols, int kOCols, class RowReduce>
PORTATTN_SOFTMAX_HD void online_softmax_step_lazy(float (&s)[kRows][kCols],
                                                  float (&o)[kRows][kOCols],
                                                  RowState<kRows>& state, float scale_log2) {
  float block_max[kRows];
  bool grow = false;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    float m = state.max[r];
#pragma unroll
    for (int c = 0; c < kCols; ++c) m = max2(m, s[r][c]);
    block_max[r] = RowReduce::max(m);
    // -inf - -inf is NaN and compares false: a row with nothing visible yet
    // never asks for a rescale; a first finite maximum always does.
    grow |= block_max[r] * scale_log2 - state.max[r] * scale_log2 > kLazyRescaleLog2;
  }
  if (RowReduce::any(grow)) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float subtract = max_offset(block_max[r], scale_log2);
      const float correction = exp2_fast(state.max[r] * scale_log2 - subtract);
      state.sum[r] *= correction;
#pragma unroll
      for (int c = 0; c < kOCols; ++c) o[r][c] *= correction;
      state.max[r] = block_max[r];
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const float subtract = max_offset(state.max[r], scale_log2);
    state.sum[r] += exp2_row(s[r], scale_log2, subtract);
  }
}

// The deferred step (online_softmax_step_deferred, for pipelines whose O is still being
// accumulated) with Note [portattn lazy rescale]'s bound, decided per row: a row whose maximum grew
// by more than kLazyRescaleLog2 moves to the new maximum (its correction below 1), every other row
// keeps its stale one (correction 1), so no row waits for a vote before its exponentials. Returns
// whether any row of the warp moved (warp-uniform): false lets the caller skip O's multiplies.
template <int kRows, int kCols, class RowReduce, int kPolyEvery = 0>
PORTATTN_SOFTMAX_HD bool online_softmax_step_deferred_lazy(float (&s)[kRows][kCols], RowState<kRows>& state,
                                                           float scale_log2, float (&correction)[kRows]) {
  bool moved = false;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const float block_max = block_row_max<RowReduce>(s[r], state.max[r]);
    // (NaN while the row has seen nothing finite: compares false; a first finite maximum moves.)
    const bool grow = block_max * scale_log2 - state.max[r] * scale_log2 > kLazyRescaleLog2;
    const float row_max = grow ? block_max : state.max[r];
    const float subtract = max_offset(row_max, scale_log2);
    correction[r] = grow ? exp2_fast(state.max[r] * scale_log2 - subtract) : 1.f;
    state.sum[r] *= correction[r];
    state.max[r] = row_max;
    moved |= grow;
    state.sum[r] += exp2_row<kCols, kPolyEvery>(s[r], scale_log2, subtract);
  }
  return RowReduce::any(moved);
}

// Normalises O (optionally times an extra factor, e.g. dropout's 1/(1-p)) and
// returns the natural-log LSE per row in `lse`. kFast: Note [portattn fast finalize].
template <int kRows, int kOCols, class RowReduce, bool kFast = false>
PORTATTN_SOFTMAX_HD void online_softmax_finalize(float (&o)[kRows][kOCols], RowState<kRows>& state,
                                                 float scale_log2, float out_scale,
                                                 float (&lse)[kRows]) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const float sum = RowReduce::sum(state.sum[r]);
    const bool empty = sum == 0.f || state.max[r] == neg_inf();
    const float log2_sum = kFast ? log2_fast(sum) : log2_accurate(sum);
    lse[r] = empty ? neg_inf() : (state.max[r] * scale_log2 + log2_sum) * kLn2;
    const float factor = empty ? 0.f : (kFast ? out_scale * rcp_fast(sum) : out_scale / sum);
#pragma unroll
    for (int c = 0; c < kOCols; ++c) o[r][c] *= factor;
  }
}

// Note [portattn LSE merge]
// Results over disjoint key sets, each normalised (O_s) with its natural-log
// LSE l_s (-inf: the part saw no visible key), merge as
//     lse = m + log(sum_s exp(l_s - m)),  m = max_s l_s   (-inf when every part is empty)
//     O   = sum_s exp(l_s - lse) O_s                      (merge_weight)
// The decode split combines (cuda/csrc/decode_entry.cu, rocm/csrc/decode_kernel.h)
// merge a row's splits this way: each lane takes parts lane, lane + lanes, ...
// of lse_parts[s * stride], and LaneReduce (max / sum across those lanes) is
// the only vendor-specific piece.
template <class LaneReduce, typename Index>
PORTATTN_SOFTMAX_HD float merged_lse(const float* lse_parts, Index stride, int parts, int lane, int lanes) {
  float m = neg_inf();
  for (int s = lane; s < parts; s += lanes) m = max2(m, lse_parts[s * stride]);
  m = LaneReduce::max(m);
  float sum = 0.f;
  if (m != neg_inf())
    for (int s = lane; s < parts; s += lanes) sum += exp_accurate(lse_parts[s * stride] - m);
  sum = LaneReduce::sum(sum);
  return (m == neg_inf() || sum == 0.f) ? neg_inf() : m + log_accurate(sum);
}

// The weight of a part of LSE part_lse in the merged O (0 for an empty part).
PORTATTN_SOFTMAX_HD float merge_weight(float part_lse, float lse) { return exp_accurate(part_lse - lse); }

}  // namespace softmax
}  // namespace portattn
