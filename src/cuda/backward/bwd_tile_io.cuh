#pragma once
// Moving tiles between global and shared memory, and accumulator fragments out to global.
// Rows and columns beyond the valid extent read as zero, so padded keys, queries and head-dim
// columns add nothing to any product.
#include <cstdint>

#include "cuda/arch/warp_mma_sm80.cuh"
#include "cuda/backward/bwd_traits.cuh"

namespace tileattn::cuda::bwd {

// ROWS x COLS tile from g (row 0, column 0; rows `stride` elements apart) into s (rows LD
// apart). vec: 16-byte asynchronous copies (caller commits and waits); otherwise element loads.
template <class T, int ROWS, int COLS, int LD>
__device__ __forceinline__ void load_tile(T* s, const T* g, int64_t stride, int rows, int cols, bool vec) {
  constexpr int kChunk = 16 / int(sizeof(T));
  constexpr int kChunksPerRow = COLS / kChunk;
  static_assert(COLS % kChunk == 0, "tile rows are whole 16-byte chunks");
  if (vec) {
#pragma unroll
    for (int c = threadIdx.x; c < ROWS * kChunksPerRow; c += kThreads) {
      const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * kChunk;
      const bool valid = r < rows && col < cols;
      cp_async_16(smem_address(s + r * LD + col), valid ? g + r * stride + col : g, valid ? 16 : 0);
    }
  } else {
    for (int e = threadIdx.x; e < ROWS * COLS; e += kThreads) {
      const int r = e / COLS, col = e % COLS;
      s[r * LD + col] = (r < rows && col < cols) ? g[r * stride + col] : from_float<T>(0.0f);
    }
  }
}

// N floats from g into s (16-byte copies; workspace rows are padded, so no bounds).
template <int N>
__device__ __forceinline__ void load_row_floats(float* s, const float* g) {
  for (int c = threadIdx.x; c < N / 4; c += kThreads) cp_async_16(smem_address(s + 4 * c), g + 4 * c, 16);
}

// A warp's accumulator tile times `scale` to global (row 0, column 0 at g), keeping rows < rows
// and columns < cols. kPairs: the two adjacent columns a thread holds go out as one 4-byte store
// (g and stride must keep element pairs 4-byte aligned): half the store instructions, which
// matters for blocks whose main loop is short.
template <class T, int MT, int NT, bool kPairs = false>
__device__ __forceinline__ void store_frag(const float (&acc)[MT][NT][4], float scale, T* g, int64_t stride, int rows,
                                           int cols) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int r = i * 16 + (lane >> 2) + (e >> 1) * 8, c = j * 8 + (lane & 3) * 2;
        if (r >= rows) continue;
        const float x0 = acc[i][j][e] * scale, x1 = acc[i][j][e + 1] * scale;
        if constexpr (kPairs) {
          static_assert(sizeof(T) == 2, "pairs of 16-bit elements");
          if (c + 1 < cols) {
            *reinterpret_cast<uint32_t*>(g + r * stride + c) = pack2<T>(x0, x1);
            continue;
          }
        }
        if (c < cols) g[r * stride + c] = from_float<T>(x0);
        if (c + 1 < cols) g[r * stride + c + 1] = from_float<T>(x1);
      }
}

// store_frag with pairs where the output allows them (BwdParams::pair_grads).
template <class T, int MT, int NT>
__device__ __forceinline__ void store_grad_frag(bool pairs, const float (&acc)[MT][NT][4], float scale, T* g,
                                                int64_t stride, int rows, int cols) {
  if constexpr (sizeof(T) == 2) {
    if (pairs) return store_frag<T, MT, NT, true>(acc, scale, g, stride, rows, cols);
  }
  store_frag<T, MT, NT, false>(acc, scale, g, stride, rows, cols);
}

}  // namespace tileattn::cuda::bwd
