#pragma once
// A consumer warpgroup's 64 finished rows of an accumulator leave through shared memory: they are
// written, as T, in the tile format of panel_tile_sm90.cuh (into rows of an operand tile the
// consumer no longer reads), and TMA stores them as whole 128-byte rows. Direct stores from the
// accumulator layout write each row in 16-byte pieces from four threads; in the forward at
// D = 128, N = 1k they cost 8% of the time (H100, bf16: 468 TFLOP/s against 505 with O not
// stored at all), and the staged store took the kernel to 482-489.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/arch/ptx_sm80.cuh"
#include "cuda/arch/pipeline_sm90.cuh"
#include "cuda/arch/ptx_sm90.cuh"

namespace tileattn::cuda::sm90 {

// acc: the consumer's rows in the wgmma accumulator layout (thread (warp, g, t) holds rows
// 16 warp + g and + 8, columns 8 j + 2 t and + 1), each half multiplied by scale[half].
// rows: the consumer's first row of panel 0 (1024-byte aligned); panels follow every
// kPanelBytes. The box at (column 64 c, row, head, batch) of `map` is written for each panel
// whose first column is below `cols`; rows and columns outside the tensor are clipped. Named
// barrier kStoreConsumer0 + consumer gathers the consumer's 128 threads. Without wait_read the
// storing thread returns before the copies have read `rows`.
template <class T, int kDim, int kPanelBytes>
__device__ __forceinline__ void store_rows(const CUtensorMap* map, unsigned char* rows,
                                           const float (&acc)[1][kDim / 8][4], const float (&scale)[2], int cols,
                                           int row, int head, int batch, int consumer, bool wait_read = true) {
#if defined(TILEATTN_SM90_ENABLED)
  const int warp = (int(threadIdx.x) / 32) % 4, lane = int(threadIdx.x) % 32, t = lane % 4;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = 16 * warp + lane / 4 + 8 * half;
#pragma unroll
    for (int j = 0; j < kDim / 8; ++j) {
      // Columns 8 j + 2t, + 1: 16-byte chunk j % 8 of the 128-byte row, swizzled by the row.
      unsigned char* at = rows + (j / 8) * kPanelBytes + r * 128 + (((j % 8) ^ (r % 8)) * 16) + 4 * t;
      *reinterpret_cast<uint32_t*>(at) = pack2<T>(acc[0][j][2 * half] * scale[half], acc[0][j][2 * half + 1] * scale[half]);
    }
  }
  fence_shared_to_async();
  named_barrier_sync(kStoreConsumer0 + consumer, 128);
  if (threadIdx.x % 128 == 0) {
#pragma unroll
    for (int c = 0; c < (kDim + 63) / 64; ++c)
      if (64 * c < cols) tma_store_4d(map, rows + c * kPanelBytes, 64 * c, row, head, batch);
    bulk_commit();
    // The rows must outlive the copies' reads: here, or where the caller next needs them.
    if (wait_read) bulk_wait_read();
  }
#endif
}

}  // namespace tileattn::cuda::sm90
