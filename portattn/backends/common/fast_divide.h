// Division by a divisor fixed for a whole launch (a tile count, a head count),
// done as one multiply-high and one shift instead of the ~30-instruction
// sequence a GPU runs for `/` and `%` by a run-time int.
//
// Why it exists: the Hopper forward decodes every tile it takes into (query
// block, head, batch) with two to four such divisions, and a persistent CTA
// takes 60-120 one-key-block tiles in a call of many short sequences (batch
// 512 x 100-200 rows), where those divisions would be ~60 of the ~520 warp
// instructions a tile costs beyond its key blocks (docs/kernels-hopper.md).
//
// The rule (round-up reciprocal): for a divisor 1 <= d < 2^31 let l = ceil(log2 d)
// and m = ceil(2^(31 + l) / d), which is below 2^32 for d >= 2. Then for every
// 0 <= n < 2^31, n / d == (n * m) >> (31 + l): writing m = (2^(31+l) + e) / d with
// 0 <= e < d, n * m / 2^(31+l) = n / d + n e / (d 2^(31+l)), and the second term is
// below 2^-l <= 1 / d, too little to carry n / d past the next integer (its
// fractional part is at most (d - 1) / d). The product's high word is umulhi(n, m),
// so the shift left is l - 1. d = 1 has no such m below 2^32 and is a select.
// tests/test_fast_divide.py checks the rule on the host against `/` and `%`.
#pragma once
#include <stdint.h>

#include "host_device.h"

namespace portattn {

struct FastDivisor {
  int divisor;          // d >= 1
  uint32_t multiplier;  // m (unused when d == 1)
  uint32_t shift;       // l - 1 (unused when d == 1)
};

// Host side: the constants for d (d < 1 is treated as 1, a divisor no launch passes).
inline FastDivisor make_fast_divisor(int d) {
  FastDivisor f{d < 1 ? 1 : d, 0u, 0u};
  if (f.divisor > 1) {
    uint32_t log2_up = 0;
    while ((uint64_t(1) << log2_up) < static_cast<uint64_t>(f.divisor)) ++log2_up;
    const uint64_t power = uint64_t(1) << (31 + log2_up);
    f.multiplier = static_cast<uint32_t>((power + static_cast<uint64_t>(f.divisor) - 1) / static_cast<uint64_t>(f.divisor));
    f.shift = log2_up - 1;
  }
  return f;
}

PORTATTN_HD uint32_t umulhi32(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

// n / d for 0 <= n < 2^31.
PORTATTN_HD int fast_div(int n, const FastDivisor& f) {
  const int q = static_cast<int>(umulhi32(static_cast<uint32_t>(n), f.multiplier) >> f.shift);
  return f.divisor == 1 ? n : q;
}

// n / d and n % d for 0 <= n < 2^31.
PORTATTN_HD int fast_divmod(int n, const FastDivisor& f, int& remainder) {
  const int q = fast_div(n, f);
  remainder = n - q * f.divisor;
  return q;
}

}  // namespace portattn
