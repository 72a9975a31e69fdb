#pragma once
// TF32 operands beyond what TMA writes (PanelTile<kRows, kDim, 4>: 128-byte swizzled panels of 32
// fp32 columns, each panel on the 1024-byte swizzle period).
//
// Tf32Transposed: the B operand where the product's k dimension runs down a stored tile's rows.
// TF32 wgmma reads shared-memory operands K-major only, so such a tile is rewritten as kDim rows
// of kRows positions: panels of kDim rows x 32 positions (128 bytes), 128-byte swizzled.
//
// The positions are permuted within each group of 8 so that an accumulator goes to the A
// fragment of the next product without moving between lanes: the accumulator gives thread
// (g, t) columns 2t and 2t+1 of every 8-column tile, the A fragment wants k positions t and t+4
// of a k-step, so position t holds row 2t and position t+4 row 2t+1 of the source tile.
//
// tf32_a_fragments: an A operand that every product of a block reuses, read once into registers
// (the A-fragment layout of wgmma per warp, rounded to TF32), so that its products read only B
// from shared memory: with both operands from shared memory a TF32 m64n64k8 step reads 4 KB in
// the 32 clocks the tensor core takes for it, all of shared memory's bandwidth.
#include <cstdint>

#include "cuda/arch/mma_fp32.cuh"

#include "cuda/arch/ptx_sm90.cuh"
#include "cuda/arch/smm_ptx.cuh"

namespace tileattn::cuda::sm90 {

template <int kRows, int kDim>
struct Tf32Transposed {
  static_assert(kRows % 32 == 0 && kDim % 32 == 0, "whole 128-byte panels on both sides");
  static constexpr int kPanelBytes = kDim * 128;
  static constexpr int kBytes = (kRows / 32) * kPanelBytes;
  static constexpr int kSourcePanelBytes = kRows * 128;  // PanelTile<kRows, kDim, 4>

  // k-step kk (8 positions) of the rewritten tile at `base`, or from its descriptor.
  __device__ __forceinline__ static constexpr uint32_t k_offset(int kk) {
    return (kk / 4) * kPanelBytes + (kk % 4) * 32;
  }
  __device__ __forceinline__ static uint64_t k_major(uint32_t base, int kk) {
    return k_major_descriptor(base + k_offset(kk));
  }
  __device__ __forceinline__ static uint64_t k_step(uint64_t desc, int kk) {
    return descriptor_plus(desc, k_offset(kk));
  }

  // The rewrite of `src` into `dst` by threads [0, threads) (tid = this thread's index among them;
  // threads a multiple of 32, warps aligned). Unit (position group pg, column chunk nc): positions
  // 4 pg .. 4 pg + 3 of rewritten rows 4 nc .. 4 nc + 3. Position group pg is half pg % 2 of k-step
  // pg / 2: source rows 8 (pg / 2) + 2i + pg % 2, i < 4. Both sides read and write whole 16-byte
  // chunks.
  //
  // Units go to lanes so that the eight lanes of each quarter-warp touch eight different 16-byte
  // bank groups on both sides: lane l of a quarter takes pg % 8 = l and nc % 8 = (l & 6) ^ s for
  // the quarter's s. The loads then land in bank group (nc % 8) ^ 2i ^ (pg % 2) and the stores in
  // (pg % 8) ^ 4 (nc % 2) ^ c, each a permutation of l. (Eight lanes reading one chunk of
  // consecutive pg hit two groups only: 16 wavefronts a load instead of 4.)
  __device__ __forceinline__ static void write(const unsigned char* src, unsigned char* dst, int tid, int threads) {
    rewrite(src, tid, threads, [=](int at, float4 v) { *reinterpret_cast<float4*>(dst + at) = v; });
  }

