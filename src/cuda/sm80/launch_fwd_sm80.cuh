#pragma once
// Launch side of the sm80 forward: grid shape, shared-memory opt-in and the split decision.
// Included only by the generated instantiation units.
#include <cuda_runtime.h>

#include "cuda/common/check.cuh"
#include "cuda/sm80/combine_fwd_sm80.cuh"
#include "cuda/sm80/fwd_split_heuristic.hpp"
#include "cuda/sm80/launch_fwd_sm80.hpp"
#include "cuda/sm80/mainloop_fwd_sm80.cuh"
#include "tileattn/error.hpp"

namespace tileattn::cuda {

namespace fwd_sm80_detail {

template <class T, int kHeadDim>
void prepare_kernel() {
  // Above 48 KiB, dynamic shared memory must be opted into per kernel (and per device).
  TA_CUDA_CHECK(cudaFuncSetAttribute(fwd_kernel_sm80<T, kHeadDim>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     FwdTraits<T, kHeadDim>::kSmemBytes));
}

inline int m_blocks(const FwdParams& p, int block_m) { return (p.seqlen_q + block_m - 1) / block_m; }

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
  const int64_t tiles = int64_t(p.batch) * p.heads_q * fwd_sm80_detail::m_blocks(p, Traits::kBlockM);
  const int key_blocks = (p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
  return fwd_num_splits(tiles, key_blocks, sms, per_sm);
}

template <class T, int kHeadDim>
void FwdSm80<T, kHeadDim>::run(const FwdParams& p, cudaStream_t stream) {
  using Traits = FwdTraits<T, kHeadDim>;
  const int64_t grid_x = int64_t(fwd_sm80_detail::m_blocks(p, Traits::kBlockM)) * p.num_splits;
  if (grid_x == 0 || p.heads_q == 0 || p.batch == 0) return;
  if (grid_x > 0x7fffffff || p.heads_q > 65535 || p.batch > 65535)
    throw Error(ErrorKind::unsupported, "CUDA forward: grid too large (query tiles " + std::to_string(grid_x) +
                                            ", heads_q " + std::to_string(p.heads_q) + ", batch " +
                                            std::to_string(p.batch) + "; heads and batch must be <= 65535)");
  fwd_sm80_detail::prepare_kernel<T, kHeadDim>();
  fwd_kernel_sm80<T, kHeadDim><<<dim3(unsigned(grid_x), p.heads_q, p.batch), Traits::kThreads, Traits::kSmemBytes,
                                 stream>>>(p);
  TA_CUDA_CHECK_LAUNCH("fwd_kernel_sm80");
  if (p.num_splits > 1) {
    const int64_t rows = int64_t(p.batch) * p.heads_q * p.seqlen_q;
    const int64_t blocks = (rows + kCombineWarps - 1) / kCombineWarps;
    fwd_combine_kernel<T><<<unsigned(blocks), 32 * kCombineWarps, 0, stream>>>(p);
    TA_CUDA_CHECK_LAUNCH("fwd_combine_kernel");
  }
}

}  // namespace tileattn::cuda

#define TILEATTN_INSTANTIATE_FWD_SM80(T, D) template struct tileattn::cuda::FwdSm80<T, D>;
