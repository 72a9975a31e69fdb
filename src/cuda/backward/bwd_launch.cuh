#pragma once
// Host side of one backward: preprocess (and the row statistics: exact fp32 without partial_keys,
// 16-bit where consistent_delta), dK/dV (with atomic dQ, or not), then the dQ conversion or dQ's
// own pass. Instantiated per (dtype, head-dim bucket) by the units src/cuda/CMakeLists.txt generates.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "cuda/common/check.cuh"
#include "cuda/common/runtime_cache.hpp"
#include "cuda/backward/bwd_row_stats.cuh"
#include "cuda/backward/bwd_dkdv_kernel.cuh"
#include "cuda/backward/bwd_dq_kernel.cuh"
#include "cuda/backward/bwd_launch.hpp"
#include "cuda/common/bwd_params.hpp"
#include "cuda/backward/bwd_preprocess.cuh"
#include "cuda/backward/bwd_traits.cuh"
#include "tileattn/error.hpp"

namespace tileattn::cuda::bwd {

// Everything after the preprocess: the row statistics (fp32, or 16-bit's D where asked), dK/dV,
// then dQ's conversion or pass.
template <class T, int D, Fp32Math M>
void launch_passes(const BwdParams& p, cudaStream_t stream) {
  using KV = DkdvTile<T, D>;
  launch_row_stats<T, D, M>(p, stream);

  const int kv_smem = KV::smem_bytes(p.dkdv_stages);
  allow_dynamic_smem(dkdv_kernel<T, D, M>, kv_smem);
  const dim3 kv_grid((p.seqlen_k + KV::kBlockN - 1) / KV::kBlockN, p.batch, p.heads_kv);
  dkdv_kernel<T, D, M><<<kv_grid, kThreads, kv_smem, stream>>>(p);
  TA_CUDA_CHECK_LAUNCH("backward dK/dV");

  if (p.dq_accum != nullptr) {
    launch_convert_dq<T>(p, stream);
    TA_CUDA_CHECK_LAUNCH("backward dQ conversion");
  } else {
    using Q = DqTile<T, D>;
    const int q_smem = Q::smem_bytes(p.dq_stages);
    allow_dynamic_smem(dq_kernel<T, D, M>, q_smem);
    const dim3 q_grid((p.seqlen_q + Q::kBlockM - 1) / Q::kBlockM, p.batch, p.heads_q);
    dq_kernel<T, D, M><<<q_grid, kThreads, q_smem, stream>>>(p);
    TA_CUDA_CHECK_LAUNCH("backward dQ");
  }
}

template <class T, int D>
void launch_backward(const BwdParams& params, cudaStream_t stream) {
  using KV = DkdvTile<T, D>;
  const int smem_optin = device_props().smem_optin;
  BwdParams p = params;
  p.dkdv_stages = KV::smem_bytes(2) <= smem_optin ? 2 : 1;
  p.dq_stages = DqTile<T, D>::smem_bytes(2) <= smem_optin ? 2 : 1;
  const int needed = std::max(KV::smem_bytes(1), p.dq_accum != nullptr ? 0 : DqTile<T, D>::smem_bytes(1));
  if (needed > smem_optin)
    throw Error(ErrorKind::unsupported, "the CUDA backward for head dims up to " + std::to_string(D) + " needs " +
                                            std::to_string(needed) + " bytes of shared memory per block; this device " +
                                            "allows " + std::to_string(smem_optin));

  static_assert(kWorkspaceRowTile % DkdvTile<T, D>::kBlockM == 0 && kWorkspaceRowTile % DqTile<T, D>::kBlockM == 0,
                "query tiles never reach past the workspace padding");
  launch_preprocess<T>(p, stream);
  TA_CUDA_CHECK_LAUNCH("backward preprocess");
  if constexpr (std::is_same_v<T, float>) {
    if (p.fp32_fast) launch_passes<T, D, Fp32Math::tf32>(p, stream);
    else launch_passes<T, D, Fp32Math::fp64>(p, stream);
  } else {
    launch_passes<T, D, Fp32Math::fp64>(p, stream);
  }
}

template <class T, int D>
void launch_consistent_delta(const BwdParams& p, cudaStream_t stream) {
  static_assert(!std::is_same_v<T, float>, "fp32 forms D in its row-statistics pass");
  launch_row_stats<T, D>(p, stream);
}

}  // namespace tileattn::cuda::bwd

#define TILEATTN_INSTANTIATE_BWD_SM80(T, D) \
  template void tileattn::cuda::bwd::launch_backward<T, D>(const tileattn::cuda::bwd::BwdParams&, cudaStream_t);
// 16-bit only.
#define TILEATTN_INSTANTIATE_CONSISTENT_DELTA(T, D) \
  template void tileattn::cuda::bwd::launch_consistent_delta<T, D>(const tileattn::cuda::bwd::BwdParams&, cudaStream_t);
