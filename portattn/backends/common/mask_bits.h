// Note [portattn hopper mask bits]
// An edge block's mask as one bit per fragment column. In each row of its accumulator
// fragment, a thread holds the columns first + offset(c), c = 0 .. kCols - 1, with
// offset(c) = 8 (c / 2) + c % 2: two adjacent columns in every 8-column group (the layout of
// wgmma's m64nNk16 and mma's m16n8k16 accumulators). offset grows with c, so the columns a row
// keeps, those with an offset in [lo, hi], are one run of fragment columns, and the run's ends
// cost a few integer operations a row. Each element then tests one bit of a register. ptxas
// turns a run of such tests into R2P, which sets seven predicates from one register, so an
// element costs a select and a seventh of an R2P instead of a compare and a select
// (cuobjdump of the hd64 causal forward: 64 ISETP + 64 FSEL a masked block before).
//
// Host and device: tests/test_mask_bits.py checks the run against the per-column rule through
// a host driver (tests/host_driver.py).
#pragma once

#include <cstdint>
#include <type_traits>

#include "host_device.h"

namespace portattn {
namespace mask_bits {

// Wide enough for a row's fragment columns: 32 at 128-key blocks, 44 at 176-key blocks.
template <int kCols>
using Bits = std::conditional_t<(kCols <= 32), uint32_t, uint64_t>;

// How many fragment columns have an offset below `bound`: the even offsets 8p below it number
// ceil(bound / 8), the odd ones 8p + 1 ceil((bound - 1) / 8).
template <int kCols>
PORTATTN_HD int columns_below(int bound) {
  // Clamped first (a max and a min), so that the sums below cannot overflow for any bound.
  int b = bound > 0 ? bound : 0;
  b = b < 8 * kCols ? b : 8 * kCols;
  const int n = ((b + 7) >> 3) + ((b + 6) >> 3);
  return n < kCols ? n : kCols;
}

// The lowest n bits set (n in [0, kCols]); a shift by the type's width would be undefined.
template <int kCols>
PORTATTN_HD Bits<kCols> lowest(int n) {
  using B = Bits<kCols>;
#if defined(__CUDA_ARCH__)
  // The high word of (0 : 2^32 - 1) << min(n, 32): one funnel shift.
  if constexpr (sizeof(B) == 4) return __funnelshift_lc(0xFFFFFFFFu, 0u, static_cast<unsigned>(n));
#endif
  return n >= static_cast<int>(8 * sizeof(B)) ? ~B(0) : static_cast<B>((B(1) << n) - 1);
}

// Bit c is set where offset(c) lies in [lo, hi] (relative to the thread's first column).
// lo <= 0 keeps every column up to hi; hi < 0 keeps none.
template <int kCols>
PORTATTN_HD Bits<kCols> row_keep(int hi, int lo) {
  // hi + 1 cannot overflow: hi is a column bound less a column index.
  return lowest<kCols>(columns_below<kCols>(hi + 1)) & ~lowest<kCols>(columns_below<kCols>(lo));
}

template <typename B>
PORTATTN_HD bool kept(B keep, int c) {
  return ((keep >> c) & 1u) != 0;
}

}  // namespace mask_bits
}  // namespace portattn
