#pragma once
// What every forward kernel (sm80, sm90) does the same way around its mainloop: which
// (batch, head, query tile, key split) a block owns, which key tiles it visits, and how the
// finished rows are written (O and LSE, or the split-KV partials).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/key_rows.hpp"
#include "common/mask.hpp"
#include "common/online_softmax.hpp"
#include "common/varlen.hpp"
#include "cuda/arch/ptx_sm80.cuh"
#include "cuda/common/fwd_params.hpp"
#include "cuda/forward/softmax_fwd_sm80.cuh"
#include "tileattn/error.hpp"

namespace tileattn::cuda {

// Where a block works: batch, head, key split, its first query row, and the sequence it reads
// (lengths, and for varlen batches its first row in the packed buffers).
struct FwdBlock {
  int batch, head, split;
  int seqlen_q, seqlen_k;
  int64_t q_row0, k_row0;  // first row of this sequence in the (varlen) buffers
  int m0;                  // first query row of the tile within the sequence
  KeySpan key;             // where its keys are (k_row0 is key.row0)
};

// The grid is (query tiles x splits, heads_q / pack, batch); heavy query tiles (late rows under a
// causal mask) are launched first. With GQA packing `head` is the kv head and the tile's rows are
// packed (position, head) pairs (FwdParams::pack); seqlen_q stays the sequence's positions.
__device__ __forceinline__ FwdBlock fwd_block(const FwdParams& p, int block_m, int m_block, int split, int head,
                                               int batch) {
  FwdBlock blk;
  blk.split = split, blk.head = head, blk.batch = batch;
  blk.m0 = m_block * block_m;
  blk.seqlen_q = p.seqlen_q, blk.q_row0 = 0;
  if (p.cu_seqlens_q) {
    const SeqRange q = varlen_range(p.cu_seqlens_q, blk.batch, p.total_q, p.seqlen_q);
    blk.q_row0 = q.begin, blk.seqlen_q = q.len;
  }
  blk.key = key_span(p.keys, blk.batch);
  blk.k_row0 = blk.key.row0, blk.seqlen_k = blk.key.len;
  return blk;
}

__device__ __forceinline__ FwdBlock fwd_block_of_this_cta(const FwdParams& p, int block_m) {
  const int m_blocks = int(gridDim.x) / p.num_splits;
  return fwd_block(p, block_m, m_blocks - 1 - int(blockIdx.x) / p.num_splits, int(blockIdx.x) % p.num_splits,
                   int(blockIdx.y), int(blockIdx.z));
}

// Key tiles [begin, end) of size block_n that the block visits (its split's share of those the
// mask leaves), and the key range [full_begin, full_end) every row of the tile sees: a key tile
// inside it needs no mask arithmetic. pack: p.pack, or 1 where the kernel never packs (a
// constant then spares two integer divisions a tile).
struct KeyTiles {
  int begin, end;
  int full_begin, full_end;
};
__device__ __forceinline__ KeyTiles key_tiles(const FwdParams& p, const FwdBlock& blk, const Mask& mask, int block_m,
                                              int block_n, int pack) {
  // Positions of the tile's first and last rows (packed rows: position = row / pack).
  const int first = blk.m0 / pack, m_end = min((blk.m0 + block_m - 1) / pack + 1, blk.seqlen_q);
  const int key_begin = mask.tile_begin_key(first), key_end = mask.tile_end_key(m_end);
  KeyTiles t;
  t.begin = key_begin / block_n;
  t.end = key_end > key_begin ? (key_end + block_n - 1) / block_n : t.begin;
  if (p.num_splits > 1) {
    const int per_split = (t.end - t.begin + p.num_splits - 1) / p.num_splits;
    t.begin = min(t.end, t.begin + blk.split * per_split);
    t.end = min(t.end, t.begin + per_split);
  }
  t.full_begin = mask.full_begin_key(m_end);
  t.full_end = mask.full_end_key(first);
  return t;
}

// Where the log-sum-exp of position `row` of query head `head` goes: (batch, heads_q, seqlen_q),
// or (heads_q, total_q) for varlen batches.
__device__ __forceinline__ int64_t lse_index(const FwdParams& p, const FwdBlock& blk, int row, int head) {
  return p.cu_seqlens_q ? int64_t(head) * p.total_q + blk.q_row0 + row
                        : (int64_t(blk.batch) * p.heads_q + head) * p.seqlen_q + row;
}
__device__ __forceinline__ int64_t lse_index(const FwdParams& p, const FwdBlock& blk, int row) {
  return lse_index(p, blk, row, blk.head);
}

// The epilogue of a thread's finished rows (row0: its row of m-tile 0, g): O divided by the row
// sum and L, or with split-KV the split's fp32 partials; rows past the sequence are not written.
template <class T, int kMTiles, int kOTiles>
__device__ __forceinline__ void store_fwd_output(const FwdParams& p, const FwdBlock& blk, int row0,
                                                 float (&o)[kMTiles][kOTiles][4], RowStats<kMTiles>& stats) {
  const int t = threadIdx.x % 4;
  stats.reduce_sums();
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int packed_row = row0 + mt * 16 + half * 8;
      const int row = packed_row / p.pack, head = blk.head * p.pack + packed_row % p.pack;
      if (row >= blk.seqlen_q) continue;
      // Dropout's 1 / (1 - p) rides on the row sum (split partials too: combining is linear in O).
      const float inv = inverse_row_sum(stats.sum[mt][half]) * p.dropout.scale;
      float lse = finish_lse(stats.max_log2[mt][half], stats.sum[mt][half]);
      // ALiBi's causal form: L as flash-attn returns it (ScoreMod::lse_offset); split partials
      // carry it too, and the combine's logsumexp keeps it once.
      if (p.mod.alibi_lse_offset && lse != -INFINITY)
        lse += p.mod.lse_offset(p.mod.slope(blk.batch, head), row, blk.seqlen_q, blk.seqlen_k);
      if (p.num_splits > 1) {
        const int64_t r = ((int64_t(blk.split) * p.batch + blk.batch) * p.heads_q + head) * p.seqlen_q + row;
        float* out = p.o_partial + r * p.headdim_v;
#pragma unroll
        for (int ot = 0; ot < kOTiles; ++ot)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int d = ot * 8 + 2 * t + e;
            if (d < p.headdim_v) out[d] = o[mt][ot][2 * half + e] * inv;
          }
        if (t == 0) p.lse_partial[r] = lse;
        continue;
      }
      T* out = static_cast<T*>(p.o) + (p.cu_seqlens_q ? 0 : blk.batch * p.o_batch_stride) +
               (blk.q_row0 + row) * p.o_row_stride + head * p.o_head_stride;
#pragma unroll
      for (int ot = 0; ot < kOTiles; ++ot) {
        const int d = ot * 8 + 2 * t;
        const float x0 = o[mt][ot][2 * half] * inv, x1 = o[mt][ot][2 * half + 1] * inv;
        if (p.pair_o && d + 1 < p.headdim_v) {
          *reinterpret_cast<uint32_t*>(out + d) = pack2<T>(x0, x1);
        } else {
          if (d < p.headdim_v) out[d] = from_float<T>(x0);
          if (d + 1 < p.headdim_v) out[d + 1] = from_float<T>(x1);
        }
      }
      if (t == 0) p.lse[lse_index(p, blk, row, head)] = lse;
    }
}

// ---- host side, shared by the forward launchers ------------------------------------------------

inline int64_t fwd_query_tiles(const FwdParams& p, int block_m) {
  return (int64_t(p.seqlen_q) * p.pack + block_m - 1) / block_m;
}

// The grid (query tiles x splits, heads_q, batch), or an error past the hardware's limits.
inline dim3 fwd_grid(const FwdParams& p, int64_t query_tiles) {
  const int64_t grid_x = query_tiles * p.num_splits;
  const int heads = p.heads_q / p.pack;
  if (grid_x > 0x7fffffff || heads > 65535 || p.batch > 65535)
    throw Error(ErrorKind::unsupported, "CUDA forward: grid too large (query tiles " + std::to_string(grid_x) +
                                            ", heads_q " + std::to_string(p.heads_q) + ", batch " +
                                            std::to_string(p.batch) + "; heads and batch must be <= 65535)");
  return dim3(unsigned(grid_x), unsigned(heads), unsigned(p.batch));
}


}  // namespace tileattn::cuda
