#pragma once
// TESSERA_HOST_DEVICE marks a function that device kernels call as well as host code: under a
// CUDA compiler it is __host__ __device__, elsewhere nothing. The 16-bit float conversions and
// the kernels' element formulas use it, so the CPU and a device round and compute alike.
#if defined(__CUDACC__)
#define TESSERA_HOST_DEVICE __host__ __device__
#else
#define TESSERA_HOST_DEVICE
#endif
