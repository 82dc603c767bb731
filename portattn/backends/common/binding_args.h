// Python ints and stride tuples -> the C ABI structs of params.h, for both vendor modules.
//
// cuda/csrc/binding.cpp and rocm/csrc/module.cpp export `fwd` and `bwd` with this one
// argument list, and portattn/backends/abi.py builds it once for both. The per-call
// cost matters (small problems are host-bound), so strides arrive as the tuples
// torch's .stride() returns and are read with the raw CPython API.
#pragma once
#include <Python.h>
#include <pybind11/pybind11.h>
#include <stdint.h>

#include "params.h"

namespace portattn {
namespace binding {

namespace py = pybind11;

inline int64_t tuple_item(PyObject* tuple, Py_ssize_t index) {
  return PyLong_AsLongLong(PyTuple_GET_ITEM(tuple, index));
}

// (B, S, H, D) strides -> batch/row/head; a varlen (total, H, D) tensor has no batch stride.
inline PortattnTensor4 tensor4(py::handle strides) {
  PyObject* t = strides.ptr();
  if (!PyTuple_Check(t)) throw py::type_error("portattn: strides must be a tuple");
  const Py_ssize_t n = PyTuple_GET_SIZE(t);
  if (n == 4) return PortattnTensor4{tuple_item(t, 0), tuple_item(t, 1), tuple_item(t, 2)};
  if (n == 3) return PortattnTensor4{0, tuple_item(t, 0), tuple_item(t, 1)};
  throw py::value_error("portattn: expected the strides of a 3-d or 4-d tensor");
}

template <typename T>
T* address(uintptr_t value) {
  return reinterpret_cast<T*>(value);
}

// The forward call's arguments; bwd() takes PORTATTN_BWD_OWN_ARGS first, then these.
#define PORTATTN_FWD_ARGS                                                                          \
  uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out, uintptr_t lse, pybind11::handle q_strides, \
      pybind11::handle k_strides, pybind11::handle v_strides, pybind11::handle out_strides,        \
      int64_t lse_batch_stride, int64_t lse_head_stride, int dtype, int batch, int nheads,         \
      int nheads_k, int headdim, int seqlen_q, int seqlen_k, uintptr_t cu_seqlens_q,               \
      uintptr_t cu_seqlens_k, uintptr_t seqused_k, float softmax_scale, float softcap,             \
      int window_left, int window_right, uintptr_t alibi_slopes, int64_t alibi_batch_stride,       \
      float dropout_p, unsigned long long philox_seed, unsigned long long philox_offset,           \
      uintptr_t stream, int64_t total_q, int64_t total_k
#define PORTATTN_FWD_ARG_NAMES                                                                     \
  q, k, v, out, lse, q_strides, k_strides, v_strides, out_strides, lse_batch_stride,               \
      lse_head_stride, dtype, batch, nheads, nheads_k, headdim, seqlen_q, seqlen_k, cu_seqlens_q,  \
      cu_seqlens_k, seqused_k, softmax_scale, softcap, window_left, window_right, alibi_slopes,    \
      alibi_batch_stride, dropout_p, philox_seed, philox_offset, stream, total_q, total_k
#define PORTATTN_BWD_OWN_ARGS                                                                      \
  uintptr_t dout, pybind11::handle dout_strides, uintptr_t dq, pybind11::handle dq_strides,        \
      uintptr_t dk, pybind11::handle dk_strides, uintptr_t dv, pybind11::handle dv_strides,        \
      uintptr_t workspace, int64_t workspace_bytes, bool deterministic
#define PORTATTN_BWD_OWN_ARG_NAMES                                                                 \
  dout, dout_strides, dq, dq_strides, dk, dk_strides, dv, dv_strides, workspace, workspace_bytes,  \
      deterministic

inline PortattnFwdParams fwd_params(PORTATTN_FWD_ARGS) {
  PortattnFwdParams p{};
  p.q = address<const void>(q);
  p.k = address<const void>(k);
  p.v = address<const void>(v);
  p.out = address<void>(out);
  p.lse = address<float>(lse);
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
  p.cu_seqlens_q = address<const int32_t>(cu_seqlens_q);
  p.cu_seqlens_k = address<const int32_t>(cu_seqlens_k);
  p.seqused_k = address<const int32_t>(seqused_k);
  p.softmax_scale = softmax_scale;
  p.softcap = softcap;
  p.window_left = window_left;
  p.window_right = window_right;
  p.alibi_slopes = address<const float>(alibi_slopes);
  p.alibi_batch_stride = alibi_batch_stride;
  p.dropout_p = dropout_p;
  p.philox_seed = philox_seed;
  p.philox_offset = philox_offset;
  p.stream = address<void>(stream);
  p.total_q = total_q;
  p.total_k = total_k;
  return p;
}

inline PortattnBwdParams bwd_params(PORTATTN_BWD_OWN_ARGS, const PortattnFwdParams& fwd) {
  PortattnBwdParams p{};
  p.fwd = fwd;
  p.dout = address<const void>(dout);
  p.dout_strides = tensor4(dout_strides);
  p.dq = address<void>(dq);
  p.dk = address<void>(dk);
  p.dv = address<void>(dv);
  p.dq_strides = tensor4(dq_strides);
  p.dk_strides = tensor4(dk_strides);
  p.dv_strides = tensor4(dv_strides);
  p.workspace = address<void>(workspace);
  p.workspace_bytes = workspace_bytes;
  p.deterministic = deterministic ? 1 : 0;
  return p;
}

}  // namespace binding
}  // namespace portattn
