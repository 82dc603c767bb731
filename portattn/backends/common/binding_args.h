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

// Note [portattn binding argument lists]
// fwd and decode take the same leading arguments (the tensors, their strides and
// shapes: PORTATTN_TENSOR_ARGS) and the same score modifiers further on
// (PORTATTN_SCORE_ARGS), in the same places of both lists; each group is spelled
// once here, with the one filler that copies it into either params struct, so
// the two lists and their fillers cannot drift apart. Every list has a *_NAMES
// twin so an entry point forwards its arguments without spelling them again.
#define PORTATTN_TENSOR_ARGS                                                                       \
  uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out, uintptr_t lse, pybind11::handle q_strides, \
      pybind11::handle k_strides, pybind11::handle v_strides, pybind11::handle out_strides,        \
      int64_t lse_batch_stride, int64_t lse_head_stride, int dtype, int batch, int nheads,         \
      int nheads_k, int headdim, int seqlen_q, int seqlen_k, uintptr_t cu_seqlens_q,               \
      uintptr_t cu_seqlens_k
#define PORTATTN_TENSOR_ARG_NAMES                                                                  \
  q, k, v, out, lse, q_strides, k_strides, v_strides, out_strides, lse_batch_stride,               \
      lse_head_stride, dtype, batch, nheads, nheads_k, headdim, seqlen_q, seqlen_k, cu_seqlens_q,  \
      cu_seqlens_k
#define PORTATTN_SCORE_ARGS                                                                        \
  float softmax_scale, float softcap, int window_left, int window_right, uintptr_t alibi_slopes,   \
      int64_t alibi_batch_stride
#define PORTATTN_SCORE_ARG_NAMES \
  softmax_scale, softcap, window_left, window_right, alibi_slopes, alibi_batch_stride

template <class Params>
inline void set_tensor_args(Params& p, PORTATTN_TENSOR_ARGS) {
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
}

template <class Params>
inline void set_score_args(Params& p, PORTATTN_SCORE_ARGS) {
  p.softmax_scale = softmax_scale;
  p.softcap = softcap;
  p.window_left = window_left;
  p.window_right = window_right;
  p.alibi_slopes = address<const float>(alibi_slopes);
  p.alibi_batch_stride = alibi_batch_stride;
}

// The forward call's arguments; bwd() takes PORTATTN_BWD_OWN_ARGS first, then these.
#define PORTATTN_FWD_ARGS                                                                          \
  PORTATTN_TENSOR_ARGS, uintptr_t seqused_k, PORTATTN_SCORE_ARGS, float dropout_p,                 \
      unsigned long long philox_seed, unsigned long long philox_offset, uintptr_t stream,          \
      int64_t total_q, int64_t total_k, uintptr_t philox_state, int sm_margin
#define PORTATTN_FWD_ARG_NAMES                                                                     \
  PORTATTN_TENSOR_ARG_NAMES, seqused_k, PORTATTN_SCORE_ARG_NAMES, dropout_p, philox_seed,          \
      philox_offset, stream, total_q, total_k, philox_state, sm_margin
#define PORTATTN_BWD_OWN_ARGS                                                                      \
  uintptr_t dout, pybind11::handle dout_strides, uintptr_t dq, pybind11::handle dq_strides,        \
      uintptr_t dk, pybind11::handle dk_strides, uintptr_t dv, pybind11::handle dv_strides,        \
      uintptr_t workspace, int64_t workspace_bytes, bool deterministic
#define PORTATTN_BWD_OWN_ARG_NAMES                                                                 \
  dout, dout_strides, dq, dq_strides, dk, dk_strides, dv, dv_strides, workspace, workspace_bytes,  \
      deterministic

