#pragma once
// fp32 attention forward on the GPU. `exact` (the default) multiplies on fp64 tensor cores, so
// its error stays below that of a plain fp32 FMA loop; `fast` is a single TF32 product (about
// 11 significant bits per operand).
#include <cstddef>

#include "tileattn/problem.hpp"

namespace tileattn::cuda {

// For a problem with work to do (the plan in backend.cu skips empty ones).
void forward_fp32(const AttentionProblem& problem);

}  // namespace tileattn::cuda
