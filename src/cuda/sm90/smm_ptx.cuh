#pragma once
// What the Hopper softmax(X) @ V and fp32 attention kernels need beyond ptx_sm90.cuh: a fence
// that hands plain shared-memory stores to the async proxy (wgmma reads through it), and a barrier
// for a subset of the block's warps.
#include <cuda_runtime.h>

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

}  // namespace tileattn::cuda::sm90
