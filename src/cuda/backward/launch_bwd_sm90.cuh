#pragma once
// Launch side of the sm90 backward. Included only by the generated instantiation units.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "cuda/common/check.cuh"
#include "cuda/common/runtime_cache.hpp"
#include "cuda/backward/bwd_preprocess.cuh"
#include "cuda/backward/bwd_dq_tiles_sm90.cuh"
#include "cuda/backward/bwd_kernel_sm90.cuh"
#include "cuda/backward/bwd_kernel_wide_sm90.cuh"
#include "cuda/backward/bwd_dq_kernel_sm90.cuh"
#include "cuda/backward/bwd_dq_kernel_wide_sm90.cuh"
#include "cuda/backward/launch_bwd_sm90.hpp"

namespace tileattn::cuda {

namespace detail {
// The main kernel over (key tiles, batch, kv heads), or kPersistent one block per SM walking them.
template <class T, int kHeadDim, bool kFusedDq, bool kAlibi, bool kPersistent = false>
void launch_bwd_sm90(const BwdSm90Params& params, cudaStream_t stream) {
  using Traits = BwdSm90Traits<T, kHeadDim, kFusedDq>;
  const bwd::BwdParams& p = params.bwd;
  const auto kernel = bwd_kernel_sm90<T, kHeadDim, kFusedDq, kAlibi, kPersistent>;
  allow_dynamic_smem(kernel, Traits::kSmemBytes);
  dim3 grid((p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN, p.batch, p.heads_kv);
  if (grid.x == 0) return;
  if constexpr (kPersistent)
    grid = dim3(unsigned(std::min<int64_t>(BwdUnits(p, Traits::kBlockN).count, device_props().sms)));
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(params);
  TA_CUDA_CHECK_LAUNCH("backward (sm90)");
}

// Blocks that walk several key blocks pay off where a key block's steps are few: every unit the
// same work (one length, no mask but the causal one, which pairs key blocks), the fused dQ in any
// order (the fixed one needs the grid's order of blocks), more units than SMs. H200, bf16, against a block per key block: N = 1k +4-6%, causal +4-7%; 4k -1%,
// causal +2%; 16k -0.4-1%, causal -2.5-4.5% (docs/perf-log.md). So key ranges up to 1024 take the
// walk, causal ones up to 4096: the forward's limits too.
constexpr int kBwdSm90PersistentMaxKeys = 1024;
constexpr int kBwdSm90PersistentCausalMaxKeys = 4096;
inline bool bwd_sm90_persistent(const bwd::BwdParams& p, int block_n) {
  const bool causal = p.window_right == 0 && p.window_left < 0;
  const bool unmasked = p.window_left < 0 && p.window_right < 0;
  const BwdUnits units(p, block_n);
  return p.dq_accum != nullptr && p.dq_order == nullptr && !p.mod.has_alibi() && p.cu_seqlens_q == nullptr &&
         p.cu_seqlens_k == nullptr &&
         (causal || unmasked) &&
         p.seqlen_k <= (causal ? kBwdSm90PersistentCausalMaxKeys : kBwdSm90PersistentMaxKeys) &&
         units.count > device_props().sms && units.count <= INT32_MAX;
}

// The wide kernel (D > 128) over (key tiles, batch, kv heads).
template <class T, int kHeadDim, bool kFusedDq, bool kAlibi>
void launch_bwd_wide_sm90(const BwdSm90Params& params, cudaStream_t stream) {
  using Traits = BwdWideSm90Traits<T, kHeadDim>;
  const bwd::BwdParams& p = params.bwd;
  const auto kernel = bwd_kernel_wide_sm90<T, kHeadDim, kFusedDq, kAlibi>;
  allow_dynamic_smem(kernel, Traits::kSmemBytes);
  const dim3 grid((p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN, p.batch, p.heads_kv);
  if (grid.x == 0) return;
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(params);
  TA_CUDA_CHECK_LAUNCH("backward (sm90, wide head dims)");
}

// dQ's own pass over (query tiles, heads_q, batch): `kernel`, laid out by Traits.
template <class Traits, class Kernel>
void launch_dq_pass_sm90(Kernel kernel, const BwdSm90Params& params, cudaStream_t stream) {
  const bwd::BwdParams& p = params.bwd;
  allow_dynamic_smem(kernel, Traits::kSmemBytes);
  const dim3 grid((p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, p.heads_q, p.batch);
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(params);
  TA_CUDA_CHECK_LAUNCH("backward dQ (sm90)");
}
template <class T, int kHeadDim, bool kAlibi>
void launch_dq_sm90(const BwdSm90Params& params, cudaStream_t stream) {
  if constexpr (kHeadDim > 128)
    launch_dq_pass_sm90<DqWideSm90Traits<T, kHeadDim>>(dq_kernel_wide_sm90<T, kHeadDim, kAlibi>, params, stream);
  else
    launch_dq_pass_sm90<DqSm90Traits<T, kHeadDim>>(dq_kernel_sm90<T, kHeadDim, kAlibi>, params, stream);
}

// The dK/dV kernel and, in the deterministic mode, dQ's pass, with or without ALiBi's bias.
template <class T, int kHeadDim, bool kAlibi>
void launch_main_sm90(const BwdSm90Params& params, cudaStream_t stream) {
  if constexpr (kHeadDim > 128) {
    if (params.bwd.dq_accum != nullptr) {
      launch_bwd_wide_sm90<T, kHeadDim, true, kAlibi>(params, stream);
    } else {
      launch_bwd_wide_sm90<T, kHeadDim, false, kAlibi>(params, stream);
      launch_dq_sm90<T, kHeadDim, kAlibi>(params, stream);
    }
  } else if (params.bwd.dq_accum != nullptr) {
    // The accumulator rows are kHeadDim floats: the workspace is laid out for this bucket.
    if constexpr (!kAlibi) {
      if (bwd_sm90_persistent(params.bwd, BwdSm90Traits<T, kHeadDim, true>::kBlockN)) {
        launch_bwd_sm90<T, kHeadDim, true, false, true>(params, stream);
        return;
      }
    }
    launch_bwd_sm90<T, kHeadDim, true, kAlibi>(params, stream);
  } else {
    launch_bwd_sm90<T, kHeadDim, false, kAlibi>(params, stream);
    launch_dq_sm90<T, kHeadDim, kAlibi>(params, stream);
  }
}
}  // namespace detail

template <class T, int kHeadDim>
int BwdSm90<T, kHeadDim>::ordered_dq_block_n() {
  if constexpr (kHeadDim <= 128) return BwdSm90Traits<T, kHeadDim, true>::kBlockN;
  else return 0;  // the wide kernel: dQ has its own pass
}

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
