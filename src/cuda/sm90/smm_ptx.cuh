#pragma once
// What the Hopper softmax(X) @ V and fp32 attention kernels need beyond ptx_sm90.cuh: a fence
// that hands plain shared-memory stores to the async proxy (wgmma reads through it), a barrier
// for a subset of the block's warps, and the host's check that a kernel has sm_90a code.
#include <cuda_runtime.h>

#include "cuda/common/check.cuh"

namespace tileattn::cuda::sm90 {

// After ordinary st.shared of an operand that wgmma will read, before the barrier that
// publishes it.
__device__ __forceinline__ void fence_shared_to_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// bar.sync on a named barrier (1..15; 0 is __syncthreads) for `threads` threads of the block.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// True when the device runs sm_90a code of `kernel`: a build without 90a compiles the Hopper
// bodies to nothing, and the device would run those empty sm_80 versions instead.
inline bool has_sm90a_code(const void* kernel) {
  cudaFuncAttributes attr{};
  TA_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  return attr.binaryVersion == 90;
}

}  // namespace tileattn::cuda::sm90
