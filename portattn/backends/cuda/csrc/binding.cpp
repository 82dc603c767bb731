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

#include "c_api.h"

extern "C" {
// ---- backward (owned by the backward engineer): declare its C entry points here ----
int portattn_cuda_bwd(const PortattnBwdParams* params, char* message, int message_len);
long long portattn_cuda_bwd_workspace_bytes(const PortattnBwdParams* params);
int portattn_cuda_bwd_smem_bytes(int head_dim);
// ---- end backward declarations ----
#ifdef PORTATTN_WITH_HOPPER
// Opt-in sm_90a forward (hopper_fwd_entry.cu; build with PORTATTN_CUDA_HOPPER=1).
int portattn_cuda_hopper_fwd(const PortattnFwdParams* params, char* message, int message_len);
#endif
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

// The forward call's arguments, shared by fwd() and bwd() (which takes them
// after its own, in this order).
#define PORTATTN_FWD_ARGS                                                                          \
  uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out, uintptr_t lse, py::handle q_strides,       \
      py::handle k_strides, py::handle v_strides, py::handle out_strides,                          \
      int64_t lse_batch_stride, int64_t lse_head_stride, int dtype, int batch, int nheads,         \
      int nheads_k, int headdim, int seqlen_q, int seqlen_k, uintptr_t cu_seqlens_q,               \
      uintptr_t cu_seqlens_k, uintptr_t seqused_k, float softmax_scale, float softcap,             \
      int window_left, int window_right, uintptr_t alibi_slopes, int64_t alibi_batch_stride,       \
      float dropout_p, unsigned long long philox_seed, unsigned long long philox_offset,           \
      uintptr_t stream

PortattnFwdParams fwd_params(PORTATTN_FWD_ARGS) {
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
  return p;
}

// The names of PORTATTN_FWD_ARGS, in order, to pass them on.
#define PORTATTN_FWD_ARG_NAMES                                                                     \
  q, k, v, out, lse, q_strides, k_strides, v_strides, out_strides, lse_batch_stride,               \
      lse_head_stride, dtype, batch, nheads, nheads_k, headdim, seqlen_q, seqlen_k, cu_seqlens_q,  \
      cu_seqlens_k, seqused_k, softmax_scale, softcap, window_left, window_right, alibi_slopes,    \
      alibi_batch_stride, dropout_p, philox_seed, philox_offset, stream

// Runs a forward C entry point (sm80+ or the opt-in Hopper one); its message becomes the error.
void call_fwd_entry(int (*entry)(const PortattnFwdParams*, char*, int), const PortattnFwdParams& p) {
  char message[512];
  check(entry(&p, message, sizeof(message)), message);
}

void fwd(PORTATTN_FWD_ARGS) { call_fwd_entry(portattn_cuda_fwd, fwd_params(PORTATTN_FWD_ARG_NAMES)); }

#ifdef PORTATTN_WITH_HOPPER
// Same arguments as fwd(); refuses (RuntimeError) what the first Hopper kernel does not serve.
void hopper_fwd(PORTATTN_FWD_ARGS) {
  call_fwd_entry(portattn_cuda_hopper_fwd, fwd_params(PORTATTN_FWD_ARG_NAMES));
}
#endif

// ---- backward (owned by the backward engineer) ----
PortattnBwdParams bwd_params(uintptr_t dout, py::handle dout_strides, uintptr_t dq,
                             py::handle dq_strides, uintptr_t dk, py::handle dk_strides,
                             uintptr_t dv, py::handle dv_strides, uintptr_t workspace,
                             int64_t workspace_bytes, bool deterministic,
                             const PortattnFwdParams& fwd) {
  PortattnBwdParams p;
  p.fwd = fwd;
  p.dout = ptr<const void>(dout);
  p.dout_strides = tensor4(dout_strides);
  p.dq = ptr<void>(dq);
  p.dk = ptr<void>(dk);
  p.dv = ptr<void>(dv);
  p.dq_strides = tensor4(dq_strides);
  p.dk_strides = tensor4(dk_strides);
  p.dv_strides = tensor4(dv_strides);
  p.workspace = ptr<void>(workspace);
  p.workspace_bytes = workspace_bytes;
  p.deterministic = deterministic ? 1 : 0;
  return p;
}

// bwd(dout, dout_strides, dq, dq_strides, dk, dk_strides, dv, dv_strides,
//     workspace, workspace_bytes, deterministic, <the forward call's arguments>)
void bwd(uintptr_t dout, py::handle dout_strides, uintptr_t dq, py::handle dq_strides,
         uintptr_t dk, py::handle dk_strides, uintptr_t dv, py::handle dv_strides,
         uintptr_t workspace, int64_t workspace_bytes, bool deterministic, PORTATTN_FWD_ARGS) {
  const PortattnBwdParams p = bwd_params(
      dout, dout_strides, dq, dq_strides, dk, dk_strides, dv, dv_strides, workspace,
      workspace_bytes, deterministic,
      fwd_params(q, k, v, out, lse, q_strides, k_strides, v_strides, out_strides,
                 lse_batch_stride, lse_head_stride, dtype, batch, nheads, nheads_k, headdim,
                 seqlen_q, seqlen_k, cu_seqlens_q, cu_seqlens_k, seqused_k, softmax_scale, softcap,
                 window_left, window_right, alibi_slopes, alibi_batch_stride, dropout_p,
                 philox_seed, philox_offset, stream));
  char message[512];
  check(portattn_cuda_bwd(&p, message, sizeof(message)), message);
}

// Bytes of scratch bwd() needs for this shape (the workspace layout depends on
// nothing else: varlen rows are padded to seqlen_q / seqlen_k, the maxima).
int64_t bwd_workspace_bytes(int batch, int nheads, int nheads_k, int headdim, int seqlen_q,
                            int seqlen_k, bool deterministic) {
  PortattnBwdParams p{};
  p.fwd.batch = batch;
  p.fwd.nheads = nheads;
  p.fwd.nheads_k = nheads_k;
  p.fwd.headdim = headdim;
  p.fwd.seqlen_q = seqlen_q;
  p.fwd.seqlen_k = seqlen_k;
  p.deterministic = deterministic ? 1 : 0;
  return portattn_cuda_bwd_workspace_bytes(&p);
}
// The support matrix's per-head-dim shared-memory budgets (capability/matrix.py
// "smem_bytes"): what the smallest backward block shape of each built head dim
// needs, so a device is judged by the kernels actually built.
py::dict smem_budgets(const py::list& head_dims) {
  py::dict backward;
  for (py::handle hd : head_dims) backward[hd] = portattn_cuda_bwd_smem_bytes(hd.cast<int>());
  py::dict budgets;
  budgets["backward"] = backward;
  return budgets;
}
// ---- end backward ----

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
  py::dict budgets = smem_budgets(head_dims);
  py::dict forward;
  for (py::handle hd : head_dims) forward[hd] = portattn_cuda_fwd_smem_bytes(hd.cast<int>());
  budgets["forward"] = forward;
  config["smem_bytes"] = budgets;
  return config;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "portattn CUDA kernels (sm80+); see portattn/backends/cuda/__init__.py";
  m.def("fwd", &fwd, "forward attention over raw pointers (see backends/common/params.h)");
#ifdef PORTATTN_WITH_HOPPER
  m.def("hopper_fwd", &hopper_fwd,
        "unverified sm_90a forward (TMA + wgmma), fwd()'s arguments; not used by dispatch");
#endif
  m.def("build_config", &build_config,
        "what this build contains: {'archs', 'ptx', 'head_dims', 'dtypes'}");
  // ---- backward (owned by the backward engineer): m.def("bwd", ...) and helpers here ----
  m.def("bwd", &bwd, "backward attention over raw pointers (see backends/common/params.h)");
  m.def("bwd_workspace_bytes", &bwd_workspace_bytes,
        "scratch bytes bwd() needs: (batch, nheads, nheads_k, headdim, seqlen_q, seqlen_k, "
        "deterministic)");
  m.def("bwd_smem_bytes", &portattn_cuda_bwd_smem_bytes,
        "smallest shared memory (bytes) of the backward block shapes for an instantiated head dim");
  // ---- end backward bindings ----
}
