#pragma once
// The sm90 forward, one instantiation per (dtype, head-dim bucket); generated translation
// units as for the sm80 forward (see src/cuda/CMakeLists.txt).
#include <cuda_runtime.h>

#include "cuda/forward/fwd_params_sm90.hpp"
#include "tileattn/problem.hpp"

namespace tileattn::cuda {

template <class T, int kHeadDim>
struct FwdSm90 {
  // Picks the kernel instance (params.block_n, params.consumers) and builds its tensor maps;
  // false when TMA cannot describe an input (the sm80 kernel then runs).
  static bool make_maps(const AttentionProblem& problem, FwdSm90Params& params);
  // Splits of the key range for this problem on the current device (1: no split-KV); after
  // make_maps.
  static int num_splits(const FwdSm90Params& params);
  // Runs the forward (and the combine when params.fwd.num_splits > 1) on `stream`.
  static void run(const FwdSm90Params& params, cudaStream_t stream);
};

}  // namespace tileattn::cuda
