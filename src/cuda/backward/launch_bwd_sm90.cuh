#pragma once
// Launch side of the sm90 backward. Included only by the generated instantiation units.
#include <cuda_runtime.h>

#include "cuda/common/check.cuh"
#include "cuda/common/runtime_cache.hpp"
#include "cuda/backward/bwd_preprocess.cuh"
#include "cuda/backward/bwd_dq_tiles_sm90.cuh"
#include "cuda/backward/bwd_kernel_sm90.cuh"
#include "cuda/backward/bwd_kernel_wide_sm90.cuh"
#include "cuda/backward/bwd_dq_kernel_sm90.cuh"
#include "cuda/backward/launch_bwd_sm90.hpp"

namespace tileattn::cuda {

namespace detail {
// The main kernel over (key tiles, batch, kv heads).
template <class T, int kHeadDim, bool kFusedDq, bool kAlibi>
void launch_bwd_sm90(const BwdSm90Params& params, cudaStream_t stream) {
  using Traits = BwdSm90Traits<T, kHeadDim, kFusedDq>;
  const bwd::BwdParams& p = params.bwd;
  const auto kernel = bwd_kernel_sm90<T, kHeadDim, kFusedDq, kAlibi>;
  allow_dynamic_smem(kernel, Traits::kSmemBytes);
  const dim3 grid((p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN, p.batch, p.heads_kv);
  if (grid.x == 0) return;
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(params);
  TA_CUDA_CHECK_LAUNCH("backward (sm90)");
}

// The wide kernel (D > 128) over (key tiles, batch, kv heads).
template <class T, int kHeadDim, bool kAlibi>
void launch_bwd_wide_sm90(const BwdSm90Params& params, cudaStream_t stream) {
  using Traits = BwdWideSm90Traits<T, kHeadDim>;
  const bwd::BwdParams& p = params.bwd;
  const auto kernel = bwd_kernel_wide_sm90<T, kHeadDim, kAlibi>;
  allow_dynamic_smem(kernel, Traits::kSmemBytes);
  const dim3 grid((p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN, p.batch, p.heads_kv);
  if (grid.x == 0) return;
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(params);
  TA_CUDA_CHECK_LAUNCH("backward (sm90, wide head dims)");
}

// dQ's own pass over (query tiles, heads_q, batch).
template <class T, int kHeadDim, bool kAlibi>
void launch_dq_sm90(const BwdSm90Params& params, cudaStream_t stream) {
  using Traits = DqSm90Traits<T, kHeadDim>;
  const bwd::BwdParams& p = params.bwd;
  const auto kernel = dq_kernel_sm90<T, kHeadDim, kAlibi>;
  allow_dynamic_smem(kernel, Traits::kSmemBytes);
  const dim3 grid((p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, p.heads_q, p.batch);
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(params);
  TA_CUDA_CHECK_LAUNCH("backward dQ (sm90)");
}

// The dK/dV kernel and, in the deterministic mode, dQ's pass, with or without ALiBi's bias.
template <class T, int kHeadDim, bool kAlibi>
void launch_main_sm90(const BwdSm90Params& params, cudaStream_t stream) {
  if constexpr (kHeadDim > 128) {
    // Only the summed dQ exists here (the planner sends deterministic calls to the portable kernels).
    launch_bwd_wide_sm90<T, kHeadDim, kAlibi>(params, stream);
  } else if (params.bwd.dq_accum != nullptr) {
    // The accumulator rows are kHeadDim floats: the workspace is laid out for this bucket.
    launch_bwd_sm90<T, kHeadDim, true, kAlibi>(params, stream);
  } else {
    launch_bwd_sm90<T, kHeadDim, false, kAlibi>(params, stream);
    launch_dq_sm90<T, kHeadDim, kAlibi>(params, stream);
  }
}
}  // namespace detail

template <class T, int kHeadDim>
void BwdSm90<T, kHeadDim>::run(const BwdSm90Params& params, cudaStream_t stream) {
  const bwd::BwdParams& p = params.bwd;
  if (!bwd_sm90_has_work(p)) return;

  bwd::launch_preprocess<T>(p, stream);
  TA_CUDA_CHECK_LAUNCH("backward preprocess");
  bwd::launch_consistent_delta<T, kHeadDim>(p, stream);

  if (p.mod.has_alibi()) detail::launch_main_sm90<T, kHeadDim, true>(params, stream);
  else detail::launch_main_sm90<T, kHeadDim, false>(params, stream);
  if (p.dq_accum == nullptr) return;  // dQ had its own pass
  launch_convert_dq_tiles_sm90<T, kHeadDim>(p, stream);
  TA_CUDA_CHECK_LAUNCH("backward dQ convert");
}

}  // namespace tileattn::cuda

#define TILEATTN_INSTANTIATE_BWD_SM90(T, D) template struct tileattn::cuda::BwdSm90<T, D>;
