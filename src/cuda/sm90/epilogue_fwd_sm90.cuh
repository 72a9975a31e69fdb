#pragma once
// The sm90 forward's epilogue. A consumer warpgroup's 64 finished rows of O go to shared memory
// (the rows of Q it no longer reads) in the tile format of panel_tile_sm90.cuh, and out with TMA
// stores of whole 128-byte rows. The direct stores of store_fwd_output write each row in
// 16-byte pieces from four threads; at D = 128, N = 1k they cost 8% of the forward's time (H100,
// bf16: 468 TFLOP/s against 505 with O not stored at all).
// Where TMA cannot store (split-KV partials, an O the copy engine cannot describe, a varlen tile
// reaching past its sequence, whose rows the next sequence owns), the direct stores run.
#include <cuda_runtime.h>

#include "cuda/common/fwd_block.cuh"
#include "cuda/sm90/fwd_params_sm90.hpp"
#include "cuda/sm90/ptx_sm90.cuh"

namespace tileattn::cuda {

// rows: the consumer's first row of panel 0 in shared memory (1024-byte aligned); panels follow
// every kPanelBytes. Named barrier 3 + consumer gathers the consumer's 128 threads.
template <class T, int kHeadDim, int kPanelBytes>
__device__ __forceinline__ void store_fwd_output_sm90(const FwdSm90Params& params, const FwdBlock& blk, int row0,
                                                      float (&o)[1][kHeadDim / 8][4], RowStats<1>& stats,
                                                      unsigned char* rows, int consumer) {
#if defined(TILEATTN_SM90_ENABLED)
  const FwdParams& p = params.fwd;
  const bool varlen = p.cu_seqlens_q != nullptr;
  if (!params.o_by_tma || p.num_splits > 1 || (varlen && blk.m0 + 64 * (consumer + 1) > blk.seqlen_q)) {
    store_fwd_output<T>(p, blk, row0, o, stats);
    return;
  }
  const int warp = (int(threadIdx.x) / 32) % 4, lane = int(threadIdx.x) % 32, t = lane % 4;
  stats.reduce_sums();
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = 16 * warp + lane / 4 + 8 * half;  // row within the consumer's 64
    const float inv = inverse_row_sum(stats.sum[0][half]);
    if (t == 0 && row0 + 8 * half < blk.seqlen_q)
      p.lse[lse_index(p, blk, row0 + 8 * half)] = finish_lse(stats.max_log2[0][half], stats.sum[0][half]);
#pragma unroll
    for (int ot = 0; ot < kHeadDim / 8; ++ot) {
      // Columns 8 ot + 2t, + 1: 16-byte chunk ot % 8 of the 128-byte row, swizzled by the row.
      unsigned char* at = rows + (ot / 8) * kPanelBytes + r * 128 + (((ot % 8) ^ (r % 8)) * 16) + 4 * t;
      *reinterpret_cast<uint32_t*>(at) = pack2<T>(o[0][ot][2 * half] * inv, o[0][ot][2 * half + 1] * inv);
    }
  }
  sm90::fence_shared_to_async();
  sm90::named_barrier_sync(3 + consumer, 128);
  if (threadIdx.x % 128 == 0) {
    // Rows past the sequence (non-varlen: past the tensor) and columns past headdim_v are clipped.
    const int row = int(blk.q_row0) + blk.m0 + 64 * consumer, batch = varlen ? 0 : blk.batch;
#pragma unroll
    for (int c = 0; c < (kHeadDim + 63) / 64; ++c)
      if (64 * c < p.headdim_v) sm90::tma_store_4d(&params.o, rows + c * kPanelBytes, 64 * c, row, blk.head, batch);
    sm90::bulk_commit();
    sm90::bulk_wait_read();  // the block's shared memory must outlive the copies' reads
  }
#endif
}

}  // namespace tileattn::cuda
