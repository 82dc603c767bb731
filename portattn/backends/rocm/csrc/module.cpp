// portattn.backends.rocm._C: the ROCm backend's Python entry points.
//
// fwd(FwdParams) checks the internal invariants the kernels rely on (user
// input was validated in Python already), picks the compiled variant for the
// current device's gfx target, dtype and head dim from the generated
// registry, launches it on the given stream and raises on any launch error.
// decode / kvcache_append / decode_tile do the same for the split-KV decode
// path (Note [portattn decode] in common/params.h), with the CUDA module's
// argument lists.
// build_config() reports what this binary contains, so Python never
// re-derives it. This file is plain C++ (no device code): it only needs the
// HIP runtime API.
#if defined(PORTATTN_ROCM_EMULATE)
#include PORTATTN_ROCM_EMULATE  // tests/rocm_emulation: the CPU stand-in for the HIP runtime
#else
#include <hip/hip_runtime_api.h>
#endif
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "../../common/binding_args.h"
#include "../../common/params.h"
#include "registry.h"

namespace py = pybind11;

namespace portattn {
namespace rocm {
namespace {

constexpr int kMaxDevices = 64;
constexpr int kPointerAlignment = 16;  // 16-byte global loads of K and V rows
constexpr int kStrideMultiple = 8;     // keeps every row 16-byte aligned
// The most splits a decode call may ask for: the split planner's ceiling
// (portattn/decode.py), the same contract as the CUDA module.
constexpr int kMaxDecodeSplits = 128;

// Features the kernels implement (Note [portattn semantics]); the support
// matrix's "rocm" block must declare exactly these. The backward has no
// atomics, so it is always deterministic (Note [portattn rocm backward]).
// The decode kernels read contiguous and paged caches in place, of the query's
// dtype or e4m3 (Note [portattn fp8 kv cache]; every decode instantiation has both).
const std::vector<std::string> kFeatures = {"forward", "backward", "causal",  "window",
                                            "softcap", "alibi",    "dropout", "gqa",
                                            "varlen",  "deterministic_backward", "decode", "paged_kv",
                                            "fp8_kv"};
// The features an arch's variants lack without a backward or without a decode (a
// variant table may leave either direction out; the CPU emulation builds only some).
const std::vector<std::string> kBackwardFeatures = {"backward", "deterministic_backward"};
const std::vector<std::string> kDecodeFeatures = {"decode", "paged_kv", "fp8_kv"};

void check_hip(hipError_t status, const char* what) {
  if (status == hipSuccess) return;
  const std::string name = hipGetErrorName(status), text = hipGetErrorString(status);
  throw std::runtime_error(std::string("portattn ROCm: ") + what + " failed: " + name +
                           (text == name ? "" : " (" + text + ")"));
}

// "gfx90a:sramecc+:xnack-" -> "gfx90a", cached per device.
const std::string& device_arch(int device) {
  static std::string cache[kMaxDevices];
  if (device < 0 || device >= kMaxDevices) throw std::runtime_error("portattn ROCm: device index out of range");
  if (cache[device].empty()) {
    hipDeviceProp_t props;
    check_hip(hipGetDeviceProperties(&props, device), "hipGetDeviceProperties");
    const std::string name = props.gcnArchName;
    cache[device] = name.substr(0, name.find(':'));
  }
  return cache[device];
}

void require(bool condition, const std::string& message) {
  if (!condition) throw std::invalid_argument("portattn ROCm: " + message);
}

struct TensorLayout {
  const void* pointer;
  const PortattnTensor4* strides;
  const char* name;
};

// The kernels read and write rows with 16-byte accesses.
void check_layouts(std::initializer_list<TensorLayout> tensors) {
  for (const TensorLayout& t : tensors) {
    require(reinterpret_cast<std::uintptr_t>(t.pointer) % kPointerAlignment == 0,
            std::string(t.name) + " must be " + std::to_string(kPointerAlignment) + "-byte aligned");
    for (const int64_t stride : {t.strides->batch_stride, t.strides->row_stride, t.strides->head_stride}) {
      require(stride % kStrideMultiple == 0, std::string(t.name) + " strides must be multiples of " +
                                                 std::to_string(kStrideMultiple) + " elements, got " +
                                                 std::to_string(stride));
    }
  }
}

int max_built_head_dim() {
  int max_head_dim = 0;
  for (int index = 0; index < kNumVariants; ++index) max_head_dim = std::max(max_head_dim, kVariants[index].head_dim);
  return max_head_dim;
}

void check_head_dim(int headdim) {
  const int max_head_dim = max_built_head_dim();
  require(headdim <= max_head_dim, "headdim " + std::to_string(headdim) + " > " + std::to_string(max_head_dim) +
                                       ", the largest built");
}

void check_fwd_invariants(const PortattnFwdParams& p) {
  require(p.dtype == PORTATTN_FP16 || p.dtype == PORTATTN_BF16, "dtype must be fp16 or bf16");
  require(p.batch > 0 && p.nheads > 0 && p.nheads_k > 0 && p.nheads % p.nheads_k == 0,
          "batch, nheads, nheads_k must be positive with nheads % nheads_k == 0");
  require(p.headdim > 0 && p.headdim % 8 == 0, "headdim must be a positive multiple of 8");
  check_head_dim(p.headdim);
  require(p.seqlen_q >= 0 && p.seqlen_k >= 0, "sequence lengths must be non-negative");
  require((p.cu_seqlens_q == nullptr) == (p.cu_seqlens_k == nullptr),
          "cu_seqlens_q and cu_seqlens_k are given together");
  require(p.dropout_p >= 0.f && p.dropout_p < 1.f, "dropout_p must be in [0, 1)");
  require(p.softcap >= 0.f, "softcap must be >= 0");
  require(p.q && p.k && p.v && p.out, "q, k, v and out must be non-null");  // lse may be (not wanted)
  check_layouts({{p.q, &p.q_strides, "q"}, {p.k, &p.k_strides, "k"}, {p.v, &p.v_strides, "v"},
                 {p.out, &p.out_strides, "out"}});
}

void check_bwd_invariants(const PortattnBwdParams& p) {
  check_fwd_invariants(p.fwd);
  require(p.fwd.lse && p.dout && p.dq && p.dk && p.dv, "lse, dout, dq, dk and dv must be non-null");
  check_layouts({{p.dout, &p.dout_strides, "dout"}, {p.dq, &p.dq_strides, "dq"}, {p.dk, &p.dk_strides, "dk"},
                 {p.dv, &p.dv_strides, "dv"}});
  const int64_t needed = bwd_workspace_bytes(p.fwd.batch, p.fwd.nheads, p.fwd.seqlen_q);
  require(p.workspace != nullptr || needed == 0, "workspace must be non-null");
  require(p.workspace_bytes >= needed, "workspace of " + std::to_string(p.workspace_bytes) +
                                           " bytes, bwd_workspace_bytes() asks for " + std::to_string(needed));
}

// An e4m3 cache's strides count bytes: the layout rule's multiple of 8 keeps its rows
// 8-byte aligned, the widest read of the FP8 kernels (csrc/fp8.h).
void check_cache_dtype(int cache_dtype) {
  require(cache_dtype == PORTATTN_CACHE_AS_QUERY || cache_dtype == PORTATTN_CACHE_FP8_E4M3,
          "cache_dtype " + std::to_string(cache_dtype) + " must be " + std::to_string(PORTATTN_CACHE_AS_QUERY) +
              " (the query's dtype) or " + std::to_string(PORTATTN_CACHE_FP8_E4M3) + " (e4m3)");
}

void check_decode_invariants(const PortattnDecodeParams& p) {
  require(p.dtype == PORTATTN_FP16 || p.dtype == PORTATTN_BF16, "dtype must be fp16 or bf16");
  require(p.batch >= 0 && p.nheads > 0 && p.nheads_k > 0 && p.nheads % p.nheads_k == 0,
          "batch >= 0, nheads and nheads_k positive with nheads % nheads_k == 0");
  require(p.headdim > 0 && p.headdim % 8 == 0, "headdim must be a positive multiple of 8");
  check_head_dim(p.headdim);
  require(p.seqlen_q >= 0 && p.seqlen_k >= 0 && p.seqlen_new >= 0 && p.kv_capacity >= 0,
          "sequence lengths and kv_capacity must be non-negative");
  require(p.softcap >= 0.f, "softcap must be >= 0");
  require(p.q && p.k && p.v && p.out, "q, k, v and out must be non-null");  // lse may be (not wanted)
  check_layouts({{p.q, &p.q_strides, "q"}, {p.k, &p.k_strides, "k"}, {p.v, &p.v_strides, "v"},
                 {p.out, &p.out_strides, "out"}});
  require(p.num_splits >= 1 && p.num_splits <= kMaxDecodeSplits,
          "num_splits " + std::to_string(p.num_splits) + " must be in [1, " + std::to_string(kMaxDecodeSplits) + "]");
  require(p.num_splits == 1 || (p.o_partial != nullptr && p.lse_partial != nullptr &&
                                reinterpret_cast<std::uintptr_t>(p.o_partial) % kPointerAlignment == 0),
          "num_splits > 1 needs o_partial (" + std::to_string(kPointerAlignment) + "-byte aligned) and lse_partial");
  require(p.block_table == nullptr || (p.page_size > 0 && p.num_pages > 0),
          "a paged cache needs page_size > 0 and num_pages > 0");
  require(p.block_table != nullptr || p.cache_batch_idx == nullptr || p.cache_batches > 0,
          "cache_batch_idx needs cache_batches > 0");
  require(p.cu_seqlens_q == nullptr || p.total_q >= 0, "total_q must be non-negative");
  require(p.cu_seqlens_k == nullptr || p.total_k >= 0, "total_k must be non-negative");
  check_cache_dtype(p.kv.cache_dtype);
}

void check_append_invariants(const PortattnAppendParams& p) {
  require(p.dtype == PORTATTN_FP16 || p.dtype == PORTATTN_BF16, "dtype must be fp16 or bf16");
  require(p.headdim > 0, "headdim must be positive");
  check_head_dim(p.headdim);  // one lane per column of the serving variant's workgroup
  require(p.batch >= 0 && p.seqlen_new >= 0 && p.seqlen_q >= 0 && p.nheads_k > 0 && p.nheads > 0,
          "batch, seqlen_new, seqlen_q must be non-negative and nheads, nheads_k positive");
  require(p.rotary_dim >= 0 && p.rotary_dim % 2 == 0 && p.rotary_dim <= p.headdim,
          "rotary_dim must be even and <= headdim");
  require(p.rotary_dim == 0 || (p.rotary_cos && p.rotary_sin && p.seqlen_ro > 0),
          "rotary needs cos, sin and seqlen_ro > 0");
  require(p.rotary_dim == 0 || p.rotary_dtype == PORTATTN_FP16 || p.rotary_dtype == PORTATTN_BF16 ||
              p.rotary_dtype == 2,
          "rotary_dtype must be fp16, bf16 or 2 (float32)");
  require(p.k_new == nullptr || (p.v_new && p.k_cache && p.v_cache), "k_new needs v_new, k_cache and v_cache");
  require(p.k_new == nullptr || p.block_table == nullptr || (p.page_size > 0 && p.num_pages > 0),
          "a paged cache needs page_size > 0 and num_pages > 0");
  require(p.k_new == nullptr || p.block_table != nullptr || p.cache_batch_idx == nullptr || p.cache_batches > 0,
          "cache_batch_idx needs cache_batches > 0");
  require(p.q == nullptr || p.q_out != nullptr, "q needs q_out");
  check_cache_dtype(p.kv.cache_dtype);
}

// The smallest built head dim >= headdim for this device's arch and dtype;
// `direction` names the entry point the caller needs (a variant may lack one).
const KernelVariant& find_variant(int dtype, int headdim, const char* direction = "forward") {
  int device = 0;
  check_hip(hipGetDevice(&device), "hipGetDevice");
  const std::string& arch = device_arch(device);
  const KernelVariant* best = nullptr;
  bool arch_built = false;
  for (int index = 0; index < kNumVariants; ++index) {
    const KernelVariant& variant = kVariants[index];
    if (arch != variant.arch) continue;
    arch_built = true;
    if (variant.dtype != dtype || variant.head_dim < headdim) continue;
    if (best == nullptr || variant.head_dim < best->head_dim) best = &variant;
  }
  if (!arch_built) {
    throw std::invalid_argument("portattn ROCm: this build has no kernels for " + arch +
                                "; rebuild with PORTATTN_HIP_ARCHS including it");
  }
  if (best == nullptr) {
    throw std::invalid_argument("portattn ROCm: no kernel built for dtype " + std::to_string(dtype) +
                                " and head dim " + std::to_string(headdim) + " on " + arch +
                                " (see PORTATTN_DTYPES / PORTATTN_HEADDIMS)");
  }
  const bool built = std::string(direction) == "forward"    ? best->fwd != nullptr
                     : std::string(direction) == "backward" ? best->bwd != nullptr
                                                            : best->decode != nullptr;
  if (!built) {
    throw std::invalid_argument(std::string("portattn ROCm: no ") + direction + " kernel is built for " + arch +
                                " at head dim " + std::to_string(best->head_dim));
  }
  return *best;
}

// Dropout keyed by a device-side pair (params.h philox_state: a call captured in a graph)
// is not implemented by these kernels: reading the pair cost gfx90a's forward and backward
// 24 bytes of scratch. Refused by name rather than served with a mask frozen at capture.
void refuse_device_philox_state(const PortattnFwdParams& params) {
  if (params.dropout_p > 0.f && params.philox_state != nullptr)
    throw std::invalid_argument(
        "portattn ROCm: dropout inside a captured HIP graph is not supported yet (its mask key would be "
        "frozen at capture); run dropout calls outside the graph");
}

void fwd(const PortattnFwdParams& params) {
  check_fwd_invariants(params);
  refuse_device_philox_state(params);
  if (params.seqlen_q == 0) return;
  const KernelVariant& variant = find_variant(params.dtype, params.headdim);
  check_hip(static_cast<hipError_t>(variant.fwd(&params)), "forward kernel launch");
}

void bwd(const PortattnBwdParams& params) {
  check_bwd_invariants(params);
  refuse_device_philox_state(params.fwd);
  if (params.fwd.seqlen_q == 0 && params.fwd.seqlen_k == 0) return;
  const KernelVariant& variant = find_variant(params.fwd.dtype, params.fwd.headdim, "backward");
  check_hip(static_cast<hipError_t>(variant.bwd(&params)), "backward kernel launch");
}

void decode(const PortattnDecodeParams& params) {
  check_decode_invariants(params);
  if (params.seqlen_q == 0 || params.batch == 0) return;
  const KernelVariant& variant = find_variant(params.dtype, params.headdim, "decode");
  check_hip(static_cast<hipError_t>(variant.decode(&params)), "decode kernel launch");
}

void kvcache_append(const PortattnAppendParams& params) {
  check_append_invariants(params);
  if (params.batch == 0 || ((params.k_new == nullptr || params.seqlen_new == 0) &&
                            (params.q == nullptr || params.seqlen_q == 0))) {
    return;
  }
  const KernelVariant& variant = find_variant(params.dtype, params.headdim, "decode");
  check_hip(static_cast<hipError_t>(variant.append(&params)), "kvcache append kernel launch");
}

// {"stage_keys", "threads", "smem_bytes"} of the decode kernel serving head_dim
// (the split planner's input); -1s when none is built. That of the current
// device's arch when it has one built, else (no device needed) of the first
// built arch with a decode: stage_keys is the same on every arch, threads and
// LDS differ between the CDNA and RDNA tiles. fp8_kv: the e4m3-cache kernel's,
// which has the same tile (its bytes are widened in registers or into the same LDS).
py::dict decode_tile(int head_dim, int fp8_kv) {
  static_cast<void>(fp8_kv);
  std::string device_arch_name;
  int device = 0;
  if (hipGetDevice(&device) == hipSuccess) {
    try {
      device_arch_name = device_arch(device);
    } catch (const std::runtime_error&) {
      device_arch_name.clear();
    }
  }
  const KernelVariant* best = nullptr;
  for (const bool same_arch : {true, false}) {
    if (same_arch && device_arch_name.empty()) continue;
    for (int index = 0; index < kNumVariants; ++index) {
      const KernelVariant& variant = kVariants[index];
      if (variant.decode == nullptr || (same_arch && device_arch_name != variant.arch)) continue;
      if (variant.head_dim >= head_dim && (best == nullptr || variant.head_dim < best->head_dim)) best = &variant;
    }
    if (best != nullptr) break;
  }
  py::dict tile;
  tile["stage_keys"] = best ? best->decode_stage_keys : -1;
  tile["threads"] = best ? best->decode_threads : -1;
  tile["smem_bytes"] = best ? best->decode_lds_bytes : -1;
  return tile;
}

py::dict build_config() {
  std::vector<std::string> archs, dtypes;
  std::vector<int> head_dims;
  auto add_unique = [](auto& list, const auto& value) {
    for (const auto& existing : list)
      if (existing == value) return;
    list.push_back(value);
  };
  for (int index = 0; index < kNumVariants; ++index) {
    const KernelVariant& variant = kVariants[index];
    add_unique(archs, std::string(variant.arch));
    add_unique(dtypes, std::string(variant.dtype == PORTATTN_BF16 ? "bfloat16" : "float16"));
    add_unique(head_dims, variant.head_dim);
  }
  py::dict compilers;
  for (int index = 0; index < kNumArchCompilers; ++index) {
    compilers[kArchCompilers[index].arch] = kArchCompilers[index].compiler;
  }
  py::dict config;
  config["archs"] = archs;
  config["dtypes"] = dtypes;
  config["head_dims"] = head_dims;
  config["compilers"] = compilers;
  config["features"] = kFeatures;
  config["hip_runtime_version"] = HIP_VERSION;
  // Per arch, the features its variants implement (those of a direction none of them built are left out).
  py::dict features_by_arch;
  for (const std::string& arch : archs) {
    bool has_bwd = false, has_decode = false;
    for (int index = 0; index < kNumVariants; ++index) {
      if (arch != kVariants[index].arch) continue;
      has_bwd = has_bwd || kVariants[index].bwd != nullptr;
      has_decode = has_decode || kVariants[index].decode != nullptr;
    }
    std::vector<std::string> features;
    for (const std::string& feature : kFeatures) {
      const bool bwd = std::find(kBackwardFeatures.begin(), kBackwardFeatures.end(), feature) != kBackwardFeatures.end();
      const bool dec = std::find(kDecodeFeatures.begin(), kDecodeFeatures.end(), feature) != kDecodeFeatures.end();
      if ((bwd && !has_bwd) || (dec && !has_decode)) continue;
      features.push_back(feature);
    }
    features_by_arch[py::str(arch)] = features;
  }
  config["features_by_arch"] = features_by_arch;
  // LDS per workgroup per built head dim, the smallest over the built archs
  // that have the direction (the support matrix compares it with the device's;
  // the launch is the final check), capability/matrix.py.
  py::dict forward_lds, backward_lds, decode_lds;
  auto keep_min = [](py::dict& table, int head_dim, int bytes) {
    if (bytes <= 0) return;
    const py::int_ key(head_dim);
    if (!table.contains(key) || table[key].cast<int>() > bytes) table[key] = bytes;
  };
  for (int index = 0; index < kNumVariants; ++index) {
    const KernelVariant& variant = kVariants[index];
    keep_min(forward_lds, variant.head_dim, variant.fwd_lds_bytes);
    if (variant.bwd != nullptr) keep_min(backward_lds, variant.head_dim, variant.bwd_lds_bytes);
    if (variant.decode != nullptr) keep_min(decode_lds, variant.head_dim, variant.decode_lds_bytes);
  }
  py::dict lds;
  lds["forward"] = forward_lds;
  lds["backward"] = backward_lds;
  lds["decode"] = decode_lds;
  config["smem_bytes"] = lds;
  return config;
}

// The same argument list as the CUDA module's fwd (common/binding_args.h): one
// Python marshalling for both vendors (portattn/backends/abi.py). Its sm_margin is
// ignored here: every ROCm grid has one block per tile, none sized by the CU count.
using binding::append_params;
using binding::bwd_params;
using binding::decode_params;
using binding::fwd_params;

void fwd_entry(PORTATTN_FWD_ARGS) {
  const PortattnFwdParams p = fwd_params(PORTATTN_FWD_ARG_NAMES);
  py::gil_scoped_release no_gil;
  fwd(p);
}

// bwd(<PORTATTN_BWD_OWN_ARGS>, <fwd's arguments>), as the CUDA module.
void bwd_entry(PORTATTN_BWD_OWN_ARGS, PORTATTN_FWD_ARGS) {
  const PortattnBwdParams p = bwd_params(PORTATTN_BWD_OWN_ARG_NAMES, fwd_params(PORTATTN_FWD_ARG_NAMES));
  py::gil_scoped_release no_gil;
  bwd(p);
}

// decode(<PORTATTN_DECODE_ARGS>) and kvcache_append(<PORTATTN_APPEND_ARGS>), as the CUDA module.
void decode_entry(PORTATTN_DECODE_ARGS) {
  const PortattnDecodeParams p = decode_params(PORTATTN_DECODE_ARG_NAMES);
  py::gil_scoped_release no_gil;
  decode(p);
}

void kvcache_append_entry(PORTATTN_APPEND_ARGS) {
  const PortattnAppendParams p = append_params(PORTATTN_APPEND_ARG_NAMES);
  py::gil_scoped_release no_gil;
  kvcache_append(p);
}

int64_t bwd_workspace_bytes_entry(int batch, int nheads, int nheads_k, int headdim, int seqlen_q, int seqlen_k,
                                  bool deterministic) {
  static_cast<void>(nheads_k), static_cast<void>(headdim), static_cast<void>(seqlen_k), static_cast<void>(deterministic);
  return bwd_workspace_bytes(batch, nheads, seqlen_q);
}

}  // namespace
}  // namespace rocm
}  // namespace portattn

