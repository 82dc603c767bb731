// Host side shared by the Hopper entries (hopper_fwd_entry.cu, hopper_bwd_entry.cu):
// (batch, seqlen, heads, head_dim) tensors as 4-d TMA tensor maps, and the
// calls the Hopper kernels do not serve.
//
// Tensor maps are encoded with cuTensorMapEncodeTiled, which the runtime hands
// out through cudaGetDriverEntryPointByVersion: the library keeps linking
// cudart statically and never links libcuda.
#pragma once
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <stdio.h>

#include <mutex>

#include "../../common/params.h"
#include "variant_table.h"

namespace portattn {
namespace hopper {

inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder(cudaError_t* err) {
  static PFN_cuTensorMapEncodeTiled_v12000 encoder = nullptr;
  static cudaError_t status = cudaSuccess;
  static std::once_flag once;
  std::call_once(once, [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    status = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                              cudaEnableDefault, &found);
    if (status == cudaSuccess && found != cudaDriverEntryPointSuccess) status = cudaErrorNotSupported;
    encoder = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  });
  *err = status;
  return encoder;
}

// The tensor maps' batch and row extents of a call (forward and backward alike):
// varlen packs every sequence into one "batch" of all the tensor's rows, and the
// kernels offset each sequence by its seq_bounds start (map batch coordinate 0).
struct MapExtents {
  int batch;
  int rows_q, rows_k;
};

inline cudaError_t map_extents(const PortattnFwdParams& p, MapExtents* extents) {
  const bool varlen = p.cu_seqlens_q != nullptr;
  const int64_t rows_q = varlen ? p.total_q : p.seqlen_q;
  const int64_t rows_k = varlen ? p.total_k : p.seqlen_k;
  if (rows_q > INT32_MAX || rows_k > INT32_MAX) {
    portattn::cuda::set_error_detail("more than 2^31 rows");
    return cudaErrorInvalidValue;
  }
  *extents = MapExtents{varlen ? 1 : p.batch, static_cast<int>(rows_q), static_cast<int>(rows_k)};
  return cudaSuccess;
}

// A (batch, seqlen, heads, head_dim) tensor as a 4-d tensor map whose box is
// one 64-column panel of `box_rows` rows of one (head, batch), 128B-swizzled.
inline cudaError_t encode_bshd(CUtensorMap* map, const void* data, const PortattnTensor4& strides,
                               int dtype, int batch, int seqlen, int heads, int head_dim, int box_rows) {
  cudaError_t err = cudaSuccess;
  PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder(&err);
  if (err != cudaSuccess) {
    portattn::cuda::set_error_detail("cuTensorMapEncodeTiled is not available from the driver");
    return err;
  }
  // The encoder is a driver call and needs a context current on this thread, which
  // the runtime binds only lazily: torch's autograd worker thread had none when the
  // backward ran there (CUresult 201, invalid context). cudaSetDevice on the current
  // device binds its primary context (CUDA >= 12); when it already is, it costs little.
  int device = 0;
  err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaSetDevice(device);
  if (err != cudaSuccess) return err;
  // A dimension of extent 1 may carry any stride (e.g. 0 for an expanded
  // view); TMA wants a nonzero multiple of 16 bytes, which it never uses there.
  auto stride_bytes = [](int64_t elems, int extent) -> cuuint64_t {
    return (extent == 1 && elems * 2 < 16) ? 16 : static_cast<cuuint64_t>(elems * 2);
  };
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(seqlen),
                              static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(batch)};
  const cuuint64_t global_strides[3] = {stride_bytes(strides.row_stride, seqlen),
                                        stride_bytes(strides.head_stride, heads),
                                        stride_bytes(strides.batch_stride, batch)};
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(box_rows), 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult res = encode(
      map, dtype == PORTATTN_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
      4, const_cast<void*>(data), dims, global_strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (res != CUDA_SUCCESS) {
    char text[160];
    snprintf(text, sizeof(text), "cuTensorMapEncodeTiled failed (CUresult %d)", static_cast<int>(res));
    portattn::cuda::set_error_detail(text);
    return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

// Writes why the Hopper kernels cannot serve the call into `text` and returns
// true, or returns false. Input validation proper (shapes, dtypes, GQA
// divisibility) happened in portattn/validation.py; these are the features the
// sm80+ kernels serve instead, TMA's alignment rule and the device. Windows
// and softcap: both Hopper directions serve them; varlen (cu_seqlens) only the
// forward (`varlen_served`); seqused_k neither.
inline bool refuses(const PortattnFwdParams& p, char* text, int text_len, bool varlen_served) {
  const char* why = nullptr;
  if (p.seqused_k != nullptr)
    why = "seqused_k calls are served by the sm80+ kernel only";
  else if (!varlen_served && (p.cu_seqlens_q != nullptr || p.cu_seqlens_k != nullptr))
    why = "varlen calls are served by the sm80+ kernel only";
  else if (p.alibi_slopes != nullptr)
    why = "ALiBi is served by the sm80+ kernel only";
  else if (p.dropout_p > 0.f)
    why = "dropout is served by the sm80+ kernel only";
  else if (!cuda::aligned16(p.q) || !cuda::aligned16(p.k) || !cuda::aligned16(p.v) ||
           !cuda::aligned16(p.out) || !cuda::strides_aligned(p.q_strides) ||
           !cuda::strides_aligned(p.k_strides) || !cuda::strides_aligned(p.v_strides) ||
           !cuda::strides_aligned(p.out_strides))
    why = "TMA needs 16-byte aligned data pointers and strides that are multiples of 8 elements "
          "(call .contiguous() on the input)";
  if (why != nullptr) {
    snprintf(text, text_len, "portattn cuda hopper: %s", why);
    return true;
  }
  int device = 0, major = 0, minor = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (err != cudaSuccess) {
    snprintf(text, text_len, "portattn cuda hopper: cannot query the device: %s", cudaGetErrorString(err));
    return true;
  }
  if (major != 9 || minor != 0) {
    snprintf(text, text_len,
             "portattn cuda hopper: needs an sm_90 device (built for sm_90a); device %d is sm_%d%d",
             device, major, minor);
    return true;
  }
  return false;
}

}  // namespace hopper
}  // namespace portattn
