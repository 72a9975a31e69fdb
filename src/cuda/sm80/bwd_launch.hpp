#pragma once
// The backward kernels' host entry, per (dtype, head-dim bucket); defined in bwd_launch.cuh and
// instantiated in bwd_inst_*.cu (fp32: src/cuda/fp32/bwd_inst_fp32.cu).
#include <cuda_runtime.h>

#include "cuda/sm80/bwd_params.hpp"

namespace tileattn::cuda::bwd {

// Head dims are padded up to the smallest bucket the build has (src/cuda/CMakeLists.txt defines
// TILEATTN_CUDA_HEADDIM_<d> for each; without any, every bucket is built); Q.K and V share the
// bucket of the larger.
#if !defined(TILEATTN_CUDA_HEADDIMS) || defined(TILEATTN_CUDA_HEADDIM_32)
#define TILEATTN_BWD_HEADDIM_32 1
#else
#define TILEATTN_BWD_HEADDIM_32 0
#endif
#if !defined(TILEATTN_CUDA_HEADDIMS) || defined(TILEATTN_CUDA_HEADDIM_64)
#define TILEATTN_BWD_HEADDIM_64 1
#else
#define TILEATTN_BWD_HEADDIM_64 0
#endif
#if !defined(TILEATTN_CUDA_HEADDIMS) || defined(TILEATTN_CUDA_HEADDIM_96)
#define TILEATTN_BWD_HEADDIM_96 1
#else
#define TILEATTN_BWD_HEADDIM_96 0
#endif
#if !defined(TILEATTN_CUDA_HEADDIMS) || defined(TILEATTN_CUDA_HEADDIM_128)
#define TILEATTN_BWD_HEADDIM_128 1
#else
#define TILEATTN_BWD_HEADDIM_128 0
#endif
#if !defined(TILEATTN_CUDA_HEADDIMS) || defined(TILEATTN_CUDA_HEADDIM_192)
#define TILEATTN_BWD_HEADDIM_192 1
#else
#define TILEATTN_BWD_HEADDIM_192 0
#endif
#if !defined(TILEATTN_CUDA_HEADDIMS) || defined(TILEATTN_CUDA_HEADDIM_256)
#define TILEATTN_BWD_HEADDIM_256 1
#else
#define TILEATTN_BWD_HEADDIM_256 0
#endif
#define TILEATTN_BWD_HAS_HEADDIM(d) TILEATTN_BWD_HEADDIM_##d
constexpr int kHeadDimBuckets[] = {
#if TILEATTN_BWD_HAS_HEADDIM(32)
    32,
#endif
#if TILEATTN_BWD_HAS_HEADDIM(64)
    64,
#endif
#if TILEATTN_BWD_HAS_HEADDIM(96)
    96,
#endif
#if TILEATTN_BWD_HAS_HEADDIM(128)
    128,
#endif
#if TILEATTN_BWD_HAS_HEADDIM(192)
    192,
#endif
#if TILEATTN_BWD_HAS_HEADDIM(256)
    256,
#endif
};

// Workspace rows per (batch, head) are padded to a multiple of the largest query tile.
constexpr int kWorkspaceRowTile = 128;

template <class T, int D>
void launch_backward(const BwdParams& p, cudaStream_t stream);

}  // namespace tileattn::cuda::bwd
