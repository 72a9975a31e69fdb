#pragma once
// The sm90 backward (fp16/bf16, head-dim buckets <= 128): preprocess, dK/dV, dQ. Instantiated per
// (dtype, bucket) by generated translation units (see src/cuda/CMakeLists.txt).
#include <cuda_runtime.h>

#include "cuda/backward/bwd_params_sm90.hpp"
#include "tileattn/problem.hpp"

namespace tileattn::cuda {

template <class T, int kHeadDim>
struct BwdSm90 {
  // Tensor maps of Q, K, V and dO; false when TMA cannot describe one (the sm80 kernels run).
  static bool make_maps(const AttentionProblem& problem, BwdSm90Params& params);
  // params.bwd as for the sm80 kernels, without the dQ accumulator.
  static void run(const BwdSm90Params& params, cudaStream_t stream);
};

// The sm90 backward of fp32 in fast mode (TF32 products; head-dim buckets 32 and 64): preprocess,
// dK/dV, then dQ's own pass. Instantiated per bucket like BwdSm90; the same two entry points.
template <int kHeadDim>
struct BwdTf32Sm90 {
  static bool make_maps(const AttentionProblem& problem, BwdSm90Params& params);
  // params.bwd as for the sm80 kernels, without the dQ accumulator.
  static void run(const BwdSm90Params& params, cudaStream_t stream);
};

}  // namespace tileattn::cuda