  // write() as kParts tiles kBytes apart from `dst` whose sum is x: each part is what the parts
  // before it left over, rounded to TF32 (fp32::split_tf32). Three parts hold every fp32 value
  // exactly (11 + 11 + 11 bits against 24), two leave about 2^-22 of it.
  template <int kParts>
  __device__ __forceinline__ static void write_split(const unsigned char* src, unsigned char* dst, int tid,
                                                     int threads) {
    rewrite(src, tid, threads, [=](int at, float4 v) {
#pragma unroll
      for (int i = 0; i < kParts; ++i) {
        float4 part;
        fp32::split_tf32(v, part, v);
        *reinterpret_cast<float4*>(dst + i * kBytes + at) = part;
      }
    });
  }

 private:
  // The unit walk of write(): store(byte offset in the rewritten tile, its 16 bytes).
  template <class Store>
  __device__ __forceinline__ static void rewrite(const unsigned char* src, int tid, int threads, Store store) {
    constexpr int kPgBlocks = kRows / 32;  // blocks of 8 position groups
    const int l = tid % 8;                  // the same in every unit of this thread
#pragma unroll 1
    for (int u = tid; u < (kRows / 4) * (kDim / 4); u += threads) {
      const int r = u / 64;
      const int pg = 8 * (r % kPgBlocks) + l, nc = 8 * (r / kPgBlocks) + ((l & 6) ^ ((u / 8) % 8));
      const int panel = nc / 8, chunk = nc % 8;
      float4 in[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = 8 * (pg / 2) + 2 * i + pg % 2;
        in[i] = *reinterpret_cast<const float4*>(src + panel * kSourcePanelBytes + row * 128 +
                                                 ((chunk ^ (row % 8)) * 16));
      }
      const int trow = (pg / 8) * kPanelBytes;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int n = 4 * nc + c;
        store(trow + n * 128 + (((pg % 8) ^ (n % 8)) * 16), column_of(in, c));
      }
    }
  }
};

// Byte offset of fp32 element (row, col) in a PanelTile<tile_rows, dim, 4>.
__device__ __forceinline__ constexpr int tf32_panel_offset(int row, int col, int tile_rows) {
  return (col / 32) * tile_rows * 128 + row * 128 + ((((col % 32) / 4) ^ (row % 8)) * 16) + (col % 4) * 4;
}

// Rows row0 .. row0 + 15 (this warp's) of a PanelTile<rows, kDim, 4> at `tile` as kDim / 8 A
// fragments: fragment ks holds (row0 + g, 8 ks + t), (row0 + g + 8, 8 ks + t), (row0 + g,
// 8 ks + t + 4), (row0 + g + 8, 8 ks + t + 4) for lane (g, t). row0 is a multiple of 8.
template <int kDim>
__device__ __forceinline__ void tf32_a_fragments(uint32_t (&a)[kDim / 8][4], const unsigned char* tile, int tile_rows,
                                                 int row0, int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int ks = 0; ks < kDim / 8; ++ks)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = row0 + g + 8 * (i % 2), col = 8 * ks + t + 4 * (i / 2);
      a[ks][i] = fp32::to_tf32(*reinterpret_cast<const float*>(tile + tf32_panel_offset(row, col, tile_rows)));
    }
}

// The transpose's A fragments: columns col0 .. col0 + 15 (this warp's M rows) over tile rows
// row0 .. row0 + kK - 1 (the k dimension) of a PanelTile<tile_rows, dim, 4> whose values are
// TF32 already: fragment kk holds (row0 + 8 kk + t, col0 + g), (row0 + 8 kk + t, col0 + g + 8),
// (row0 + 8 kk + t + 4, col0 + g), (row0 + 8 kk + t + 4, col0 + g + 8) for lane (g, t).
template <int kK>
__device__ __forceinline__ void tf32_a_fragments_of_transpose(uint32_t (&a)[kK / 8][4], const unsigned char* tile,
                                                              int tile_rows, int row0, int col0, int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int kk = 0; kk < kK / 8; ++kk)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = row0 + 8 * kk + t + 4 * (i / 2), col = col0 + g + 8 * (i % 2);
      a[kk][i] = *reinterpret_cast<const uint32_t*>(tile + tf32_panel_offset(row, col, tile_rows));
    }
}

}  // namespace tileattn::cuda::sm90
