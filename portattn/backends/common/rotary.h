// Rotary position embedding (RoPE) of the cache append (flash_attn_with_kvcache's
// rotary_cos / rotary_sin), written once for both vendors' append kernels
// (cuda/csrc/decode_entry.cu, rocm/csrc/decode_kernel.h). Shared because the
// new keys it writes into the cache are read back by the decode kernels: the
// two vendors must pick the same table entry and partner element and do the
// same arithmetic, or a cache built on one would not match the other's (and
// the reference's). Only the 16-bit -> float conversions are the vendor's
// (`Floats` below).
#pragma once
#include <stdint.h>

#include "decode_sequence.h"  // clamp_int
#include "params.h"

// Device-only: it calls the vendor's device conversions.
#if defined(__CUDACC__) || defined(__HIPCC__)
#define PORTATTN_ROTARY_DEVICE __device__ __forceinline__
#else
#define PORTATTN_ROTARY_DEVICE inline
#endif

namespace portattn {
namespace rotary {

// PortattnAppendParams::rotary_dtype of a float32 table (the 16-bit ones use PortattnDtype).
constexpr int kTableFp32 = 2;

// Rotates elements of one (token, head) row. `Floats` is the vendor's:
//   Elem, Bf16, Fp16                       the row's and the tables' element types
//   of_elem(Elem), of_bf16(Bf16), of_fp16(Fp16) -> float
template <class Floats>
struct Rotary {
  using Elem = typename Floats::Elem;
  const PortattnAppendParams& p;

  // Entry `index` of a cos or sin table, in the table's dtype.
  PORTATTN_ROTARY_DEVICE float table(const void* base, int64_t index) const {
    if (p.rotary_dtype == kTableFp32) return static_cast<const float*>(base)[index];
    if (p.rotary_dtype == PORTATTN_BF16) return Floats::of_bf16(static_cast<const typename Floats::Bf16*>(base)[index]);
    return Floats::of_fp16(static_cast<const typename Floats::Fp16*>(base)[index]);
  }

  // Element e of row x rotated at position pos (elements past rotary_dim pass
  // through). pos is clamped to the table's rows; min(max()) rather than
  // clamp_int because it is the form the CUDA kernel had (the same SASS), and the
  // two agree whenever seqlen_ro >= 1, which both entries require.
  PORTATTN_ROTARY_DEVICE float apply(const Elem* x, int e, int pos) const {
    const float value = Floats::of_elem(x[e]);
    if (e >= p.rotary_dim) return value;
    pos = decode::min_int(decode::max_int(pos, 0), p.seqlen_ro - 1);
    const int half = p.rotary_dim / 2;
    int pair, partner;
    bool first;
    if (p.rotary_interleaved) {  // pairs (0, 1), (2, 3), ...
      pair = e / 2;
      first = e % 2 == 0;
      partner = first ? e + 1 : e - 1;
    } else {  // GPT-NeoX halves: (i, i + rotary_dim / 2)
      pair = e % half;
      first = e < half;
      partner = first ? e + half : e - half;
    }
    const int64_t index = static_cast<int64_t>(pos) * p.rotary_row_stride + pair;
    const float c = table(p.rotary_cos, index), s = table(p.rotary_sin, index);
    const float other = Floats::of_elem(x[partner]);
    return first ? value * c - other * s : value * c + other * s;
  }
};

}  // namespace rotary
}  // namespace portattn
