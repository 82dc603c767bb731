// The table of compiled forward variants, generated per build by
// variants.py (registry.cpp) and searched by module.cpp at call time: the
// build decides what exists, nothing is re-derived at runtime.
#pragma once
#include "../../common/params.h"

namespace portattn {
namespace rocm {

struct FwdVariant {
  const char* arch;  // gfx target the entry point's code object is for
  int dtype;         // PortattnDtype
  int head_dim;      // serves params.headdim <= head_dim
  int (*launch)(const PortattnFwdParams*);  // returns a hipError_t
};

struct ArchCompiler {
  const char* arch;
  const char* compiler;
};

extern const FwdVariant kFwdVariants[];
extern const int kNumFwdVariants;
extern const ArchCompiler kArchCompilers[];
extern const int kNumArchCompilers;

}  // namespace rocm
}  // namespace portattn
