#pragma once
// fp32 attention forward on the GPU. `exact` (the default) multiplies on tensor cores with
// split TF32 (three TF32 products per fp32 product), whose error matches plain fp32 FMA;
// `fast` is a single TF32 product (about 10 mantissa bits per operand).
#include <cstddef>

#include "tileattn/problem.hpp"

namespace tileattn::cuda {

void forward_fp32(const AttentionProblem& problem);
size_t forward_fp32_workspace_size(const AttentionProblem& problem);

}  // namespace tileattn::cuda
