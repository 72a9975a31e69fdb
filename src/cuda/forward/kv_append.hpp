#pragma once
// Appending to a key/value cache on the GPU (problem.hpp's k_new, v_new and rotary fields), run
// on the forward's stream before the attention kernels.
#include <cuda_runtime.h>

#include "tileattn/problem.hpp"

namespace tileattn::cuda {

// Writes k_new and v_new into the cache (the new keys rotated when the problem has rotary) and,
// with rotary, q's rotated copy at `rotated_q` (common/kv_append.hpp's rotated_q_view). One kernel.
void launch_kv_append(const AttentionProblem& p, void* rotated_q, cudaStream_t stream);

}  // namespace tileattn::cuda
