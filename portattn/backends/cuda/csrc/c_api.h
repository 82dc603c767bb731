// The C functions libportattn_cuda.so exports to the per-Python binding
// (binding.cpp, which must not see CUDA headers) and defines in *_entry.cu.
#pragma once
#include "../../common/params.h"

extern "C" {
// 0 on success; otherwise a cudaError_t value (or -1) with a message in `message`.
int portattn_cuda_fwd(const PortattnFwdParams* params, char* message, int message_len);
const char* portattn_cuda_build_archs();
const char* portattn_cuda_build_ptx();
int portattn_cuda_num_fwd_variants();
void portattn_cuda_fwd_variant(int index, int* head_dim, int* dtype);
int portattn_cuda_fwd_smem_bytes(int head_dim);
// The cap on every launch's shared memory per block, in bytes (0: none); Note [portattn smem budget].
void portattn_cuda_set_smem_cap(int bytes);
int portattn_cuda_smem_cap();
}
