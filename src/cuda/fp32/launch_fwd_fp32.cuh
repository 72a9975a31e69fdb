#pragma once
// Launch side of the portable fp32 forward. Included only by the generated instantiation units.
#include <cuda_runtime.h>

#include "cuda/common/check.cuh"
#include "cuda/common/runtime_cache.hpp"
#include "cuda/fp32/forward_fp32_kernel.cuh"
#include "cuda/fp32/launch_fwd_fp32.hpp"

namespace tileattn::cuda::fp32 {

namespace detail {

template <int kD, bool kExact, bool kDropout>
void launch(const FwdParams& params, int64_t batch, int64_t seqlen_q, int64_t heads_q, cudaStream_t stream) {
  using Tile = FwdTile<kD, kExact>;
  const auto kernel = forward_fp32_kernel<kD, kExact, kDropout>;
  const size_t smem = sizeof(float) * Tile::smem_floats();
  allow_dynamic_smem(kernel, int(smem));
  const dim3 grid(unsigned((seqlen_q + Tile::kBlockM - 1) / Tile::kBlockM), unsigned(heads_q), unsigned(batch));
  kernel<<<grid, Tile::kThreads, smem, stream>>>(params);
  TA_CUDA_CHECK_LAUNCH("forward_fp32_kernel");
}

}  // namespace detail

template <int kD>
void FwdFp32<kD>::run(const FwdParams& params, bool exact, int64_t batch, int64_t seqlen_q, int64_t heads_q,
                      cudaStream_t stream) {
  const bool drop = params.dropout.on;
  if (exact) {
    if (drop) detail::launch<kD, true, true>(params, batch, seqlen_q, heads_q, stream);
    else detail::launch<kD, true, false>(params, batch, seqlen_q, heads_q, stream);
  } else {
    if (drop) detail::launch<kD, false, true>(params, batch, seqlen_q, heads_q, stream);
    else detail::launch<kD, false, false>(params, batch, seqlen_q, heads_q, stream);
  }
}

}  // namespace tileattn::cuda::fp32

#define TILEATTN_INSTANTIATE_FWD_FP32(D) template struct tileattn::cuda::fp32::FwdFp32<D>;
