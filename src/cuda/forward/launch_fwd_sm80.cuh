#pragma once
// Launch side of the sm80 forward: grid shape, shared-memory opt-in and the split decision.
// Included only by the generated instantiation units.
#include <cuda_runtime.h>

#include "cuda/common/check.cuh"
#include "cuda/common/runtime_cache.hpp"
#include "cuda/forward/combine_fwd_sm80.cuh"
#include "cuda/forward/decode_fwd_sm80.cuh"
#include "cuda/common/split_heuristic.hpp"
#include "cuda/forward/launch_fwd_sm80.hpp"
#include "cuda/forward/mainloop_fwd_sm80.cuh"
#include "tileattn/error.hpp"

namespace tileattn::cuda {

namespace fwd_sm80_detail {

// The kernel a problem runs on, with what its launch and split decision need.
struct Kernel {
  const void* fn;
  int threads, smem_bytes, block_m, block_n;
  bool decode;
};

template <class T, int kHeadDim, DecodeGather kGather>
const void* decode_fn() {
  return reinterpret_cast<const void*>(fwd_decode_kernel_sm80<T, kHeadDim, kGather>);
}

template <class T, int kHeadDim>
const void* decode_kernel(DecodeGather gather) {
  switch (gather) {
    case DecodeGather::tiles: return decode_fn<T, kHeadDim, DecodeGather::tiles>();
    case DecodeGather::warps: return decode_fn<T, kHeadDim, DecodeGather::warps>();
    case DecodeGather::rows: break;
  }
  return decode_fn<T, kHeadDim, DecodeGather::rows>();
}

template <class T, int kHeadDim>
Kernel pick(const FwdParams& p) {
  using Decode = DecodeTraits<T, kHeadDim>;
  using Traits = FwdTraits<T, kHeadDim>;
  // At most 16 (packed) query rows: the decode kernel, where its ring fits the device.
  if (int64_t(p.seqlen_q) * p.pack <= Decode::kBlockM) {
    if (Decode::kSmemBytes <= device_props().smem_optin)
      return {decode_kernel<T, kHeadDim>(decode_gather(p.keys, Decode::kBlockN)), Decode::kThreads,
              Decode::kSmemBytes, Decode::kBlockM, Decode::kBlockN, true};
  }
  const void* fn = p.dropout.on ? reinterpret_cast<const void*>(fwd_kernel_sm80<T, kHeadDim, true>)
                                : reinterpret_cast<const void*>(fwd_kernel_sm80<T, kHeadDim, false>);
  return {fn, Traits::kThreads, Traits::kSmemBytes, Traits::kBlockM, Traits::kBlockN, false};
}

inline void prepare(const Kernel& k) {
  // Above 48 KiB, dynamic shared memory must be opted into per kernel (and per device).
  allow_dynamic_smem(k.fn, k.smem_bytes);
}

}  // namespace fwd_sm80_detail

template <class T, int kHeadDim>
int FwdSm80<T, kHeadDim>::num_splits(const FwdParams& p) {
  const fwd_sm80_detail::Kernel k = fwd_sm80_detail::pick<T, kHeadDim>(p);
  fwd_sm80_detail::prepare(k);
  const int sms = device_props().sms;
  int per_sm = 0;
  TA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k.fn, k.threads, k.smem_bytes));
  const int64_t tiles = int64_t(p.batch) * (p.heads_q / p.pack) * fwd_query_tiles(p, k.block_m);
  const int key_blocks = (p.seqlen_k + k.block_n - 1) / k.block_n;
  if (k.decode) {
    // A paged cache costs each block more latency per byte (a page-table read per tile or row,
    // pages scattered over the address space), which one block per SM does not hide: two blocks
    // per SM where they fit. A contiguous cache reads the same with one or two (docs/perf-log.md).
    const int blocks_per_sm = p.keys.paged() ? std::min(per_sm, 2) : 1;
    return decode_num_splits(tiles, key_blocks, sms * std::max(blocks_per_sm, 1));
  }
  return fwd_num_splits(tiles, key_blocks, sms, per_sm);
}

template <class T, int kHeadDim>
void FwdSm80<T, kHeadDim>::run(const FwdParams& p, cudaStream_t stream) {
  const fwd_sm80_detail::Kernel k = fwd_sm80_detail::pick<T, kHeadDim>(p);
  const int64_t tiles = fwd_query_tiles(p, k.block_m);
  if (tiles == 0 || p.heads_q == 0 || p.batch == 0) return;
  const dim3 grid = fwd_grid(p, tiles);
  fwd_sm80_detail::prepare(k);
  void* args[] = {const_cast<FwdParams*>(&p)};
  TA_CUDA_CHECK(cudaLaunchKernel(k.fn, grid, dim3(unsigned(k.threads)), args, size_t(k.smem_bytes), stream));
  launch_fwd_combine<T>(p, stream);
}

}  // namespace tileattn::cuda

#define TILEATTN_INSTANTIATE_FWD_SM80(T, D) template struct tileattn::cuda::FwdSm80<T, D>;
