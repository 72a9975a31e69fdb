#pragma once
// Launch side of the Hopper fp32 forward (fast and exact mode). Included only by the generated
// instantiation units.
#include <cuda_runtime.h>

#include "cuda/arch/hopper_available.hpp"
#include "cuda/arch/tma_map.hpp"
#include "cuda/common/check.cuh"
#include "cuda/common/runtime_cache.hpp"
#include "cuda/fp32/fwd_kernel_fp32_sm90.cuh"
#include "cuda/fp32/launch_fwd_fp32.hpp"

namespace tileattn::cuda::fp32 {

namespace detail {

template <int kD, bool kExact>
bool launch_sm90(const AttentionProblem& pr, const FwdParams& params, cudaStream_t stream) {
  using sm90::attention_map_shape;
  using Tile = FwdSm90Tile<kD, kExact>;
  const auto kernel = pr.alibi_slopes != nullptr ? forward_fp32_kernel_sm90<kD, kExact, true>
                                                 : forward_fp32_kernel_sm90<kD, kExact, false>;
  if (!sm90::has_sm90a_code(reinterpret_cast<const void*>(kernel))) return false;
  FwdSm90Params p{};
  p.fwd = params;
  if (!sm90::make_tile_map(&p.q, DType::f32, pr.q.data,
                           attention_map_shape(pr, pr.q, pr.headdim_qk, pr.seqlen_q, pr.total_q, pr.heads_q, Tile::kBlockM)) ||
      !sm90::make_tile_map(&p.k, DType::f32, pr.k.data,
                           attention_map_shape(pr, pr.k, pr.headdim_qk, pr.seqlen_k, pr.total_k, pr.heads_kv, Tile::kBlockN)) ||
      !sm90::make_tile_map(&p.v, DType::f32, pr.v.data,
                           attention_map_shape(pr, pr.v, pr.headdim_v, pr.seqlen_k, pr.total_k, pr.heads_kv, Tile::kBlockN)))
    return false;
  allow_dynamic_smem(kernel, Tile::kSmemBytes);
  const dim3 grid(unsigned((pr.seqlen_q + Tile::kBlockM - 1) / Tile::kBlockM), unsigned(pr.heads_q),
                  unsigned(pr.batch));
  kernel<<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(p);
  TA_CUDA_CHECK_LAUNCH("forward_fp32_kernel_sm90");
  return true;
}

}  // namespace detail

template <int kD>
bool FwdFp32Sm90<kD>::run(const AttentionProblem& pr, const FwdParams& params, cudaStream_t stream) {
  // No dropout in this kernel: the portable fp32 forward takes those problems. Dropout here would
  // need the Philox draws in consumers whose registers are already fixed by setmaxnreg (232 at
  // head dim 64); as in the 16-bit Hopper forward, it is left to the portable kernel (TF32 there
  // too in fast mode).
  if (pr.dropout_p > 0.0f) return false;
  if (pr.fp32_mode == Fp32Mode::fast) return detail::launch_sm90<kD, false>(pr, params, stream);
  if constexpr (kD <= 64) return detail::launch_sm90<kD, true>(pr, params, stream);
  return false;  // exact mode above head dim 64: the portable kernel's fp64 products
}

}  // namespace tileattn::cuda::fp32

#define TILEATTN_INSTANTIATE_FWD_FP32_SM90(D) template struct tileattn::cuda::fp32::FwdFp32Sm90<D>;
