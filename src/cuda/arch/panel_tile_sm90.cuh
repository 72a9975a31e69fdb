#pragma once
// The shared-memory tile format of the sm90 kernels: a (rows x dim) tile of 16-bit elements is
// stored as ceil(dim / 64) panels of rows x 128 bytes, 128-byte swizzled, panel after panel --
// what a TMA box of 64 columns writes, and what the wgmma descriptors of ptx_sm90.cuh read.
#include <cstdint>

#include "cuda/arch/pipeline_sm90.cuh"
#include "cuda/arch/ptx_sm90.cuh"

namespace tileattn::cuda::sm90 {

template <int kRows, int kDim>
struct PanelTile {
  static constexpr int kPanels = (kDim + 63) / 64;
  static constexpr int kPanelBytes = kRows * 128;
  static constexpr int kBytes = kPanels * kPanelBytes;

  // Operand read along its 128-byte rows (K-major): k-step ks of 16 columns.
  __device__ __forceinline__ static uint64_t k_major(uint32_t base, int ks) {
    return k_major_descriptor(base + (ks / 4) * kPanelBytes + (ks % 4) * 32);
  }
  // Operand read across its rows (N-major, rows are the K dimension): k-step ks of 16 rows.
  __device__ __forceinline__ static uint64_t n_major(uint32_t base, int ks) {
    return mn_major_descriptor(base + ks * 16 * 128, kPanelBytes);
  }

#if defined(TILEATTN_SM90_ENABLED)
  // Rows [row, row + kRows) of a (dim, rows, heads, batch) tensor map whose boxes are
  // box_rows x 64 columns, completing on `bar` (kBytes in all).
  template <int kBoxRows>
  __device__ __forceinline__ static void load(void* dst, const CUtensorMap* map, uint64_t* bar, int row, int head,
                                              int batch) {
    static_assert(kRows % kBoxRows == 0, "whole boxes per tile");
#pragma unroll
    for (int c = 0; c < kPanels; ++c)
#pragma unroll
      for (int r = 0; r < kRows / kBoxRows; ++r)
        tma_load_4d(static_cast<unsigned char*>(dst) + c * kPanelBytes + r * kBoxRows * 128, map, bar, 64 * c,
                    row + r * kBoxRows, head, batch);
  }
#endif
};

}  // namespace tileattn::cuda::sm90
