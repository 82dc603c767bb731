// merge()'s Python argument list -> PortattnMergeParams, for both vendor modules
// (cuda/csrc/binding.cpp, rocm/csrc/module.cpp); the Python side is portattn/merge.py.
//
// merge(out, lse, block_out, block_lse, out_dtype, block_dtype, batch, seqlen, nheads, headdim,
//       out_strides, block_out_strides, lse_strides, block_lse_strides, stream)
// Every *_strides is a (batch, token, head) tuple of element strides.
#pragma once
#include <Python.h>
#include <pybind11/pybind11.h>
#include <stdint.h>

#include "merge.h"

namespace portattn {
namespace binding {

inline PortattnTensor4 strides3(pybind11::handle strides) {
  PyObject* t = strides.ptr();
  if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 3)
    throw pybind11::type_error("portattn merge: strides must be a (batch, token, head) tuple");
  return PortattnTensor4{PyLong_AsLongLong(PyTuple_GET_ITEM(t, 0)), PyLong_AsLongLong(PyTuple_GET_ITEM(t, 1)),
                         PyLong_AsLongLong(PyTuple_GET_ITEM(t, 2))};
}

#define PORTATTN_MERGE_ARGS                                                                        \
  uintptr_t out, uintptr_t lse, uintptr_t block_out, uintptr_t block_lse, int out_dtype,           \
      int block_dtype, int batch, int seqlen, int nheads, int headdim,                             \
      pybind11::handle out_strides, pybind11::handle block_out_strides,                            \
      pybind11::handle lse_strides, pybind11::handle block_lse_strides, uintptr_t stream
#define PORTATTN_MERGE_ARG_NAMES                                                                   \
  out, lse, block_out, block_lse, out_dtype, block_dtype, batch, seqlen, nheads, headdim,          \
      out_strides, block_out_strides, lse_strides, block_lse_strides, stream

inline PortattnMergeParams merge_params(PORTATTN_MERGE_ARGS) {
  PortattnMergeParams p{};
  p.out = reinterpret_cast<void*>(out);
  p.lse = reinterpret_cast<float*>(lse);
  p.block_out = reinterpret_cast<const void*>(block_out);
  p.block_lse = reinterpret_cast<const float*>(block_lse);
  p.out_dtype = out_dtype;
  p.block_dtype = block_dtype;
  p.batch = batch;
  p.seqlen = seqlen;
  p.nheads = nheads;
  p.headdim = headdim;
  p.out_strides = strides3(out_strides);
  p.block_out_strides = strides3(block_out_strides);
  p.lse_strides = strides3(lse_strides);
  p.block_lse_strides = strides3(block_lse_strides);
  p.stream = reinterpret_cast<void*>(stream);
  return p;
}

}  // namespace binding
}  // namespace portattn
