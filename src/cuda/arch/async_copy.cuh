#pragma once
// Global -> shared tile copies with cp.async (sm_80+), zero-filling whatever lies outside the
// source matrix so that padded rows and columns contribute exact zeros to the products.
#include <cstdint>

#include "cuda/arch/ptx_sm80.cuh"

namespace tileattn::cuda::fp32 {

// 4-byte copy for rows that are not 16-byte aligned; an invalid one writes a zero.
__device__ __forceinline__ void cp_async_4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_address(dst)), "l"(src), "r"(valid ? 4 : 0));
}

// Starts copying a kRows x (cols_fill) tile of 4-byte elements: source rows [0, rows) and
// columns [0, cols) of a row-major matrix with row stride `ld` (elements), destination row
// stride kLd. Elements outside the source become 0. cols_fill <= kCols, a multiple of 4.
// vec16: the source rows are 16-byte aligned and cols % 4 == 0, so 16-byte copies are legal.
// The same for rows that are not one strided block: `row_address(r)` gives row r's start (a
// paged cache); it is called only for valid rows, and row_address(0) stands in for the others.
template <int kRows, int kCols, int kLd, int kThreads, class T, class RowAddress>
__device__ __forceinline__ void load_tile_async_rows(T* smem, RowAddress row_address, int rows, int cols,
                                                     int cols_fill, bool vec16) {
  static_assert(sizeof(T) == 4, "4-byte elements");
  if (vec16) {
    constexpr int kChunks = kCols / 4;
#pragma unroll 4
    for (int idx = threadIdx.x; idx < kRows * kChunks; idx += kThreads) {
      const int r = idx / kChunks, c = (idx % kChunks) * 4;
      if (c >= cols_fill) continue;
      const bool valid = r < rows && c < cols;
      cp_async_16(smem_address(smem + r * kLd + c), valid ? row_address(r) + c : row_address(0), valid ? 16 : 0);
    }
  } else {
#pragma unroll 4
    for (int idx = threadIdx.x; idx < kRows * kCols; idx += kThreads) {
      const int r = idx / kCols, c = idx % kCols;
      if (c >= cols_fill) continue;
      const bool valid = r < rows && c < cols;
      cp_async_4(smem + r * kLd + c, valid ? row_address(r) + c : row_address(0), valid);
    }
  }
}

template <int kRows, int kCols, int kLd, int kThreads, class T>
__device__ __forceinline__ void load_tile_async(T* smem, const T* gmem, int64_t ld, int rows, int cols, int cols_fill,
                                                bool vec16) {
  load_tile_async_rows<kRows, kCols, kLd, kThreads>(smem, [&](int r) { return gmem + r * ld; }, rows, cols,
                                                    cols_fill, vec16);
}

}  // namespace tileattn::cuda::fp32
