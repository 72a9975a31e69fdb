#pragma once
// Launch side of the sm80 forward: grid shape, shared-memory opt-in and the split decision.
// Included only by the generated instantiation units.
#include <cuda_runtime.h>

#include "cuda/common/check.cuh"
#include "cuda/forward/combine_fwd_sm80.cuh"
#include "cuda/common/split_heuristic.hpp"
#include "cuda/forward/launch_fwd_sm80.hpp"
#include "cuda/forward/mainloop_fwd_sm80.cuh"
#include "tileattn/error.hpp"

namespace tileattn::cuda {

namespace fwd_sm80_detail {

template <class T, int kHeadDim>
void prepare_kernel() {
  // Above 48 KiB, dynamic shared memory must be opted into per kernel (and per device).
  TA_CUDA_CHECK(cudaFuncSetAttribute(fwd_kernel_sm80<T, kHeadDim>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     FwdTraits<T, kHeadDim>::kSmemBytes));
}

}  // namespace fwd_sm80_detail

template <class T, int kHeadDim>
int FwdSm80<T, kHeadDim>::num_splits(const FwdParams& p) {
  using Traits = FwdTraits<T, kHeadDim>;
  fwd_sm80_detail::prepare_kernel<T, kHeadDim>();
  int device = 0, sms = 0, per_sm = 0;
  TA_CUDA_CHECK(cudaGetDevice(&device));
  TA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  TA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fwd_kernel_sm80<T, kHeadDim>, Traits::kThreads,
                                                              Traits::kSmemBytes));
  const int64_t tiles = int64_t(p.batch) * (p.heads_q / p.pack) * fwd_query_tiles(p, Traits::kBlockM);
  const int key_blocks = (p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
  return fwd_num_splits(tiles, key_blocks, sms, per_sm);
}

template <class T, int kHeadDim>
void FwdSm80<T, kHeadDim>::run(const FwdParams& p, cudaStream_t stream) {
  using Traits = FwdTraits<T, kHeadDim>;
  const int64_t tiles = fwd_query_tiles(p, Traits::kBlockM);
  if (tiles == 0 || p.heads_q == 0 || p.batch == 0) return;
  const dim3 grid = fwd_grid(p, tiles);
  fwd_sm80_detail::prepare_kernel<T, kHeadDim>();
  fwd_kernel_sm80<T, kHeadDim><<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(p);
  TA_CUDA_CHECK_LAUNCH("fwd_kernel_sm80");
  launch_fwd_combine<T>(p, stream);
}

}  // namespace tileattn::cuda

#define TILEATTN_INSTANTIATE_FWD_SM80(T, D) template struct tileattn::cuda::FwdSm80<T, D>;
