#pragma once
// Launch side of the TF32 sm90 backward (fp32, fast mode). Included only by the generated
// instantiation units.
#include <cuda_runtime.h>

#include "cuda/backward/bwd_dq_kernel_tf32_sm90.cuh"
#include "cuda/backward/bwd_kernel_tf32_sm90.cuh"
#include "cuda/backward/bwd_preprocess.cuh"
#include "cuda/backward/launch_bwd_sm90.hpp"
#include "cuda/common/check.cuh"
#include "cuda/common/runtime_cache.hpp"

namespace tileattn::cuda {

namespace detail {
template <int kHeadDim, bool kAlibi>
void launch_tf32_sm90(const BwdSm90Params& params, cudaStream_t stream) {
  const bwd::BwdParams& p = params.bwd;
  {
    using Traits = BwdTf32Sm90Traits<kHeadDim>;
    const auto kernel = bwd_kernel_tf32_sm90<kHeadDim, kAlibi>;
    allow_dynamic_smem(kernel, Traits::kSmemBytes);
    const dim3 grid((p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN, p.batch, p.heads_kv);
    if (grid.x > 0) {
      kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(params);
      TA_CUDA_CHECK_LAUNCH("backward dK/dV (TF32, sm90)");
    }
  }
  using Traits = DqTf32Sm90Traits<kHeadDim>;
  const auto kernel = dq_kernel_tf32_sm90<kHeadDim, kAlibi>;
  allow_dynamic_smem(kernel, Traits::kSmemBytes);
  const dim3 grid((p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, p.heads_q, p.batch);
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(params);
  TA_CUDA_CHECK_LAUNCH("backward dQ (TF32, sm90)");
}
}  // namespace detail

template <int kHeadDim>
void BwdTf32Sm90<kHeadDim>::run(const BwdSm90Params& params, cudaStream_t stream) {
  const bwd::BwdParams& p = params.bwd;
  if (!bwd_sm90_has_work(p)) return;
  bwd::launch_preprocess<float>(p, stream);
  TA_CUDA_CHECK_LAUNCH("backward preprocess");
  if (p.mod.has_alibi()) detail::launch_tf32_sm90<kHeadDim, true>(params, stream);
  else detail::launch_tf32_sm90<kHeadDim, false>(params, stream);
}

}  // namespace tileattn::cuda

#define TILEATTN_INSTANTIATE_BWD_TF32_SM90(D) template struct tileattn::cuda::BwdTf32Sm90<D>;
