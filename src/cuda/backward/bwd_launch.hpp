#pragma once
// The portable backward kernels' host entry, per (dtype, head-dim bucket): defined in
// bwd_launch.cuh, instantiated by the units src/cuda/CMakeLists.txt generates (fp32 included).
#include <cuda_runtime.h>

#include "cuda/common/bwd_params.hpp"

namespace tileattn::cuda::bwd {

// Workspace rows per (batch, head) are padded to a multiple of the largest query tile.
constexpr int kWorkspaceRowTile = 128;

template <class T, int D>
void launch_backward(const BwdParams& p, cudaStream_t stream);

// 16-bit: D from P and dP where p.consistent_delta (bwd_row_stats.cuh), for the Hopper backward
// too, which calls it between its preprocess and its main kernel; the portable units instantiate it.
template <class T, int D>
void launch_consistent_delta(const BwdParams& p, cudaStream_t stream);

}  // namespace tileattn::cuda::bwd
