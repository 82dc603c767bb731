// The compiled-variant table: which (head dim, dtype) kernels this build has.
//
// Note [portattn cuda variants]
// portattn/backends/cuda/variants.py is the single list of variants. At build
// time it generates one translation unit per (kernel family, head dim, dtype)
// that instantiates the family's run function, plus `variants_generated.cu`,
// which defines the tables below. Entry points pick the smallest built head
// dim >= the call's (the kernels zero-fill the tail), so nothing here is
// spelled out by hand. A new kernel family (e.g. the backward pass) adds one
// entry to variants.FAMILIES and declares its run template + table here.
// The sm_90a families (variants.HOPPER_FAMILIES) are generated the same way into
// hopper_* files and `hopper_variants_generated.cu`, compiled for sm_90a only;
// their entry points look up the exact head dim (find_exact_variant).
#pragma once
#include <stdio.h>

#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "../../common/params.h"
#include "c_api.h"
#include "smem_budget.h"

namespace portattn {
namespace cuda {

using FwdFn = cudaError_t (*)(const PortattnFwdParams&);

// fn(std::integral_constant<int, D>{}) for the instantiable head dim D (a multiple of 32 up to 256)
// equal to head_dim; returns whether there is one. The host-side queries of per-head-dim tile
// facts (shared-memory needs, the tile a call runs) dispatch through it.
template <int kHeadDim = 32, class Fn>
bool with_instantiable_head_dim(int head_dim, Fn&& fn) {
  if constexpr (kHeadDim > 256) {
    return false;
  } else {
    if (head_dim == kHeadDim) {
      fn(std::integral_constant<int, kHeadDim>{});
      return true;
    }
    return with_instantiable_head_dim<kHeadDim + 32>(head_dim, fn);
  }
}

// `query`: what a family that has one (variants.Family.query_template) answers about the
// kernel `run` launches (the decode families: DecodeQueryFn); nullptr elsewhere.
template <class Fn, class Query = void (*)()>
struct Variant {
  int head_dim;
  int dtype;  // PortattnDtype
  Fn run;
  Query query = nullptr;
};

// Defined in fwd_launch.cuh; explicitly instantiated per generated TU.
template <int kHeadDim, typename Elem>
cudaError_t run_fwd(const PortattnFwdParams& params);

extern const Variant<FwdFn> kFwdVariants[];
extern const int kNumFwdVariants;

// ---- backward family (owned by the backward engineer) ----
using BwdFn = cudaError_t (*)(const PortattnBwdParams&);
template <int kHeadDim, typename Elem>
cudaError_t run_bwd(const PortattnBwdParams& params);
extern const Variant<BwdFn> kBwdVariants[];
extern const int kNumBwdVariants;
// ---- end backward family ----
// ---- decode family (split-KV over a KV cache; decode_launch.cuh) ----
using DecodeFn = cudaError_t (*)(const PortattnDecodeParams&);
// The kernel a decode launch would run on the current device (with softcap/ALiBi: `extras`).
struct DecodeTileFacts {
  int stage_keys, threads, smem_bytes, stages;
  int registers, ctas_per_sm;  // per thread (ptxas); resident per SM (occupancy calculator)
};
using DecodeQueryFn = cudaError_t (*)(bool extras, DecodeTileFacts*);
using DecodeVariant = Variant<DecodeFn, DecodeQueryFn>;
template <int kHeadDim, typename Elem>
cudaError_t run_decode(const PortattnDecodeParams& params);
template <int kHeadDim, typename Elem>
cudaError_t decode_facts(bool extras, DecodeTileFacts* facts);
extern const DecodeVariant kDecodeVariants[];
extern const int kNumDecodeVariants;
// The same kernels reading e4m3 caches (Note [portattn fp8 kv cache] in common/params.h).
template <int kHeadDim, typename Elem>
cudaError_t run_decode_fp8(const PortattnDecodeParams& params);
template <int kHeadDim, typename Elem>
cudaError_t decode_fp8_facts(bool extras, DecodeTileFacts* facts);
extern const DecodeVariant kDecodeFp8Variants[];
extern const int kNumDecodeFp8Variants;
// ---- end decode family ----
}  // namespace cuda

namespace hopper {
// Defined in hopper_fwd_launch.cuh / hopper_bwd_launch.cuh; explicitly instantiated per
// generated hopper_* TU.
template <int kHeadDim, typename Elem>
cudaError_t run_hopper_fwd(const PortattnFwdParams& params);
template <int kHeadDim, typename Elem>
cudaError_t run_hopper_bwd(const PortattnBwdParams& params);
}  // namespace hopper

namespace cuda {
// ---- Hopper families (sm_90a only; hopper_fwd_launch.cuh, hopper_bwd_launch.cuh) ----
// Defined only when the build carries the sm_90a path; only the hopper_* entries use them.
// A plan that leaves no Hopper head dim has count 0 (and one placeholder entry).
extern const Variant<FwdFn> kHopperFwdVariants[];
extern const int kNumHopperFwdVariants;
extern const Variant<BwdFn> kHopperBwdVariants[];
extern const int kNumHopperBwdVariants;
// ---- end Hopper families ----
extern const char* const kBuildArchs;  // e.g. "80;90", as the build was asked for
extern const char* const kBuildPtx;    // arch of the embedded PTX, e.g. "90" ("" = none)

// Smallest built head dim >= head_dim for this dtype, or nullptr.
template <class Fn, class Query>
const Variant<Fn, Query>* find_variant(const Variant<Fn, Query>* table, int count, int head_dim, int dtype) {
  const Variant<Fn, Query>* best = nullptr;
  for (int i = 0; i < count; ++i) {
    const Variant<Fn, Query>& v = table[i];
    if (v.dtype == dtype && v.head_dim >= head_dim && (best == nullptr || v.head_dim < best->head_dim))
      best = &v;
  }
  return best;
}

// The built variant of exactly this head dim and dtype, or nullptr: for kernels with
// no masked head-dim tail (the Hopper ones), which serve their own head dim only.
template <class Fn, class Query>
const Variant<Fn, Query>* find_exact_variant(const Variant<Fn, Query>* table, int count, int head_dim, int dtype) {
  for (int i = 0; i < count; ++i)
    if (table[i].head_dim == head_dim && table[i].dtype == dtype) return &table[i];
  return nullptr;
}

inline const char* dtype_name(int dtype) {
  return dtype == PORTATTN_FP16 ? "fp16" : dtype == PORTATTN_BF16 ? "bf16" : "?";
}

// What a table holds, for error messages: "hd64 fp16, hd128 bf16", or "none".
template <class Fn, class Query>
void describe_variants(const Variant<Fn, Query>* table, int count, char* text, int text_len) {
  int used = snprintf(text, text_len, "%s", count == 0 ? "none" : "");
  for (int i = 0; i < count && used >= 0 && used < text_len; ++i)
    used += snprintf(text + used, text_len - used, "%shd%d %s", i == 0 ? "" : ", ", table[i].head_dim,
                     dtype_name(table[i].dtype));
}

// Raises a kernel's dynamic shared-memory limit once per device. A kernel that
// needs more than smem_budget() (the device's opt-in maximum, read rather than
// assumed from the arch, lowered by the cap: Note [portattn smem budget])
// reports an error whose text `last_error_detail()` returns, on every launch.
struct SmemOptInState {
  unsigned long long done_devices;  // bit d: attribute already raised on device d
};
cudaError_t ensure_dynamic_smem(const void* kernel, int bytes, SmemOptInState* state);

// Entry-point checks shared by the forward and backward entries (fwd_entry.cu).
bool aligned16(const void* ptr);
bool strides_aligned(const PortattnTensor4& s);
// The sm80+ forward's row-stride limit (its loaders' 32-bit offsets); the Hopper entry checks it
// before it hands a call to that kernel (Note [portattn hopper short calls on narrow tiles]).
bool row_stride_fits(const PortattnTensor4& s);
// Writes `text` into the caller's message buffer; returns `code`, or -1 for 0.
int fail(char* message, int message_len, int code, const char* text);
const char* last_error_detail();
void set_error_detail(const char* text);

// kShape tells apart kernels of one (head dim, dtype, flag) with different
// tiles (the sm80+ forward's narrow shape, Note [portattn sm80 narrow tiles]).
template <int kHeadDim, typename Elem, bool kFlag, int kShape = 0>
struct SmemOptIn {
  static SmemOptInState state;
};
template <int kHeadDim, typename Elem, bool kFlag, int kShape>
SmemOptInState SmemOptIn<kHeadDim, Elem, kFlag, kShape>::state = {0ull};

// The decode kernels' own opt-in record (SmemOptIn's is keyed by the same
// template arguments and belongs to the forward kernels).
template <int kHeadDim, typename Elem, bool kFlag, bool kFp8, bool kFp8Regs = false, int kStages = 3>
struct DecodeSmemOptIn {
  static SmemOptInState state;
};
template <int kHeadDim, typename Elem, bool kFlag, bool kFp8, bool kFp8Regs, int kStages>
SmemOptInState DecodeSmemOptIn<kHeadDim, Elem, kFlag, kFp8, kFp8Regs, kStages>::state = {0ull};

}  // namespace cuda
}  // namespace portattn