inline PortattnFwdParams fwd_params(PORTATTN_FWD_ARGS) {
  PortattnFwdParams p{};
  set_tensor_args(p, PORTATTN_TENSOR_ARG_NAMES);
  p.seqused_k = address<const int32_t>(seqused_k);
  set_score_args(p, PORTATTN_SCORE_ARG_NAMES);
  p.dropout_p = dropout_p;
  p.philox_seed = philox_seed;
  p.philox_offset = philox_offset;
  p.stream = address<void>(stream);
  p.total_q = total_q;
  p.total_k = total_k;
  p.philox_state = address<const int64_t>(philox_state);
  p.sm_margin = sm_margin;
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

// ---- FP8 caches (Note [portattn fp8 kv cache] in params.h): the last arguments of decode and
// kvcache_append ----
#define PORTATTN_KV_ARGS                                                                           \
  int cache_dtype, uintptr_t k_descale, uintptr_t v_descale, int64_t k_descale_batch_stride,       \
      int64_t k_descale_head_stride, int64_t v_descale_batch_stride, int64_t v_descale_head_stride
#define PORTATTN_KV_ARG_NAMES                                                                      \
  cache_dtype, k_descale, v_descale, k_descale_batch_stride, k_descale_head_stride,                \
      v_descale_batch_stride, v_descale_head_stride

inline PortattnKvDescale kv_descale(PORTATTN_KV_ARGS) {
  PortattnKvDescale kv{};
  kv.cache_dtype = cache_dtype;
  kv.k_descale = address<const float>(k_descale);
  kv.v_descale = address<const float>(v_descale);
  kv.k_descale_batch_stride = k_descale_batch_stride;
  kv.k_descale_head_stride = k_descale_head_stride;
  kv.v_descale_batch_stride = v_descale_batch_stride;
  kv.v_descale_head_stride = v_descale_head_stride;
  return kv;
}

// ---- decode (Note [portattn decode] in params.h) ----
// Built in one place on the Python side: portattn/backends/abi.py decode_args().
#define PORTATTN_DECODE_ARGS                                                                       \
  PORTATTN_TENSOR_ARGS, uintptr_t cache_seqlens, int seqlen_new, uintptr_t cache_leftpad,          \
      uintptr_t cache_batch_idx, uintptr_t block_table, int64_t block_table_batch_stride,          \
      int page_size, int num_pages, int cache_batches, int kv_capacity, int64_t total_q,           \
      int64_t total_k, PORTATTN_SCORE_ARGS, int num_splits, uintptr_t o_partial,                   \
      uintptr_t lse_partial, uintptr_t stream, uintptr_t errors, PORTATTN_KV_ARGS
#define PORTATTN_DECODE_ARG_NAMES                                                                  \
  PORTATTN_TENSOR_ARG_NAMES, cache_seqlens, seqlen_new, cache_leftpad, cache_batch_idx,            \
      block_table, block_table_batch_stride, page_size, num_pages, cache_batches, kv_capacity,     \
      total_q, total_k, PORTATTN_SCORE_ARG_NAMES, num_splits, o_partial, lse_partial, stream,      \
      errors, PORTATTN_KV_ARG_NAMES

inline PortattnDecodeParams decode_params(PORTATTN_DECODE_ARGS) {
  PortattnDecodeParams p{};
  set_tensor_args(p, PORTATTN_TENSOR_ARG_NAMES);
  p.cache_seqlens = address<const int32_t>(cache_seqlens);
  p.seqlen_new = seqlen_new;
  p.cache_leftpad = address<const int32_t>(cache_leftpad);
  p.cache_batch_idx = address<const int32_t>(cache_batch_idx);
  p.block_table = address<const int32_t>(block_table);
  p.block_table_batch_stride = block_table_batch_stride;
  p.page_size = page_size;
  p.num_pages = num_pages;
  p.cache_batches = cache_batches;
  p.kv_capacity = kv_capacity;
  p.total_q = total_q;
  p.total_k = total_k;
  set_score_args(p, PORTATTN_SCORE_ARG_NAMES);
  p.num_splits = num_splits;
  p.o_partial = address<float>(o_partial);
  p.lse_partial = address<float>(lse_partial);
  p.stream = address<void>(stream);
  p.errors = address<int32_t>(errors);
  p.kv = kv_descale(PORTATTN_KV_ARG_NAMES);
  return p;
}

// kvcache_append(k_new, v_new, k_new_strides, v_new_strides, k_cache, v_cache, k_cache_strides,
//                v_cache_strides, q, q_out, q_strides, q_out_strides, dtype, batch, seqlen_new,
//                seqlen_q, nheads, nheads_k, headdim, cache_seqlens, cache_batch_idx, block_table,
//                block_table_batch_stride, page_size, num_pages, cache_batches, kv_capacity,
//                rotary_cos, rotary_sin, rotary_row_stride, rotary_dtype, rotary_dim, seqlen_ro,
//                rotary_interleaved, q_position_per_token, stream, errors, <PORTATTN_KV_ARGS>)
#define PORTATTN_APPEND_ARGS                                                                       \
  uintptr_t k_new, uintptr_t v_new, pybind11::handle k_new_strides,                                \
      pybind11::handle v_new_strides, uintptr_t k_cache, uintptr_t v_cache,                        \
      pybind11::handle k_cache_strides, pybind11::handle v_cache_strides, uintptr_t q,             \
      uintptr_t q_out, pybind11::handle q_strides, pybind11::handle q_out_strides, int dtype,      \
      int batch, int seqlen_new, int seqlen_q, int nheads, int nheads_k, int headdim,              \
      uintptr_t cache_seqlens, uintptr_t cache_batch_idx, uintptr_t block_table,                   \
      int64_t block_table_batch_stride, int page_size, int num_pages, int cache_batches,           \
      int kv_capacity, uintptr_t rotary_cos, uintptr_t rotary_sin, int64_t rotary_row_stride,      \
      int rotary_dtype, int rotary_dim, int seqlen_ro, bool rotary_interleaved,                    \
      bool q_position_per_token, uintptr_t stream, uintptr_t errors, PORTATTN_KV_ARGS
#define PORTATTN_APPEND_ARG_NAMES                                                                  \
  k_new, v_new, k_new_strides, v_new_strides, k_cache, v_cache, k_cache_strides, v_cache_strides,  \
      q, q_out, q_strides, q_out_strides, dtype, batch, seqlen_new, seqlen_q, nheads, nheads_k,    \
      headdim, cache_seqlens, cache_batch_idx, block_table, block_table_batch_stride, page_size,   \
      num_pages, cache_batches, kv_capacity, rotary_cos, rotary_sin, rotary_row_stride,            \
      rotary_dtype, rotary_dim, seqlen_ro, rotary_interleaved, q_position_per_token, stream,       \
      errors, PORTATTN_KV_ARG_NAMES

inline PortattnAppendParams append_params(PORTATTN_APPEND_ARGS) {
  PortattnAppendParams p{};
  p.k_new = address<const void>(k_new);
  p.v_new = address<const void>(v_new);
  p.k_new_strides = tensor4(k_new_strides);
  p.v_new_strides = tensor4(v_new_strides);
  p.k_cache = address<void>(k_cache);
  p.v_cache = address<void>(v_cache);
  p.k_cache_strides = tensor4(k_cache_strides);
  p.v_cache_strides = tensor4(v_cache_strides);
  p.q = address<const void>(q);
  p.q_out = address<void>(q_out);
  p.q_strides = tensor4(q_strides);
  p.q_out_strides = tensor4(q_out_strides);
  p.dtype = dtype;
  p.batch = batch;
  p.seqlen_new = seqlen_new;
  p.seqlen_q = seqlen_q;
  p.nheads = nheads;
  p.nheads_k = nheads_k;
  p.headdim = headdim;
  p.cache_seqlens = address<const int32_t>(cache_seqlens);
  p.cache_batch_idx = address<const int32_t>(cache_batch_idx);
  p.block_table = address<const int32_t>(block_table);
  p.block_table_batch_stride = block_table_batch_stride;
  p.page_size = page_size;
  p.num_pages = num_pages;
  p.cache_batches = cache_batches;
  p.kv_capacity = kv_capacity;
  p.rotary_cos = address<const void>(rotary_cos);
  p.rotary_sin = address<const void>(rotary_sin);
  p.rotary_row_stride = rotary_row_stride;
  p.rotary_dtype = rotary_dtype;
  p.rotary_dim = rotary_dim;
  p.seqlen_ro = seqlen_ro;
  p.rotary_interleaved = rotary_interleaved ? 1 : 0;
  p.q_position_per_token = q_position_per_token ? 1 : 0;
  p.stream = address<void>(stream);
  p.errors = address<int32_t>(errors);
  p.kv = kv_descale(PORTATTN_KV_ARG_NAMES);
  return p;
}

}  // namespace binding
}  // namespace portattn
