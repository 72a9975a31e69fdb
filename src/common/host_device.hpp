#pragma once
// Lets the few pieces shared by the CPU and CUDA backends compile in both worlds.
#if defined(__CUDACC__)
#define TA_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TA_HOST_DEVICE inline
#endif
