#pragma once
// Launch side of the sm90 forward: tensor maps, grid shape, shared-memory opt-in, split decision.
// Included only by the generated instantiation units.
#include <cuda_runtime.h>

#include <string>

#include "cuda/common/check.cuh"
#include "cuda/sm80/combine_fwd_sm80.cuh"
#include "cuda/sm80/fwd_split_heuristic.hpp"
#include "cuda/sm90/fwd_kernel_sm90.cuh"
#include "cuda/sm90/launch_fwd_sm90.hpp"
#include "cuda/sm90/tma_map.hpp"
#include "tileattn/error.hpp"

namespace tileattn::cuda {

namespace fwd_sm90_detail {

template <class T, int kHeadDim>
void prepare_kernel() {
  TA_CUDA_CHECK(cudaFuncSetAttribute(fwd_kernel_sm90<T, kHeadDim>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     FwdSm90Traits<T, kHeadDim>::kSmemBytes));
}

}  // namespace fwd_sm90_detail

template <class T, int kHeadDim>
int FwdSm90<T, kHeadDim>::num_splits(const FwdParams& p) {
  using Traits = FwdSm90Traits<T, kHeadDim>;
  int device = 0, sms = 0;
  TA_CUDA_CHECK(cudaGetDevice(&device));
  TA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t tiles = int64_t(p.batch) * p.heads_q * fwd_query_tiles(p, Traits::kBlockM);
  const int key_blocks = (p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
  return fwd_num_splits(tiles, key_blocks, sms, 1);  // one block per SM (launch bounds)
}

template <class T, int kHeadDim>
bool FwdSm90<T, kHeadDim>::make_maps(const AttentionProblem& pr, FwdSm90Params& params) {
  using Traits = FwdSm90Traits<T, kHeadDim>;
  using sm90::attention_map_shape;
  return sm90::make_tile_map(&params.q, pr.dtype, pr.q.data,
                             attention_map_shape(pr, pr.q, pr.headdim_qk, pr.seqlen_q, pr.total_q, pr.heads_q, Traits::kBlockM)) &&
         sm90::make_tile_map(&params.k, pr.dtype, pr.k.data,
                             attention_map_shape(pr, pr.k, pr.headdim_qk, pr.seqlen_k, pr.total_k, pr.heads_kv, Traits::kBlockN)) &&
         sm90::make_tile_map(&params.v, pr.dtype, pr.v.data,
                             attention_map_shape(pr, pr.v, pr.headdim_v, pr.seqlen_k, pr.total_k, pr.heads_kv, Traits::kBlockN));
}

template <class T, int kHeadDim>
void FwdSm90<T, kHeadDim>::run(const FwdSm90Params& params, cudaStream_t stream) {
  using Traits = FwdSm90Traits<T, kHeadDim>;
  const FwdParams& p = params.fwd;
  const int64_t tiles = fwd_query_tiles(p, Traits::kBlockM);
  if (tiles == 0 || p.heads_q == 0 || p.batch == 0) return;
  const dim3 grid = fwd_grid(p, tiles);
  fwd_sm90_detail::prepare_kernel<T, kHeadDim>();
  fwd_kernel_sm90<T, kHeadDim><<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(params);
  TA_CUDA_CHECK_LAUNCH("fwd_kernel_sm90");
  launch_fwd_combine<T>(p, stream);
}

}  // namespace tileattn::cuda

#define TILEATTN_INSTANTIATE_FWD_SM90(T, D) template struct tileattn::cuda::FwdSm90<T, D>;
