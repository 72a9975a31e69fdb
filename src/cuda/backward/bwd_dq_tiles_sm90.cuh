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

// dQ = scale * the accumulator, from its tile order, in dQ's dtype and strides: a block of 128
// threads per part of a tile (64 rows), each reading the float4s a consumer thread wrote, in the
// order it wrote them (whole 512-byte runs per warp), and placing their rounded pairs in shared
// memory, from where whole rows go out (128 contiguous bytes per warp store). Measured: a warp
// per row reading its pairs from across the tile ran at 44-64% of the card's bandwidth; pairs
// stored straight from the tile order (16 rows a warp store), at 40%.
template <class T, int kHeadDim>
__global__ void __launch_bounds__(128) convert_dq_tiles_sm90(const bwd::BwdParams p) {
  using Order = DqTileOrder<kHeadDim>;
  constexpr int kGroups = Order::kPartCols / 8;          // float4s a thread holds
  constexpr int kStride = Order::kPartCols / 2 + 4;     // words a staged row; + 4: rows g of a warp on distinct banks
  __shared__ uint32_t staged[64 * kStride];
  const int part = int(blockIdx.y), t = int(threadIdx.x);
  const int64_t row0 = int64_t(blockIdx.x) * Order::kBlockM;  // the tile's first workspace row
  const int i0 = int(row0 % p.seqlen_q_rounded);             // tiles never straddle (b, h)
  const int64_t bh = row0 / p.seqlen_q_rounded;
  const int h = int(bh % p.heads_q), b = int(bh / p.heads_q);
  const int part_cols = Order::kSplitRows ? kHeadDim : min(Order::kPartCols, kHeadDim - Order::kPartCols * part);
  const float4* src = reinterpret_cast<const float4*>(p.dq_accum + row0 * kHeadDim + part * Order::kPartFloats) + t;

  // Every load before the first store: dQ might alias the accumulator for all the compiler knows.
  float4 v[kGroups];
#pragma unroll
  for (int j = 0; j < kGroups; ++j)
    if (j < part_cols / 8) v[j] = src[j * 128];
  // Thread t holds rows 16 (t / 32) + (t % 32) / 4 (+ 8) and columns 8 j + 2 (t % 4) (+ 1) of its part.
  const int rr = 16 * (t / 32) + (t % 32) / 4, pair = t % 4;
#pragma unroll
  for (int j = 0; j < kGroups; ++j) {
    if (j >= part_cols / 8) break;
    staged[rr * kStride + 4 * j + pair] = pack2<T>(v[j].x * p.scale, v[j].y * p.scale);
    staged[(rr + 8) * kStride + 4 * j + pair] = pack2<T>(v[j].z * p.scale, v[j].w * p.scale);
  }
  __syncthreads();

  const bwd::SeqInfo s = bwd::seq_info(p, b);
  const int r0 = Order::kSplitRows ? 64 * part : 0, c0 = Order::kSplitRows ? 0 : Order::kPartCols * part;
  T* dq = static_cast<T*>(p.dq.ptr) + bwd::seq_base(p, p.dq, b, true) + int64_t(h) * p.dq.head;
  const int pairs = part_cols / 2;
  for (int x = t; x < 64 * pairs; x += 128) {
    const int r = x / pairs, c = c0 + 2 * (x % pairs), i = i0 + r0 + r;
    if (i >= s.sq || c >= p.headdim_qk) continue;
    T* at = dq + int64_t(i) * p.dq.seq + c;
    const uint32_t w = staged[r * kStride + x % pairs];
    if (p.pair_grads && c + 1 < p.headdim_qk) {
      *reinterpret_cast<uint32_t*>(at) = w;
    } else {
      const T* two = reinterpret_cast<const T*>(&w);
      at[0] = two[0];
      if (c + 1 < p.headdim_qk) at[1] = two[1];
    }
  }
}

template <class T, int kHeadDim>
void launch_convert_dq_tiles_sm90(const bwd::BwdParams& p, cudaStream_t stream) {
  using Order = DqTileOrder<kHeadDim>;
  const int64_t tiles = int64_t(p.batch) * p.heads_q * p.seqlen_q_rounded / Order::kBlockM;
  constexpr int kParts = Order::kSplitRows ? 2 : (kHeadDim + Order::kPartCols - 1) / Order::kPartCols;
  const dim3 grid(unsigned(tiles), kParts);
  convert_dq_tiles_sm90<T, kHeadDim><<<grid, 128, 0, stream>>>(p);
}

}  // namespace tileattn::cuda
