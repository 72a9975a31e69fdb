#pragma once
// The decode forward (sm80 instructions; any sm80+ GPU): a query tile of at most 16 rows -- the
// heads of a GQA group at one position packed together (FwdParams::pack), or a few positions --
// against a long key range. Such a tile cannot keep the tensor cores busy; what decides the speed
// is how many K/V bytes are in flight. So the block shares a ring of kStages (K, V) tiles filled
// with cp.async, and within a tile each of the 4 warps takes its own 16 keys with its own online
// softmax (all four sub-partitions of the SM work); the warps' partial rows are folded together
// once, at the end, exactly as split-KV partials are.
//
//   S_w = Q K_w^T        Q: the 16 (packed) rows; K_w: keys 16w..16w+15 of the tile
//   O_w += P_w V_w       online softmax per warp
//   O = sum_w O_w 2^(m_w - m),  l = sum_w l_w 2^(m_w - m)
#include <cuda_runtime.h>

#include "common/mask.hpp"
#include "common/online_softmax.hpp"
#include "cuda/arch/dependent_launch.cuh"
#include "cuda/arch/ptx_sm80.cuh"
#include "cuda/arch/smem_tile_sm80.cuh"
#include "cuda/common/fwd_params.hpp"
#include "cuda/forward/fwd_block.cuh"
#include "cuda/forward/fwd_tile_size.hpp"
#include "cuda/forward/softmax_fwd_sm80.cuh"

