#pragma once
// The sm90 forward's epilogue: a consumer's 64 rows of O over their row sums go out through
// shared memory (the consumer's rows of Q) and TMA (tile_store_sm90.cuh), their L directly.
// Without wait_read the storing thread (thread 0 of the consumer) must wait for the copies' reads
// (bulk_wait_read) before those rows are written again.
// Where TMA cannot store (split-KV partials, an O the copy engine cannot describe, a varlen tile
// reaching past its sequence, whose rows the next sequence owns), store_fwd_output runs.
#include <cuda_runtime.h>

#include "cuda/forward/fwd_block.cuh"
#include "cuda/forward/fwd_params_sm90.hpp"
#include "cuda/arch/tile_store_sm90.cuh"

namespace tileattn::cuda {

// L of a row with ALiBi: plus the causal form's offset (ScoreMod::lse_offset), as store_fwd_output
// adds it.
__device__ __forceinline__ float alibi_lse(const FwdParams& p, const FwdBlock& blk, int row, float lse) {
  if (p.mod.alibi_lse_offset && lse != -INFINITY)
    lse += p.mod.lse_offset(p.mod.slope(blk.batch, blk.head), row, blk.seqlen_q, blk.seqlen_k);
  return lse;
}

template <class T, int kHeadDim, int kPanelBytes, bool kAlibi>
__device__ __forceinline__ void store_fwd_output_sm90(const FwdSm90Params& params, const FwdBlock& blk, int row0,
                                                      float (&o)[1][kHeadDim / 8][4], RowStats<1>& stats,
                                                      unsigned char* rows, int consumer, bool wait_read) {
  const FwdParams& p = params.fwd;
  const bool varlen = p.cu_seqlens_q != nullptr;
  if (!params.o_by_tma || p.num_splits > 1 || (varlen && blk.m0 + 64 * (consumer + 1) > blk.seqlen_q)) {
    store_fwd_output<T>(p, blk, row0, o, stats);
    return;
  }
  stats.reduce_sums();
  float inv[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    inv[half] = inverse_row_sum(stats.sum[0][half]);
    // Two statements, not one with the offset behind the flag: the shared form changed the code
    // ptxas made of the whole kernel without ALiBi.
    if constexpr (kAlibi) {
      if (threadIdx.x % 4 == 0 && row0 + 8 * half < blk.seqlen_q)
        p.lse[lse_index(p, blk, row0 + 8 * half)] =
            alibi_lse(p, blk, row0 + 8 * half, finish_lse(stats.max_log2[0][half], stats.sum[0][half]));
    } else {
      if (threadIdx.x % 4 == 0 && row0 + 8 * half < blk.seqlen_q)
        p.lse[lse_index(p, blk, row0 + 8 * half)] = finish_lse(stats.max_log2[0][half], stats.sum[0][half]);
    }
  }
  sm90::store_rows<T, kHeadDim, kPanelBytes>(&params.o, rows, o, inv, p.headdim_v,
                                              int(blk.q_row0) + blk.m0 + 64 * consumer, blk.head,
                                              varlen ? 0 : blk.batch, consumer, wait_read);
}

}  // namespace tileattn::cuda
