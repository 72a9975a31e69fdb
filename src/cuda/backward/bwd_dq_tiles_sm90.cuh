#pragma once
// The fp32 dQ tiles the Hopper backward kernels add into the workspace accumulator: their order
// inside a tile, and the light kernel that scales them into dQ.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/arch/ptx_sm80.cuh"
#include "cuda/backward/bwd_preprocess.cuh"
#include "cuda/common/bwd_params.hpp"

namespace tileattn::cuda {

// Where element (r, c) of a (kBlockM x kHeadDim) fp32 dQ tile lives in the tile's run of floats:
// the consumer's part (its 64 rows, or its columns), then 8-column group j, then the
// thread of the warpgroup, then the accumulator register -- thread (warp w, g, t) holds rows
// 16 w + g (+ 8) and columns 8 j + 2 t (+ 1) of its part as one float4 per j.
template <int kHeadDim>
struct DqTileOrder {
  static constexpr int kBlockM = kHeadDim <= 64 ? 128 : 64;
  static constexpr bool kSplitRows = kBlockM == 128;
  // Split by columns: 64-column panels up to D = 128 (96 = 64 + 32), 128 columns above
  // (192 = 128 + 64) -- the consumers' shares of dQ, and of dK and dV in the wide kernel.
  static constexpr int kPartCols = kSplitRows ? kHeadDim : kHeadDim > 128 ? 128 : 64;
  static constexpr int kPartFloats = 64 * kPartCols;
  __host__ __device__ static int offset(int r, int c) {
    const int part = kSplitRows ? r / 64 : c / kPartCols, rr = kSplitRows ? r % 64 : r;
    const int cc = kSplitRows ? c : c % kPartCols;
    const int thread = 32 * (rr / 16) + 4 * (rr % 8) + (cc % 8) / 2;
    return part * kPartFloats + ((cc / 8) * 128 + thread) * 4 + 2 * ((rr % 16) / 8) + cc % 2;
  }
};

// dQ = scale * the accumulator, from its tile order, in dQ's dtype and strides: one warp per
// query row, two columns per lane (pairs stay adjacent in the tile order).
template <class T, int kHeadDim>
__global__ void __launch_bounds__(bwd::kRowKernelThreads) convert_dq_tiles_sm90(const bwd::BwdParams p) {
  using Order = DqTileOrder<kHeadDim>;
  int b, h, i;
  if (!bwd::row_of_warp(p, b, h, i)) return;
  const bwd::SeqInfo s = bwd::seq_info(p, b);
  if (i >= s.sq) return;
  const int r = i % Order::kBlockM;
  const float* tile = p.dq_accum + (bwd::ws_row(p, b, h) + i - r) * kHeadDim;
  T* dq = static_cast<T*>(p.dq.ptr) + bwd::seq_base(p, p.dq, b, true) + int64_t(i) * p.dq.seq + int64_t(h) * p.dq.head;
  for (int c = 2 * (int(threadIdx.x) % 32); c < p.headdim_qk; c += 64) {
    const float2 v = *reinterpret_cast<const float2*>(tile + Order::offset(r, c));
    if (p.pair_grads && c + 1 < p.headdim_qk) {
      *reinterpret_cast<uint32_t*>(dq + c) = pack2<T>(v.x * p.scale, v.y * p.scale);
    } else {
      dq[c] = from_float<T>(v.x * p.scale);
      if (c + 1 < p.headdim_qk) dq[c + 1] = from_float<T>(v.y * p.scale);
    }
  }
}

}  // namespace tileattn::cuda
