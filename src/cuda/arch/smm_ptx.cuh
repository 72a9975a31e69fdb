#pragma once
// What the Hopper softmax(X) @ V and fp32 attention kernels need beyond ptx_sm90.cuh: the
// 4 x 4 register transpose of their V rewrites.
#include <cuda_runtime.h>

#include "cuda/arch/ptx_sm90.cuh"

namespace tileattn::cuda::sm90 {

// Column j of the 4 x 4 block whose rows are in[0..3]: the j-th lane of each.
__device__ __forceinline__ float4 column_of(const float4 (&in)[4], int j) {
  return j == 0   ? make_float4(in[0].x, in[1].x, in[2].x, in[3].x)
         : j == 1 ? make_float4(in[0].y, in[1].y, in[2].y, in[3].y)
         : j == 2 ? make_float4(in[0].z, in[1].z, in[2].z, in[3].z)
                  : make_float4(in[0].w, in[1].w, in[2].w, in[3].w);
}

}  // namespace tileattn::cuda::sm90