namespace tileattn::cuda {

// How a block finds its key rows; each is an instance of its own, so that one path's copies do
// not shape the others' code (the loop is sensitive to it: docs/perf-log.md).
//  - tiles: contiguous, or pages holding whole tiles (one base a tile);
//  - warps: pages of a multiple of 16 keys, each warp copying its 16 keys from their one page;
//  - rows:  shorter pages, gathered row by row.
enum class DecodeGather { tiles, warps, rows };

inline DecodeGather decode_gather(const KeyLayout& keys, int block_n) {
  if (!keys.paged() || keys.page_size % block_n == 0) return DecodeGather::tiles;
  return keys.page_size % 16 == 0 ? DecodeGather::warps : DecodeGather::rows;
}

template <class T, int kHeadDim>
struct DecodeTraits {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockM = kDecodeRows;  // packed query rows: one mma tile
  static_assert(kBlockM == 16, "one m16 tile per warp");
  static constexpr int kBlockN = 16 * kWarps;
  // Stages as deep as shared memory allows at two blocks per SM on Hopper/Ampere.
  static constexpr int kStages = kHeadDim <= 64 ? 4 : kHeadDim <= 128 ? 3 : 2;
  static constexpr int kOTiles = kHeadDim / 8;
  // The Q tile is at least one pass of the cooperative loader (32 rows at head dim 32).
  static constexpr int kLoadSlots = kHeadDim / 8 <= 4 ? 4 : kHeadDim / 8 <= 8 ? 8 : kHeadDim / 8 <= 16 ? 16 : 32;
  static constexpr int kQRows = kThreads / kLoadSlots > kBlockM ? kThreads / kLoadSlots : kBlockM;
  using QTile = SmemTile<kQRows, kHeadDim>;
  using KVTile = SmemTile<kBlockN, kHeadDim>;
  static constexpr int kStageElements = 2 * KVTile::kElements;  // K, then V
  static constexpr int kSmemBytes = int(sizeof(T)) * (QTile::kElements + kStages * kStageElements);
  // What warps 1..3 hand warp 0 at the end, per lane: row maxima, sum shares, O fragments.
  static constexpr int kExchange = 4 + 4 * kOTiles;
  static_assert(int(sizeof(float)) * (kWarps - 1) * kExchange * 32 <= int(sizeof(T)) * kStages * kStageElements,
                "the exchange reuses the K/V ring");
};

template <class T, int kHeadDim, DecodeGather kGather>
__global__ void __launch_bounds__(DecodeTraits<T, kHeadDim>::kThreads)
    fwd_decode_kernel_sm80(const __grid_constant__ FwdParams p) {
  // The split-KV combine may start its blocks now; they wait for this grid's end before reading.
  allow_dependent_launch();
  using Tr = DecodeTraits<T, kHeadDim>;
  using QTile = typename Tr::QTile;
  using KVTile = typename Tr::KVTile;
  constexpr int kBlockN = Tr::kBlockN, kThreads = Tr::kThreads, kStages = Tr::kStages, kOTiles = Tr::kOTiles;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sKV = sQ + QTile::kElements;

  // One query tile per head; blocks are numbered heads first, so the blocks running at once read
  // the neighbouring heads of the same key rows (whole DRAM pages) rather than one head of rows
  // far apart.
  const int heads = int(gridDim.y), linear = int(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
  const FwdBlock blk = fwd_block(p, Tr::kBlockM, 0, (linear / heads) % p.num_splits, linear % heads,
                                 linear / (heads * p.num_splits));
  const int rows_q = blk.seqlen_q * p.pack;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row0 = lane / 4;  // packed row of (g); the block's rows start at 0

  const Mask mask{blk.seqlen_q, blk.seqlen_k, p.window_left, p.window_right};
  const KeyTiles tiles = key_tiles(p, blk, mask, Tr::kBlockM, kBlockN, p.pack);

  float acc_o[1][kOTiles][4];
#pragma unroll
  for (int ot = 0; ot < kOTiles; ++ot)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_o[0][ot][e] = 0.0f;
  RowStats<1> stats;
  stats.init();
  // ALiBi only without packing (the plan's rule): one slope for the block's head.
  const bool alibi = p.mod.has_alibi();
  const float slope_raw = alibi ? p.mod.slope(blk.batch, blk.head) / p.mod.scale : 0.0f;

  const int n_tiles = tiles.end - tiles.begin;
  if (n_tiles > 0) {
    const int kv_head = p.pack > 1 ? blk.head : blk.head / (p.heads_q / p.heads_kv);
    const int64_t qb = p.cu_seqlens_q ? 0 : blk.batch;
    const T* gQ = static_cast<const T*>(p.q) + qb * p.q_batch_stride + blk.q_row0 * p.q_row_stride;
    auto q_row = [&](int r) {
      return gQ + int64_t(r / p.pack) * p.q_row_stride + int64_t(blk.head * p.pack + r % p.pack) * p.q_head_stride;
    };
    load_tile_rows<QTile, kThreads>(sQ, q_row, rows_q, p.headdim_qk, p.vec_q);

    const T* gK = static_cast<const T*>(p.k) + kv_head * p.k_head_stride;
    const T* gV = static_cast<const T*>(p.v) + kv_head * p.v_head_stride;
    // Every page id (one fetch for K and V) is read a tile ahead, so a copy never waits on the
    // page table: with few blocks per SM (split-KV) a table read in front of each tile's copies
    // left the ring short of bytes in flight.
    constexpr bool by_warp = kGather == DecodeGather::warps, by_row = kGather == DecodeGather::rows;
    PagedRows<KVTile, kThreads> ids;
    int warp_page = 0;  // the next tile's page (whole-tile pages) or this warp's page of it
    auto fetch_ids = [&](int i) {
      if (!blk.key.pages || i >= n_tiles) return;
      const int key0 = (tiles.begin + i) * kBlockN;
      if constexpr (by_row) {
        ids.fetch(p.keys, blk.key.pages, key0, blk.seqlen_k - key0);
      } else {
        const int key = key0 + (by_warp ? warp * 16 : 0);
        warp_page = key < blk.seqlen_k ? load_page_id(blk.key.pages + p.keys.page_of(key)) : 0;
      }
    };
    auto load_stage = [&](int i) {  // key tile tiles.begin + i into stage i % kStages
      T* stage = sKV + (i % kStages) * Tr::kStageElements;
      const int key0 = (tiles.begin + i) * kBlockN, rows = blk.seqlen_k - key0;
      if constexpr (by_warp) {
        const int key = key0 + warp * 16;
        const int64_t page = clamp_to(warp_page, 0, p.keys.num_pages - 1), row = p.keys.row_in_page(key);
        load_warp_rows<KVTile, 16>(stage, warp * 16, gK + page * p.k_batch_stride + row * p.k_row_stride,
                                   p.k_row_stride, blk.seqlen_k - key, p.headdim_qk, p.vec_k);
        load_warp_rows<KVTile, 16>(stage + KVTile::kElements, warp * 16,
                                   gV + page * p.v_batch_stride + row * p.v_row_stride, p.v_row_stride,
                                   blk.seqlen_k - key, p.headdim_v, p.vec_v);
      } else if constexpr (!by_row) {
        int64_t k_off, v_off;
        if (blk.key.pages) {
          const int64_t page = clamp_to(warp_page, 0, p.keys.num_pages - 1), row = p.keys.row_in_page(key0);
          k_off = page * p.k_batch_stride + row * p.k_row_stride, v_off = page * p.v_batch_stride + row * p.v_row_stride;
        } else {
          k_off = key_offset(p.keys, blk.key, key0, p.k_batch_stride, p.k_row_stride);
          v_off = key_offset(p.keys, blk.key, key0, p.v_batch_stride, p.v_row_stride);
        }
        load_tile<KVTile, kThreads>(stage, gK + k_off, p.k_row_stride, rows, p.headdim_qk, p.vec_k);
        load_tile<KVTile, kThreads>(stage + KVTile::kElements, gV + v_off, p.v_row_stride, rows, p.headdim_v, p.vec_v);
      } else {
        ids.load(stage, gK, p.keys, key0, p.k_batch_stride, p.k_row_stride, rows, p.headdim_qk, p.vec_k);
        ids.load(stage + KVTile::kElements, gV, p.keys, key0, p.v_batch_stride, p.v_row_stride, rows, p.headdim_v,
                 p.vec_v);
      }
    };
#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) {
      fetch_ids(i);
      if (i < n_tiles) load_stage(i);
      cp_async_commit();  // empty groups keep the wait count uniform
    }
    fetch_ids(kStages - 1);

    const auto q_addr = QTile::lane_addresses(sQ, lane % 16, (lane / 16) * 8);
    // This warp's 16 keys of a stage, in the B layouts of S = Q K^T and (transposed) of O += P V.
    const auto kv_addr = KVTile::lane_addresses(sKV, lane % 8 + (lane / 16) * 8, ((lane / 8) % 2) * 8);
    constexpr int kStageBytes = Tr::kStageElements * int(sizeof(T));
    constexpr int kVOffset = KVTile::kElements * int(sizeof(T));

    for (int i = 0; i < n_tiles; ++i) {
      cp_async_wait<kStages - 2>();
      __syncthreads();  // tile i landed; every warp is done with the stage the next load reuses
      if (i + kStages - 1 < n_tiles) load_stage(i + kStages - 1);
      cp_async_commit();
      fetch_ids(i + kStages);

      const uint32_t stage = uint32_t((i % kStages) * kStageBytes);
      float s[1][2][4];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[0][nt][e] = 0.0f;
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks) {
        uint32_t a[4], b[4];
        ldmatrix_x4(a, QTile::address(q_addr, ks, 0));
        ldmatrix_x4(b, KVTile::address(kv_addr, ks, warp * 16) + stage);
        mma_m16n8k16<T>(s[0][0], a, b[0], b[1]);
        mma_m16n8k16<T>(s[0][1], a, b[2], b[3]);
      }

      if (p.softcap_pre > 0.0f) softcap_scores(s, p.softcap_pre, p.softcap_post);
      const int key0 = (tiles.begin + i) * kBlockN + warp * 16;
      if (alibi) alibi_scores(s, slope_raw, row0, key0, blk.seqlen_q, blk.seqlen_k);
      if (!(key0 >= tiles.full_begin && key0 + 16 <= tiles.full_end)) mask_scores(s, mask, row0, key0, p.pack);

      stats.update(s, acc_o, p.scale_log2);
      if (p.dropout.on) dropout_weights(s, p.dropout, blk.batch, blk.head, row0, key0, p.pack);
      uint32_t pa[4] = {pack2<T>(s[0][0][0], s[0][0][1]), pack2<T>(s[0][0][2], s[0][0][3]),
                        pack2<T>(s[0][1][0], s[0][1][1]), pack2<T>(s[0][1][2], s[0][1][3])};
#pragma unroll
      for (int dp = 0; dp < kOTiles / 2; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, KVTile::address(kv_addr, dp, warp * 16) + stage + kVOffset);
        mma_m16n8k16<T>(acc_o[0][2 * dp], pa, b[0], b[2]);
        mma_m16n8k16<T>(acc_o[0][2 * dp + 1], pa, b[1], b[3]);
      }
    }
    cp_async_wait<0>();
  }
  __syncthreads();  // the ring is free: it carries the exchange

  // Warps 1..3 hand their rows to warp 0, lane for lane (the same rows and columns), which folds
  // them in like split-KV partials and stores.
  float* exchange = reinterpret_cast<float*>(sKV);
  if (warp > 0) {
    float* x = exchange + (warp - 1) * Tr::kExchange * 32 + lane;
    x[0] = stats.max_log2[0][0], x[32] = stats.max_log2[0][1];
    x[64] = stats.sum[0][0], x[96] = stats.sum[0][1];
#pragma unroll
    for (int ot = 0; ot < kOTiles; ++ot)
#pragma unroll
      for (int e = 0; e < 4; ++e) x[(4 + 4 * ot + e) * 32] = acc_o[0][ot][e];
  }
  __syncthreads();
  if (warp > 0) return;
#pragma unroll 1
  for (int w = 0; w < Tr::kWarps - 1; ++w) {
    const float* x = exchange + w * Tr::kExchange * 32 + lane;
    float own[2], other[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float m_w = x[32 * half];
      const float m_new = fmaxf(stats.max_log2[0][half], m_w);
      own[half] = rescale_factor(stats.max_log2[0][half], m_new);
      other[half] = rescale_factor(m_w, m_new);
      stats.max_log2[0][half] = m_new;
      stats.sum[0][half] = stats.sum[0][half] * own[half] + x[64 + 32 * half] * other[half];
    }
#pragma unroll
    for (int ot = 0; ot < kOTiles; ++ot)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        acc_o[0][ot][e] = acc_o[0][ot][e] * own[e / 2] + x[(4 + 4 * ot + e) * 32] * other[e / 2];
  }
  store_fwd_output<T>(p, blk, row0, acc_o, stats);
}

}  // namespace tileattn::cuda
