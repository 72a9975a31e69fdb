#pragma once
// The B operand TF32 wgmma needs where the product's k dimension runs down a stored tile's rows.
// TF32 wgmma reads shared-memory operands K-major only, so a (kRows x kDim) fp32 tile as TMA
// wrote it (PanelTile<kRows, kDim, 4>) is rewritten as kDim rows of kRows positions: panels of
// kDim rows x 32 positions (128 bytes), 128-byte swizzled.
//
// The positions are permuted within each group of 8 so that an accumulator goes to the A
// fragment of the next product without moving between lanes: the accumulator gives thread
// (g, t) columns 2t and 2t+1 of every 8-column tile, the A fragment wants k positions t and t+4
// of a k-step, so position t holds row 2t and position t+4 row 2t+1 of the source tile.
#include <cstdint>

#include "cuda/arch/ptx_sm90.cuh"
#include "cuda/arch/smm_ptx.cuh"

namespace tileattn::cuda::sm90 {

template <int kRows, int kDim>
struct Tf32Transposed {
  static_assert(kRows % 32 == 0 && kDim % 32 == 0, "whole 128-byte panels on both sides");
  static constexpr int kPanelBytes = kDim * 128;
  static constexpr int kBytes = (kRows / 32) * kPanelBytes;
  static constexpr int kSourcePanelBytes = kRows * 128;  // PanelTile<kRows, kDim, 4>

  // k-step kk (8 positions) of the rewritten tile at `base`.
  __device__ __forceinline__ static uint64_t k_major(uint32_t base, int kk) {
    return k_major_descriptor(base + (kk / 4) * kPanelBytes + (kk % 4) * 32);
  }

  // The rewrite of `src` into `dst` by threads [0, threads) (tid = this thread's index among them).
  // Unit (position group pg, column chunk nc): positions 4 pg .. 4 pg + 3 of rewritten rows
  // 4 nc .. 4 nc + 3. Position group pg is half pg % 2 of k-step pg / 2: source rows
  // 8 (pg / 2) + 2i + pg % 2, i < 4. Both sides read and write whole 16-byte chunks.
  __device__ __forceinline__ static void write(const unsigned char* src, unsigned char* dst, int tid, int threads) {
#pragma unroll 1
    for (int u = tid; u < (kRows / 4) * (kDim / 4); u += threads) {
      const int pg = u % (kRows / 4), nc = u / (kRows / 4);
      const int panel = nc / 8, chunk = nc % 8;
      float4 in[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = 8 * (pg / 2) + 2 * i + pg % 2;
        in[i] = *reinterpret_cast<const float4*>(src + panel * kSourcePanelBytes + row * 128 +
                                                 ((chunk ^ (row % 8)) * 16));
      }
      unsigned char* trow = dst + (pg / 8) * kPanelBytes;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int n = 4 * nc + c;
        *reinterpret_cast<float4*>(trow + n * 128 + (((pg % 8) ^ (n % 8)) * 16)) = column_of(in, c);
      }
    }
  }
};

}  // namespace tileattn::cuda::sm90