PYBIND11_MODULE(_C, m) {
  using namespace portattn::rocm;
  m.doc() = "portattn ROCm kernels (MFMA: gfx90a / gfx942 / gfx950; WMMA: gfx1100 / gfx1201); see portattn/backends/rocm/__init__.py";
  m.def("fwd", &fwd_entry, "forward attention over raw pointers (see backends/common/params.h)");
  m.def("bwd", &bwd_entry, "backward attention over raw pointers (see backends/common/params.h)");
  m.def("bwd_workspace_bytes", &bwd_workspace_bytes_entry,
        "scratch bytes bwd() needs: (batch, nheads, nheads_k, headdim, seqlen_q, seqlen_k, deterministic)");
  m.def("decode", &decode_entry,
        "split-KV decode over a KV cache read in place (common/params.h: PortattnDecodeParams)");
  m.def("kvcache_append", &kvcache_append_entry,
        "append new k/v to a cache with rotary, and rotate q (common/params.h: PortattnAppendParams)");
  m.def("decode_tile", &decode_tile, "tile facts of the decode kernel serving a head dim (and an e4m3 cache)",
        py::arg("head_dim"), py::arg("fp8_kv") = 0);
  m.def("build_config", &build_config, "what this binary contains: archs, dtypes, head_dims, features");
  m.def(
      "device_count",
      []() {
        int count = 0;
        const hipError_t status = hipGetDeviceCount(&count);
        return std::make_tuple(status == hipSuccess ? count : 0, std::string(hipGetErrorName(status)));
      },
      "(number of HIP devices, HIP status name)");
}
