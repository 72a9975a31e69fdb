#pragma once
// The backward kernels' host entry, per (dtype, head-dim bucket); defined in bwd_launch.cuh and
// instantiated in bwd_inst_*.cu (fp32: src/cuda/fp32/bwd_inst_fp32.cu).
#include <cuda_runtime.h>

#include "cuda/sm80/bwd_params.hpp"

namespace tileattn::cuda::bwd {

// Head dims are padded up to one of these; Q.K and V share the bucket of the larger.
constexpr int kHeadDimBuckets[] = {32, 64, 96, 128, 192, 256};

// Workspace rows per (batch, head) are padded to a multiple of the largest query tile.
constexpr int kWorkspaceRowTile = 128;

template <class T, int D>
void launch_backward(const BwdParams& p, cudaStream_t stream);

}  // namespace tileattn::cuda::bwd
