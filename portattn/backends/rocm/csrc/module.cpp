// portattn.backends.rocm._C: the ROCm backend's Python entry points.
//
// fwd(FwdParams) checks the internal invariants the kernels rely on (user
// input was validated in Python already), picks the compiled variant for the
// current device's gfx target, dtype and head dim from the generated
// registry, launches it on the given stream and raises on any launch error.
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

// Features the kernels implement (Note [portattn semantics]); the support
// matrix's "rocm" block must declare exactly these. The backward has no
// atomics, so it is always deterministic (Note [portattn rocm backward]).
const std::vector<std::string> kFeatures = {"forward", "backward", "causal", "window", "softcap", "alibi",
                                            "dropout", "gqa", "varlen", "deterministic_backward"};

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

void check_fwd_invariants(const PortattnFwdParams& p) {
  require(p.dtype == PORTATTN_FP16 || p.dtype == PORTATTN_BF16, "dtype must be fp16 or bf16");
  require(p.batch > 0 && p.nheads > 0 && p.nheads_k > 0 && p.nheads % p.nheads_k == 0,
          "batch, nheads, nheads_k must be positive with nheads % nheads_k == 0");
  require(p.headdim > 0 && p.headdim % 8 == 0, "headdim must be a positive multiple of 8");
  int max_head_dim = 0;
  for (int index = 0; index < kNumVariants; ++index) max_head_dim = std::max(max_head_dim, kVariants[index].head_dim);
  require(p.headdim <= max_head_dim, "headdim " + std::to_string(p.headdim) + " > " +
                                         std::to_string(max_head_dim) + ", the largest built");
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

// The smallest built head dim >= headdim for this device's arch and dtype.
const KernelVariant& find_variant(int dtype, int headdim) {
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
  return *best;
}

void fwd(const PortattnFwdParams& params) {
  check_fwd_invariants(params);
  if (params.seqlen_q == 0) return;
  const KernelVariant& variant = find_variant(params.dtype, params.headdim);
  check_hip(static_cast<hipError_t>(variant.fwd(&params)), "forward kernel launch");
}

void bwd(const PortattnBwdParams& params) {
  check_bwd_invariants(params);
  if (params.fwd.seqlen_q == 0 && params.fwd.seqlen_k == 0) return;
  const KernelVariant& variant = find_variant(params.fwd.dtype, params.fwd.headdim);
  check_hip(static_cast<hipError_t>(variant.bwd(&params)), "backward kernel launch");
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
  // LDS per workgroup per built head dim (the same on every arch), which the
  // support matrix compares with the device's (capability/matrix.py).
  py::dict forward_lds, backward_lds;
  for (int index = 0; index < kNumVariants; ++index) {
    forward_lds[py::int_(kVariants[index].head_dim)] = kVariants[index].fwd_lds_bytes;
    backward_lds[py::int_(kVariants[index].head_dim)] = kVariants[index].bwd_lds_bytes;
  }
  py::dict lds;
  lds["forward"] = forward_lds;
  lds["backward"] = backward_lds;
  config["smem_bytes"] = lds;
  return config;
}

// The same argument list as the CUDA module's fwd (common/binding_args.h): one
// Python marshalling for both vendors (portattn/backends/abi.py).
using binding::bwd_params;
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
  m.doc() = "portattn ROCm kernels (MFMA, gfx90a / gfx942); see portattn/backends/rocm/__init__.py";
  m.def("fwd", &fwd_entry, "forward attention over raw pointers (see backends/common/params.h)");
  m.def("bwd", &bwd_entry, "backward attention over raw pointers (see backends/common/params.h)");
  m.def("bwd_workspace_bytes", &bwd_workspace_bytes_entry,
        "scratch bytes bwd() needs: (batch, nheads, nheads_k, headdim, seqlen_q, seqlen_k, deterministic)");
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
