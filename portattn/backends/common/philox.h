// Dropout keep-mask: the single definition shared by every backend.
//
// Note [portattn dropout mask]
// The decision for one attention-probability entry (b, h, i, j) is a pure
// function of (seed, offset, b, h, i, j, p), so the backward pass regenerates
// the forward's mask instead of storing O(seqlen^2) bits, and the reference
// backend (portattn/backends/reference.py: philox_keep_mask) reproduces it
// exactly in PyTorch integer arithmetic.
//
//   key     = (seed_lo, seed_hi ^ offset_hi)
//   counter = (j / 4, i, b * nheads + h, offset_lo)
//   r[0..3] = Philox4x32-10(counter, key)
//   keep    = r[j % 4] >= threshold,  threshold = min(floor(p * 2^32), 2^32 - 1)
//
// i and j are positions inside the sequence (varlen: relative to the
// sequence's start), b is the sequence index. Philox4x32-10 is Salmon et al.,
// "Parallel random numbers: as easy as 1, 2, 3" (SC'11), with its published
// multipliers and Weyl constants.
#pragma once
#include <stdint.h>

#include "host_device.h"

namespace portattn {

// The call's Philox seed and offset: the pair in device memory when the call carries one
// (captured in a CUDA graph: params.h philox_state), else the two integers. Read once per
// thread before the key loop.
template <class Params>
PORTATTN_HD uint64_t philox_seed_of(const Params& p) {
  return p.philox_state != nullptr ? static_cast<uint64_t>(p.philox_state[0]) : p.philox_seed;
}
template <class Params>
PORTATTN_HD uint64_t philox_offset_of(const Params& p) {
  return p.philox_state != nullptr ? static_cast<uint64_t>(p.philox_state[1]) : p.philox_offset;
}

struct Philox4 {
  uint32_t x, y, z, w;
};

PORTATTN_HD void mulhilo32(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t product = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  hi = static_cast<uint32_t>(product >> 32);
  lo = static_cast<uint32_t>(product);
}

PORTATTN_HD Philox4 philox4x32_10(Philox4 ctr, uint32_t key0, uint32_t key1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
#if defined(__CUDACC__) || defined(__HIPCC__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo32(kMul0, ctr.x, hi0, lo0);
    mulhilo32(kMul1, ctr.z, hi1, lo1);
    ctr = Philox4{hi1 ^ ctr.y ^ key0, lo1, hi0 ^ ctr.w ^ key1, lo0};
    key0 += kWeyl0;
    key1 += kWeyl1;
  }
  return ctr;
}

// Four consecutive columns j0..j0+3 (j0 % 4 == 0) of row i share one Philox call.
PORTATTN_HD Philox4 dropout_random4(uint64_t seed, uint64_t offset, int b_times_h_plus_h, int i,
                                    int j0) {
  const Philox4 ctr{static_cast<uint32_t>(j0 >> 2), static_cast<uint32_t>(i),
                    static_cast<uint32_t>(b_times_h_plus_h), static_cast<uint32_t>(offset)};
  return philox4x32_10(ctr, static_cast<uint32_t>(seed),
                       static_cast<uint32_t>(seed >> 32) ^ static_cast<uint32_t>(offset >> 32));
}

PORTATTN_HD uint32_t dropout_threshold(float p) {
  const double scaled = static_cast<double>(p) * 4294967296.0;
  return scaled >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(scaled);
}

}  // namespace portattn
