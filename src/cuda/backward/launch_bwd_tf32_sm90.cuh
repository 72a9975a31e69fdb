#pragma once
// Launch side of the TF32 sm90 backward (fp32: fast mode, and exact mode's split TF32). Included
// only by the generated instantiation units.
#include <cuda_runtime.h>

#include "cuda/backward/bwd_dq_kernel_tf32_sm90.cuh"
#include "cuda/backward/bwd_kernel_exact_sm90.cuh"
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

// One exact pass whose rows are queries, over (query tiles, heads, batch).
template <int kHeadDim, ExactPass kPass, bool kAlibi, bool kDropout>
void launch_exact_pass_sm90(const BwdSm90Params& params, cudaStream_t stream) {
  using Traits = BwdExactSm90Traits<kHeadDim, kPass>;
  const bwd::BwdParams& p = params.bwd;
  const auto kernel = bwd_exact_kernel_sm90<kHeadDim, kPass, kAlibi, kDropout>;
  allow_dynamic_smem(kernel, Traits::kSmemBytes);
  constexpr int R = Traits::kBlockRows;
  const dim3 grid((p.seqlen_q + R - 1) / R, p.heads_q, p.batch);
  if (grid.x > 0) kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(params);
}

// The dK pass (kDk) and dV's in one grid (bwd_exact_keys_kernel_sm90), over (key blocks, batch,
// 2 x kv heads); shared memory for the larger of the two.
template <int kHeadDim, ExactPass kDk, bool kAlibi, bool kDropout>
void launch_exact_keys_sm90(const BwdSm90Params& params, cudaStream_t stream) {
  using Dk = BwdExactSm90Traits<kHeadDim, kDk>;
  using Dv = BwdExactSm90Traits<kHeadDim, ExactPass::dv>;
  constexpr int kSmem = Dk::kSmemBytes > Dv::kSmemBytes ? Dk::kSmemBytes : Dv::kSmemBytes;
  const bwd::BwdParams& p = params.bwd;
  const auto kernel = bwd_exact_keys_kernel_sm90<kHeadDim, kDk, kAlibi, kDropout>;
  allow_dynamic_smem(kernel, kSmem);
  const dim3 grid((p.seqlen_k + Dk::kBlockRows - 1) / Dk::kBlockRows, p.batch, 2 * p.heads_kv);
  if (grid.x > 0) kernel<<<grid, Dk::kThreads, kSmem, stream>>>(params);
}

// Whether a query tile may take the statistics pass with D (none with given_stats; all unless
// delta_from_out; with it, those with a row that sees fewer than kDeltaFromOutMinKeys keys, which
// varlen learns per block).
inline bool some_rows_take_d_from_p(const bwd::BwdParams& p) {
  if (p.given_stats) return false;
  if (!p.delta_from_out || p.cu_seqlens_q != nullptr) return true;
  const Mask mask{p.seqlen_q, p.seqlen_k, p.window_left, p.window_right};
  return mask.fewest_visible_keys(0, p.seqlen_q) < bwd::kDeltaFromOutMinKeys;
}

// The statistics unless given (partial_keys: the preprocess wrote P's L, a row sum of 1 and the
// given O's D; each block runs one of the two passes, the other's launch exits at once), then the
// dK and dV passes in one grid, dQ summed in the dK pass where the plan gave the accumulator (the
// preprocess zeroed it), else in a pass of its own after them.
template <int kHeadDim, bool kAlibi, bool kDropout>
void launch_exact_sm90(const BwdSm90Params& params, cudaStream_t stream) {
  const bool sums_dq = BwdTf32Sm90<kHeadDim>::kExactSumsDq && params.bwd.dq_accum != nullptr;
  if (some_rows_take_d_from_p(params.bwd)) {
    launch_exact_pass_sm90<kHeadDim, ExactPass::stats, kAlibi, kDropout>(params, stream);
    TA_CUDA_CHECK_LAUNCH("backward row statistics (exact, sm90)");
  }
  if (params.bwd.delta_from_out) {
    launch_exact_pass_sm90<kHeadDim, ExactPass::max_sum, kAlibi, false>(params, stream);  // undropped
    TA_CUDA_CHECK_LAUNCH("backward row max and sum (exact, sm90)");
  }
  if constexpr (BwdTf32Sm90<kHeadDim>::kExactSumsDq) {
    if (sums_dq) {
      launch_exact_keys_sm90<kHeadDim, ExactPass::dkdq, kAlibi, kDropout>(params, stream);
      TA_CUDA_CHECK_LAUNCH("backward dK, dQ and dV (exact, sm90)");
    }
  }
  if (!sums_dq) {
    launch_exact_keys_sm90<kHeadDim, ExactPass::dk, kAlibi, kDropout>(params, stream);
    TA_CUDA_CHECK_LAUNCH("backward dK and dV (exact, sm90)");
  }
  if (sums_dq) {
    bwd::launch_convert_dq<float>(params.bwd, stream);
    TA_CUDA_CHECK_LAUNCH("backward dQ conversion (exact, sm90)");
  } else {
    launch_exact_pass_sm90<kHeadDim, ExactPass::dq, kAlibi, kDropout>(params, stream);
    TA_CUDA_CHECK_LAUNCH("backward dQ (exact, sm90)");
  }
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

template <int kHeadDim>
void BwdTf32Sm90<kHeadDim>::run_exact(const BwdSm90Params& params, cudaStream_t stream) {
  const bwd::BwdParams& p = params.bwd;
  if (!bwd_sm90_has_work(p)) return;
  bwd::launch_preprocess<float>(p, stream);  // L (or +inf), row sum 1 and D (0 or O's) per row: the statistics' start
  TA_CUDA_CHECK_LAUNCH("backward preprocess");
  // ALiBi and dropout: kernel instances of their own, so that the others keep their registers.
  if (p.mod.has_alibi()) {
    if (p.dropout.on) detail::launch_exact_sm90<kHeadDim, true, true>(params, stream);
    else detail::launch_exact_sm90<kHeadDim, true, false>(params, stream);
  } else {
    if (p.dropout.on) detail::launch_exact_sm90<kHeadDim, false, true>(params, stream);
    else detail::launch_exact_sm90<kHeadDim, false, false>(params, stream);
  }
}

}  // namespace tileattn::cuda

#define TILEATTN_INSTANTIATE_BWD_TF32_SM90(D) template struct tileattn::cuda::BwdTf32Sm90<D>;
