#pragma once
// The shared-memory tile format of the sm90 kernels: a (rows x dim) tile is stored as panels of
// rows x 128 bytes (64 16-bit or 32 fp32 columns), 128-byte swizzled, panel after panel -- what a
// TMA box of one 128-byte row writes, and what the wgmma descriptors of ptx_sm90.cuh read. A
// wgmma k-step is 32 bytes of a row in either type (16 columns of 16 bits, 8 of TF32).
#include <cstdint>

#include "cuda/arch/pipeline_sm90.cuh"
#include "cuda/arch/ptx_sm90.cuh"

namespace tileattn::cuda::sm90 {

template <int kRows, int kDim, int kElementBytes = 2>
struct PanelTile {
  static constexpr int kPanelColumns = 128 / kElementBytes;
  static constexpr int kPanels = (kDim + kPanelColumns - 1) / kPanelColumns;
  static constexpr int kPanelBytes = kRows * 128;
  static constexpr int kBytes = kPanels * kPanelBytes;

  // Operand read along its 128-byte rows (K-major): k-step ks (32 bytes of each row), from the
  // tile's address or from its descriptor (k_major_descriptor(base)).
  __device__ __forceinline__ static constexpr uint32_t k_offset(int ks) {
    return (ks / 4) * kPanelBytes + (ks % 4) * 32;
  }
  __device__ __forceinline__ static uint64_t k_major(uint32_t base, int ks) {
    return k_major_descriptor(base + k_offset(ks));
  }
  __device__ __forceinline__ static uint64_t k_step(uint64_t desc, int ks) {
    return descriptor_plus(desc, k_offset(ks));
  }
  // Operand read across its rows (N-major, rows are the K dimension): k-step ks of 16 rows
  // (16-bit types only: TF32 wgmma reads K-major operands alone).
  __device__ __forceinline__ static uint64_t n_major(uint32_t base, int ks) {
    static_assert(kElementBytes == 2, "N-major operands are 16-bit");
    return mn_major_descriptor(base + ks * 16 * 128, kPanelBytes);
  }
  __device__ __forceinline__ static uint64_t n_step(uint64_t desc, int ks) {
    return descriptor_plus(desc, ks * 16 * 128);
  }

#if defined(TILEATTN_SM90_ENABLED)
  // Rows [row, row + kRows) of a (dim, rows, heads, batch) tensor map whose boxes are
  // box_rows x kPanelColumns, completing on `bar` (kBytes in all).
  template <int kBoxRows>
  __device__ __forceinline__ static void load(void* dst, const CUtensorMap* map, uint64_t* bar, int row, int head,
                                              int batch) {
    static_assert(kRows % kBoxRows == 0, "whole boxes per tile");
#pragma unroll
    for (int c = 0; c < kPanels; ++c)
#pragma unroll
      for (int r = 0; r < kRows / kBoxRows; ++r)
        tma_load_4d(static_cast<unsigned char*>(dst) + c * kPanelBytes + r * kBoxRows * 128, map, bar, kPanelColumns * c,
                    row + r * kBoxRows, head, batch);
  }
#endif
};

}  // namespace tileattn::cuda::sm90
