#pragma once
// The sm80 forward, one instantiation per (dtype, head-dim bucket); the build generates one
// translation unit per pair in TILEATTN_HEADDIMS (see src/cuda/CMakeLists.txt).
#include <cuda_runtime.h>

#include "cuda/common/fwd_params.hpp"

namespace tileattn::cuda {

template <class T, int kHeadDim>
struct FwdSm80 {
  // Splits of the key range for this problem on the current device (1: no split-KV).
  static int num_splits(const FwdParams& params);
  // Runs the forward (and the combine when params.num_splits > 1) on `stream`.
  static void run(const FwdParams& params, cudaStream_t stream);
};

}  // namespace tileattn::cuda
