// The table of compiled variants, generated per build by variants.py
// (registry.cpp) and searched by module.cpp at call time: the build decides
// what exists, nothing is re-derived at runtime.
#pragma once
#include <stdint.h>

#include "../../common/params.h"

namespace portattn {
namespace rocm {

struct KernelVariant {
  const char* arch;  // gfx target the entry points' code objects are for
  int dtype;         // PortattnDtype
  int head_dim;      // serves params.headdim <= head_dim
  int (*fwd)(const PortattnFwdParams*);  // return a hipError_t
  int (*bwd)(const PortattnBwdParams*);
  int fwd_lds_bytes;  // per workgroup, the largest of the direction's kernels
  int bwd_lds_bytes;
  // Decode (decode_kernel.h): split-KV decode + combine, and the cache append with rotary.
  int (*decode)(const PortattnDecodeParams*);
  int (*append)(const PortattnAppendParams*);
  int decode_lds_bytes;
  int decode_stage_keys;  // keys a workgroup consumes per stage (the split planner's unit)
  int decode_threads;
};

struct ArchCompiler {
  const char* arch;
  const char* compiler;
};

extern const KernelVariant kVariants[];
extern const int kNumVariants;
extern const ArchCompiler kArchCompilers[];
extern const int kNumArchCompilers;

// Backward workspace (Note [portattn rocm backward]): rowsum(dO * O) as fp32
// [batch][nheads][seqlen_q], varlen rows indexed inside their sequence
// (seqlen_q is then the longest). One definition for the size (module.cpp)
// and the addressing (bwd_kernel.h); constexpr makes them host + device in HIP.
constexpr int64_t bwd_rowdot_offset(int64_t nheads, int64_t seqlen_q, int b, int h) {
  return (b * nheads + h) * seqlen_q;
}

constexpr int64_t bwd_workspace_bytes(int batch, int nheads, int seqlen_q) {
  return bwd_rowdot_offset(nheads, seqlen_q, batch, 0) * static_cast<int64_t>(sizeof(float));
}

}  // namespace rocm
}  // namespace portattn
