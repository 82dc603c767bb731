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

#include "../../common/binding_args.h"
#include "../../common/merge_binding.h"
#include "c_api.h"

extern "C" {
// ---- backward entry points ----
int portattn_cuda_bwd(const PortattnBwdParams* params, char* message, int message_len);
long long portattn_cuda_bwd_workspace_bytes(const PortattnBwdParams* params);
int portattn_cuda_bwd_smem_bytes(int head_dim);
// PORTATTN_SM80_BWD_WIDE (0 off, 1 on; other values only read it), and the tile a call would run.
int portattn_cuda_sm80_bwd_wide(int mode);
int portattn_cuda_bwd_tile(int head_dim, int budget, int wide, int extras, int* out);
int portattn_cuda_fwd_tile(int head_dim, int seqlen_q, int seqlen_k, int masked, int extras, int budget, int* out);
// ---- end backward declarations ----
// ---- decode (decode_entry.cu) ----
int portattn_cuda_decode(const PortattnDecodeParams* params, char* message, int message_len);
int portattn_cuda_kvcache_append(const PortattnAppendParams* params, char* message, int message_len);
void portattn_cuda_decode_tile(int head_dim, int cache_dtype, int* stage_keys, int* threads, int* smem_bytes);
// The split planner's input: the kernel a call would launch on the current device (decode_entry.cu).
int portattn_cuda_decode_occupancy(int head_dim, int dtype, int cache_dtype, int extras, int* facts);
// Tuning: the FP8 decode path (0 smem, 1 regs, 2 regs_deep; other values only read it).
int portattn_cuda_decode_fp8_path(int path);
#ifdef PORTATTN_WITH_HOPPER
// Opt-in sm_90a forward (hopper_fwd_entry.cu; build with PORTATTN_CUDA_HOPPER=1).
int portattn_cuda_hopper_fwd(const PortattnFwdParams* params, char* message, int message_len);
int portattn_cuda_hopper_num_variants();
void portattn_cuda_hopper_variant(int index, int* head_dim, int* dtype);
int portattn_cuda_hopper_fwd_tuning(int head_dim, int added, int* out, int capacity);
// sm_90a backward (hopper_bwd_entry.cu): same workspace as portattn_cuda_bwd.
int portattn_cuda_hopper_bwd(const PortattnBwdParams* params, char* message, int message_len);
// Tuning: the default mode's dQ path (0 atomic, 1 bulk; other values only read it).
int portattn_cuda_hopper_bwd_dq_mode(int mode);
#endif
// bwd_entry.cu, every build: the Hopper backward's workspace layout (ordered deterministic dQ).
long long portattn_cuda_hopper_bwd_workspace_bytes(const PortattnBwdParams* params);
// merge_entry.cu: the in-place LSE merge (Note [portattn merge attention states] in common/merge.h).
int portattn_cuda_merge(const PortattnMergeParams* params, char* message, int message_len);
}

namespace py = pybind11;

