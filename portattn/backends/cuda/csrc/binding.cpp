// pybind11 module portattn.backends.cuda._C: turns Python ints into the C ABI
// structs of backends/common/params.h and calls libportattn_cuda.so.
//
// This file is compiled per Python version (it is the only part of the
// backend that is; see build.py), so it stays small and includes no CUDA
// headers. The per-call cost matters (small problems are host-bound): strides
// arrive as the tuples torch's .stride() returns and are read with the raw
// CPython API; everything else is a plain int or float.
#include <Python.h>
#include <pybind11/pybind11.h>
#include <stdint.h>

#include <stdexcept>
#include <string>

#include "../../common/params.h"

extern "C" {
int portattn_cuda_fwd(const PortattnFwdParams* params, char* message, int message_len);
const char* portattn_cuda_build_archs();
const char* portattn_cuda_build_ptx();
int portattn_cuda_num_fwd_variants();
void portattn_cuda_fwd_variant(int index, int* head_dim, int* dtype);
// ---- backward (owned by the backward engineer): declare its C entry points here ----
// ---- end backward declarations ----
}

namespace py = pybind11;

namespace {

int64_t tuple_item(PyObject* tuple, Py_ssize_t index) {
  return PyLong_AsLongLong(PyTuple_GET_ITEM(tuple, index));
}

// (B, S, H, D) strides -> batch/row/head; a varlen (total, H, D) tensor has no batch stride.
PortattnTensor4 tensor4(py::handle strides) {
  PyObject* t = strides.ptr();
  if (!PyTuple_Check(t)) throw py::type_error("portattn cuda: strides must be a tuple");
  const Py_ssize_t n = PyTuple_GET_SIZE(t);
  if (n == 4) return PortattnTensor4{tuple_item(t, 0), tuple_item(t, 1), tuple_item(t, 2)};
  if (n == 3) return PortattnTensor4{0, tuple_item(t, 0), tuple_item(t, 1)};
  throw py::value_error("portattn cuda: expected the strides of a 3-d or 4-d tensor");
}

void check(int code, const char* message) {
  if (code != 0) throw std::runtime_error(message);
}

template <typename T>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

void fwd(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out, uintptr_t lse, py::handle q_strides,
         py::handle k_strides, py::handle v_strides, py::handle out_strides,
         int64_t lse_batch_stride, int64_t lse_head_stride, int dtype, int batch, int nheads,
         int nheads_k, int headdim, int seqlen_q, int seqlen_k, uintptr_t cu_seqlens_q,
         uintptr_t cu_seqlens_k, uintptr_t seqused_k, float softmax_scale, float softcap,
         int window_left, int window_right, uintptr_t alibi_slopes, int64_t alibi_batch_stride,
         float dropout_p, unsigned long long philox_seed, unsigned long long philox_offset,
         uintptr_t stream) {
  PortattnFwdParams p;
  p.q = ptr<const void>(q);
  p.k = ptr<const void>(k);
  p.v = ptr<const void>(v);
  p.out = ptr<void>(out);
  p.lse = ptr<float>(lse);
  p.q_strides = tensor4(q_strides);
  p.k_strides = tensor4(k_strides);
  p.v_strides = tensor4(v_strides);
  p.out_strides = tensor4(out_strides);
  p.lse_batch_stride = lse_batch_stride;
  p.lse_head_stride = lse_head_stride;
  p.dtype = dtype;
  p.batch = batch;
  p.nheads = nheads;
  p.nheads_k = nheads_k;
  p.headdim = headdim;
  p.seqlen_q = seqlen_q;
  p.seqlen_k = seqlen_k;
  p.cu_seqlens_q = ptr<const int32_t>(cu_seqlens_q);
  p.cu_seqlens_k = ptr<const int32_t>(cu_seqlens_k);
  p.seqused_k = ptr<const int32_t>(seqused_k);
  p.softmax_scale = softmax_scale;
  p.softcap = softcap;
  p.window_left = window_left;
  p.window_right = window_right;
  p.alibi_slopes = ptr<const float>(alibi_slopes);
  p.alibi_batch_stride = alibi_batch_stride;
  p.dropout_p = dropout_p;
  p.philox_seed = philox_seed;
  p.philox_offset = philox_offset;
  p.stream = ptr<void>(stream);
  char message[512];
  check(portattn_cuda_fwd(&p, message, sizeof(message)), message);
}

py::dict build_config() {
  static const char* const kDtypeNames[] = {"float16", "bfloat16"};
  py::list head_dims, dtypes, archs;
  for (int i = 0; i < portattn_cuda_num_fwd_variants(); ++i) {
    int head_dim = 0, dtype = 0;
    portattn_cuda_fwd_variant(i, &head_dim, &dtype);
    py::int_ hd(head_dim);
    py::str name(kDtypeNames[dtype]);
    if (!head_dims.contains(hd)) head_dims.append(hd);
    if (!dtypes.contains(name)) dtypes.append(name);
  }
  std::string text = portattn_cuda_build_archs();
  size_t start = 0;
  while (start <= text.size()) {
    const size_t end = text.find(';', start);
    const std::string arch = text.substr(start, end == std::string::npos ? std::string::npos : end - start);
    if (!arch.empty()) archs.append(py::str("sm_" + arch));
    if (end == std::string::npos) break;
    start = end + 1;
  }
  py::dict config;
  config["archs"] = archs;
  py::list ptx;
  if (portattn_cuda_build_ptx()[0] != '\0') ptx.append(py::str(std::string("sm_") + portattn_cuda_build_ptx()));
  config["ptx"] = ptx;
  config["head_dims"] = head_dims;
  config["dtypes"] = dtypes;
  return config;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "portattn CUDA kernels (sm80+); see portattn/backends/cuda/__init__.py";
  m.def("fwd", &fwd, "forward attention over raw pointers (see backends/common/params.h)");
  m.def("build_config", &build_config,
        "what this build contains: {'archs', 'ptx', 'head_dims', 'dtypes'}");
  // ---- backward (owned by the backward engineer): m.def("bwd", ...) and helpers here ----
  // ---- end backward bindings ----
}
