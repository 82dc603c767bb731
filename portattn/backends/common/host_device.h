// PORTATTN_HD: the qualifiers of a function that the kernels (CUDA, HIP) and host code
// (the launchers, the CPU tests' plain C++ drivers) both call. One definition for every
// backends/common header that has such functions.
#pragma once

#ifndef PORTATTN_HD
#if defined(__CUDACC__) || defined(__HIPCC__)
#define PORTATTN_HD __host__ __device__ __forceinline__
#else
#define PORTATTN_HD inline
#endif
#endif