namespace {

void check(int code, const char* message) {
  if (code != 0) throw std::runtime_error(message);
}

// The argument list and its unpacking are shared with the ROCm module.
using portattn::binding::bwd_params;
using portattn::binding::fwd_params;

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

// ---- backward ----
// bwd(dout, dout_strides, dq, dq_strides, dk, dk_strides, dv, dv_strides,
//     workspace, workspace_bytes, deterministic, <the forward call's arguments>)
void call_bwd_entry(int (*entry)(const PortattnBwdParams*, char*, int), const PortattnBwdParams& p) {
  char message[512];
  check(entry(&p, message, sizeof(message)), message);
}

void bwd(PORTATTN_BWD_OWN_ARGS, PORTATTN_FWD_ARGS) {
  call_bwd_entry(portattn_cuda_bwd,
                 bwd_params(PORTATTN_BWD_OWN_ARG_NAMES, fwd_params(PORTATTN_FWD_ARG_NAMES)));
}

#ifdef PORTATTN_WITH_HOPPER
// Same arguments (and workspace) as bwd(); refuses (RuntimeError) what the Hopper kernel does not serve.
void hopper_bwd(PORTATTN_BWD_OWN_ARGS, PORTATTN_FWD_ARGS) {
  call_bwd_entry(portattn_cuda_hopper_bwd,
                 bwd_params(PORTATTN_BWD_OWN_ARG_NAMES, fwd_params(PORTATTN_FWD_ARG_NAMES)));
}

// PORTATTN_HOPPER_BWD_DQ at run time (tuning): "" reads, "auto", "atomic" or "bulk" sets;
// returns the mode now in effect ("invalid": the variable holds none of the names).
std::string hopper_bwd_dq_mode(const std::string& mode) {
  int code = -2;
  if (mode == "atomic") code = 0;
  else if (mode == "bulk") code = 1;
  else if (mode == "auto") code = 2;
  else if (!mode.empty())
    throw std::invalid_argument("hopper_bwd_dq_mode: expected 'auto', 'atomic' or 'bulk', got '" + mode + "'");
  const int now = portattn_cuda_hopper_bwd_dq_mode(code);
  return now == 2 ? "auto" : now == 1 ? "bulk" : now == 0 ? "atomic" : "invalid";
}
#endif

// Bytes of scratch bwd() needs for this shape (the workspace layout depends on
// nothing else: varlen rows are padded to seqlen_q / seqlen_k, the maxima).
PortattnBwdParams workspace_params(int batch, int nheads, int nheads_k, int headdim, int seqlen_q, int seqlen_k,
                                   bool deterministic) {
  PortattnBwdParams p{};
  p.fwd.batch = batch;
  p.fwd.nheads = nheads;
  p.fwd.nheads_k = nheads_k;
  p.fwd.headdim = headdim;
  p.fwd.seqlen_q = seqlen_q;
  p.fwd.seqlen_k = seqlen_k;
  p.deterministic = deterministic ? 1 : 0;
  return p;
}

// ordered_dq: the layout of hopper_bwd (its deterministic mode keeps one dQ accumulator
// and per-query-block counts instead of one slice per split); a plain function of the
// shape in every build, so the CPU tests check it too.
int64_t bwd_workspace_bytes(int batch, int nheads, int nheads_k, int headdim, int seqlen_q,
                            int seqlen_k, bool deterministic, bool ordered_dq) {
  const PortattnBwdParams p = workspace_params(batch, nheads, nheads_k, headdim, seqlen_q, seqlen_k, deterministic);
  return ordered_dq ? portattn_cuda_hopper_bwd_workspace_bytes(&p) : portattn_cuda_bwd_workspace_bytes(&p);
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

// ---- decode ----
void decode(PORTATTN_DECODE_ARGS) {
  char message[512];
  const PortattnDecodeParams p = portattn::binding::decode_params(PORTATTN_DECODE_ARG_NAMES);
  check(portattn_cuda_decode(&p, message, sizeof(message)), message);
}

void kvcache_append(PORTATTN_APPEND_ARGS) {
  char message[512];
  const PortattnAppendParams p = portattn::binding::append_params(PORTATTN_APPEND_ARG_NAMES);
  check(portattn_cuda_kvcache_append(&p, message, sizeof(message)), message);
}

// {"stage_keys", "threads", "smem_bytes"} of the decode kernel serving head_dim (the split planner's
// input); cache_dtype: PortattnCacheDtype (1: an e4m3 cache).
py::dict decode_tile(int head_dim, int cache_dtype) {
  int stage_keys = -1, threads = -1, smem_bytes = -1;
  portattn_cuda_decode_tile(head_dim, cache_dtype, &stage_keys, &threads, &smem_bytes);
  py::dict tile;
  tile["stage_keys"] = stage_keys;
  tile["threads"] = threads;
  tile["smem_bytes"] = smem_bytes;
  return tile;
}

// {"stage_keys", "threads", "smem_bytes", "stages", "registers", "ctas_per_sm"} of the kernel a decode
// call of (head_dim, dtype: PortattnDtype, cache_dtype, extras: softcap or ALiBi) would launch on the
// current device, the FP8 path in effect included (the split planner's input, portattn/decode.py);
// ctas_per_sm is -1 when the occupancy query failed (the planner then counts by shared memory).
py::dict decode_occupancy(int head_dim, int dtype, int cache_dtype, bool extras) {
  int facts[6];
  portattn_cuda_decode_occupancy(head_dim, dtype, cache_dtype, extras ? 1 : 0, facts);
  static const char* const kNames[6] = {"stage_keys", "threads", "smem_bytes", "stages", "registers", "ctas_per_sm"};
  py::dict tile;
  for (int i = 0; i < 6; ++i) tile[kNames[i]] = facts[i];
  return tile;
}

// PORTATTN_DECODE_FP8_PATH at run time (tuning): "" reads, "smem", "regs" or "regs_deep" sets; returns
// the path now in effect ("invalid": the variable holds none of the names).
const char* const kFp8PathNames[] = {"smem", "regs", "regs_deep"};
std::string decode_fp8_path(const std::string& path) {
  int code = -2;
  for (int i = 0; i < 3; ++i)
    if (path == kFp8PathNames[i]) code = i;
  if (code == -2 && !path.empty())
    throw std::invalid_argument("decode_fp8_path: expected 'smem', 'regs' or 'regs_deep', got '" + path + "'");
  const int now = portattn_cuda_decode_fp8_path(code);
  return now >= 0 && now < 3 ? kFp8PathNames[now] : "invalid";
}

// The same as a number (0 smem, 1 regs, 2 regs_deep, -1 invalid), cheap enough for every FP8 decode
// call: the planner's plan key (portattn/decode.py).
int decode_fp8_path_id() { return portattn_cuda_decode_fp8_path(-2); }

// PORTATTN_SM80_BWD_WIDE at run time: None reads, True / False sets; returns the setting in effect.
bool sm80_bwd_wide(py::object on) {
  const int mode = on.is_none() ? -1 : (on.cast<bool>() ? 1 : 0);
  return portattn_cuda_sm80_bwd_wide(mode) != 0;
}

// The sm80+ backward's main-kernel tile at an instantiable head dim under a shared-memory budget
// (bytes); wide None: the current PORTATTN_SM80_BWD_WIDE setting; extras: a call with softcap,
// ALiBi or dropout. No CUDA call.
py::dict bwd_tile(int head_dim, int budget, py::object wide, bool extras) {
  int out[7] = {0, 0, 0, 0, 0, 0, 0};
  const int mode = wide.is_none() ? -1 : (wide.cast<bool>() ? 1 : 0);
  if (portattn_cuda_bwd_tile(head_dim, budget, mode, extras ? 1 : 0, out) != 0)
    throw std::invalid_argument("bwd_tile: no backward shape for head dim " + std::to_string(head_dim));
  py::dict d;
  d["block_n"] = out[0];
  d["block_m"] = out[1];
  d["stages"] = out[2];
  d["warps"] = out[3];
  d["smem_bytes"] = out[4];
  d["dsplit"] = out[5];
  d["wide"] = out[6] != 0;
  return d;
}
// The sm80+ forward's tile for a call at an instantiable head dim under a shared-memory budget
// (bytes): lengths (the longest of a varlen batch), masked (causal or a window), extras (softcap,
// ALiBi or dropout). No CUDA call.
py::dict fwd_tile(int head_dim, int seqlen_q, int seqlen_k, int budget, bool masked, bool extras) {
  int out[5] = {0, 0, 0, 0, 0};
  if (portattn_cuda_fwd_tile(head_dim, seqlen_q, seqlen_k, masked ? 1 : 0, extras ? 1 : 0, budget, out) != 0)
    throw std::invalid_argument("fwd_tile: no forward tile for head dim " + std::to_string(head_dim));
  py::dict d;
  d["block_m"] = out[0];
  d["block_n"] = out[1];
  d["warps"] = out[2];
  d["smem_bytes"] = out[3];
  d["narrow"] = out[4] != 0;
  return d;
}
// ---- end decode ----

// ---- merge (common/merge_binding.h) ----
void merge(PORTATTN_MERGE_ARGS) {
  char message[512];
  const PortattnMergeParams p = portattn::binding::merge_params(PORTATTN_MERGE_ARG_NAMES);
  check(portattn_cuda_merge(&p, message, sizeof(message)), message);
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
  py::dict budgets = smem_budgets(head_dims);
  py::dict forward, decode;
  for (py::handle hd : head_dims) {
    forward[hd] = portattn_cuda_fwd_smem_bytes(hd.cast<int>());
    int stage_keys = -1, threads = -1, smem_bytes = -1;
    portattn_cuda_decode_tile(hd.cast<int>(), PORTATTN_CACHE_AS_QUERY, &stage_keys, &threads, &smem_bytes);
    if (smem_bytes > 0) decode[hd] = smem_bytes;
  }
  budgets["forward"] = forward;
  if (py::len(decode) > 0) budgets["decode"] = decode;
  config["smem_bytes"] = budgets;
#ifdef PORTATTN_WITH_HOPPER
  // The sm_90a path (dispatch's "cuda-sm90" backend): its own head dims and dtypes.
  py::list hopper_head_dims, hopper_dtypes;
  for (int i = 0; i < portattn_cuda_hopper_num_variants(); ++i) {
    int head_dim = 0, dtype = 0;
    portattn_cuda_hopper_variant(i, &head_dim, &dtype);
    py::int_ hd(head_dim);
    py::str name(kDtypeNames[dtype]);
    if (!hopper_head_dims.contains(hd)) hopper_head_dims.append(hd);
    if (!hopper_dtypes.contains(name)) hopper_dtypes.append(name);
  }
  py::dict hopper;
  py::list hopper_archs;
  hopper_archs.append(py::str("sm_90a"));
  hopper["archs"] = hopper_archs;
  hopper["head_dims"] = hopper_head_dims;
  hopper["dtypes"] = hopper_dtypes;
  // Tuning builds only (hopper_fwd_schedule.h): {head dim: values of PORTATTN_HOPPER_FWD_SCHEDULE},
  // the single schedules as ints, the additions to the defaults as "+<bits>" strings.
  py::dict tuning;
  for (py::handle hd : hopper_head_dims) {
    py::list values;
    for (int added = 0; added < 2; ++added) {
      int bits[64];
      const int count = portattn_cuda_hopper_fwd_tuning(hd.cast<int>(), added, bits, 64);
      for (int i = 0; i < count && i < 64; ++i) {
        if (added)
          values.append(py::str("+" + std::to_string(bits[i])));
        else
          values.append(py::int_(bits[i]));
      }
    }
    if (py::len(values) > 0) tuning[hd] = values;
  }
  if (py::len(tuning) > 0) hopper["fwd_tuning"] = tuning;
  config["hopper"] = hopper;
#endif
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
  m.def("set_smem_cap", &portattn_cuda_set_smem_cap, py::arg("bytes"),
        "cap every launch's shared memory per block at this many bytes (0: the device's limit); "
        "portattn sets it from PORTATTN_MAX_SMEM_KIB when it loads the module");
  m.def("smem_cap", &portattn_cuda_smem_cap, "the cap set_smem_cap() set, in bytes (0: none)");
  m.def("build_config", &build_config,
        "what this build contains: {'archs', 'ptx', 'head_dims', 'dtypes'}");
  // ---- backward ----
  m.def("bwd", &bwd, "backward attention over raw pointers (see backends/common/params.h)");
#ifdef PORTATTN_WITH_HOPPER
  m.def("hopper_bwd", &hopper_bwd,
        "sm_90a backward (TMA + wgmma), bwd()'s arguments; workspace: bwd_workspace_bytes(..., ordered_dq=True)");
  m.def("hopper_bwd_dq_mode", &hopper_bwd_dq_mode, py::arg("mode") = "",
        "tuning: the Hopper backward's dQ path in the default mode, 'atomic' or 'bulk' "
        "(PORTATTN_HOPPER_BWD_DQ); no argument reads it");
#endif
  m.def("bwd_workspace_bytes", &bwd_workspace_bytes,
        "scratch bytes bwd() needs: (batch, nheads, nheads_k, headdim, seqlen_q, seqlen_k, "
        "deterministic); ordered_dq=True: what hopper_bwd() needs",
        py::arg("batch"), py::arg("nheads"), py::arg("nheads_k"), py::arg("headdim"), py::arg("seqlen_q"),
        py::arg("seqlen_k"), py::arg("deterministic"), py::arg("ordered_dq") = false);
  m.def("sm80_bwd_wide", &sm80_bwd_wide, py::arg("on") = py::none(),
        "PORTATTN_SM80_BWD_WIDE: the sm80+ backward's full-head-dim kernel from head dim 64 up; "
        "True / False sets it for later calls, no argument reads it");
  m.def("bwd_tile", &bwd_tile, py::arg("head_dim"), py::arg("budget"), py::arg("wide") = py::none(),
        py::arg("extras") = false,
        "the sm80+ backward's main-kernel tile under a shared-memory budget (bytes), for a call with "
        "softcap, ALiBi or dropout if extras: "
        "{'block_n', 'block_m', 'stages', 'warps', 'smem_bytes', 'dsplit', 'wide'}");
  m.def("fwd_tile", &fwd_tile, py::arg("head_dim"), py::arg("seqlen_q"), py::arg("seqlen_k"), py::arg("budget"),
        py::arg("masked") = false, py::arg("extras") = false,
        "the sm80+ forward's tile for a call under a shared-memory budget (bytes): "
        "{'block_m', 'block_n', 'warps', 'smem_bytes', 'narrow'}");
  m.def("bwd_smem_bytes", &portattn_cuda_bwd_smem_bytes,
        "smallest shared memory (bytes) of the backward block shapes for an instantiated head dim");
  // ---- end backward bindings ----
  m.def("decode", &decode, "split-KV decode over a KV cache read in place (common/params.h: PortattnDecodeParams)");
  m.def("kvcache_append", &kvcache_append,
        "append new k/v to a cache with rotary, and rotate q (common/params.h: PortattnAppendParams)");
  m.def("decode_tile", &decode_tile, "tile facts of the decode kernel serving a head dim", py::arg("head_dim"),
        py::arg("cache_dtype") = 0);
  m.def("decode_occupancy", &decode_occupancy, py::arg("head_dim"), py::arg("dtype"), py::arg("cache_dtype"),
        py::arg("extras"),
        "the decode kernel a call would launch on the current device: tile facts, registers, CTAs per SM");
  m.def("decode_fp8_path", &decode_fp8_path, py::arg("path") = "",
        "tuning: the FP8 decode's path, 'regs' (register fragments, the default), 'regs_deep' (the same, "
        "deeper pipeline) or 'smem' (conversion pass) (PORTATTN_DECODE_FP8_PATH); no argument reads it");
  m.def("decode_fp8_path_id", &decode_fp8_path_id, "the FP8 decode path as 0 smem, 1 regs, 2 regs_deep, -1 invalid");
  m.def("merge", &merge, "in-place LSE merge of a partial attention result (common/merge.h)");
}
