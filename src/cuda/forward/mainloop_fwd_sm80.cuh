#pragma once
// The sm80 forward kernel: one block per (query tile, head, batch[, key split]).
//
//   S = Q K^T      Q from shared memory, K tile j
//   P = exp2(S * scale_log2 - rowmax), with the online-softmax rescale of O
//   O += P V       P straight from the S accumulators (their layout is the A layout of the mma)
//
// Key tiles are visited from the last to the first: with a causal mask only the first tiles
// visited cross the diagonal, and the sequence-end tile comes first too, so the mask branch is
// taken early and the interior tiles run without mask arithmetic. K and V have one buffer each;
// the load of V(j) overlaps S = Q K(j)^T and the load of K(j-1) overlaps P V(j).
#include <cuda_runtime.h>

#include "common/mask.hpp"
#include "common/online_softmax.hpp"
#include "cuda/forward/fwd_block.cuh"
#include "cuda/arch/ptx_sm80.cuh"
#include "cuda/arch/smem_tile_sm80.cuh"
#include "cuda/common/fwd_params.hpp"
#include "cuda/forward/fwd_tile_size.hpp"
#include "cuda/forward/softmax_fwd_sm80.cuh"

namespace tileattn::cuda {

template <class T, int kHeadDim>
struct FwdTraits {
  static constexpr FwdTileSize kTile = fwd_tile_size(kHeadDim);
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kWarps = kTile.warps;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kMTiles = kBlockM / (16 * kWarps);  // 16-row mma tiles per warp
  static constexpr int kSTiles = kBlockN / 8;               // n-tiles of S
  static constexpr int kOTiles = kHeadDim / 8;              // n-tiles of O
  static_assert(kBlockM % (16 * kWarps) == 0 && kBlockN % 16 == 0 && kHeadDim % 32 == 0);

  using QTile = SmemTile<kBlockM, kHeadDim>;
  using KVTile = SmemTile<kBlockN, kHeadDim>;
  static constexpr int kSmemBytes = int(sizeof(T)) * (QTile::kElements + 2 * KVTile::kElements);
};

// kDropout: a separate instance, so that the Philox code's registers never weigh on the plain
// loop (in one kernel with a uniform branch, head dim 128 spilled 188 bytes).
template <class T, int kHeadDim, bool kDropout>
__global__ void __launch_bounds__(FwdTraits<T, kHeadDim>::kThreads)
    fwd_kernel_sm80(const __grid_constant__ FwdParams p) {
  using Traits = FwdTraits<T, kHeadDim>;
  using QTile = typename Traits::QTile;
  using KVTile = typename Traits::KVTile;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kThreads = Traits::kThreads;
  constexpr int kMTiles = Traits::kMTiles, kSTiles = Traits::kSTiles, kOTiles = Traits::kOTiles;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + QTile::kElements;
  T* sV = sK + KVTile::kElements;

  const FwdBlock blk = fwd_block_of_this_cta(p, kBlockM);
  const int rows_q = blk.seqlen_q * p.pack;  // the sequence's (packed) query rows
  if (blk.m0 >= rows_q) return;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // Which rows a warp owns rotates with the block: in a tile with only a few rows (decoding) the
  // one working warp of each co-resident block then sits on a different SM sub-partition (warp
  // w runs on sub-partition w % 4) instead of all on the first.
  const int warp_row = ((warp + int(blockIdx.x)) % Traits::kWarps) * kMTiles * 16;  // first tile row of this warp
  const int row0 = blk.m0 + warp_row + lane / 4;      // sequence row of (m-tile 0, g)
  // A warp (or m-tile) whose rows all lie past the sequence still loads its share of K and V
  // but computes nothing.
  const bool warp_has_rows = blk.m0 + warp_row < rows_q;
  bool mtile_has_rows[kMTiles];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) mtile_has_rows[mt] = mt == 0 || blk.m0 + warp_row + mt * 16 < rows_q;

  const Mask mask{blk.seqlen_q, blk.seqlen_k, p.window_left, p.window_right};
  const KeyTiles tiles = key_tiles(p, blk, mask, kBlockM, kBlockN, p.pack);
  const int n_begin = tiles.begin, n_end = tiles.end, full_begin = tiles.full_begin, full_end = tiles.full_end;

  float acc_o[kMTiles][kOTiles][4];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int ot = 0; ot < kOTiles; ++ot)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mt][ot][e] = 0.0f;
  RowStats<kMTiles> stats;
  stats.init();
  // One branch per tile decides the bias: without slopes the loop does no ALiBi work.
  const bool alibi = p.mod.has_alibi();
  const float slope_raw = alibi ? p.mod.slope(blk.batch, blk.head) / p.mod.scale : 0.0f;

  if (n_begin < n_end) {
    const int kv_head = p.pack > 1 ? blk.head : blk.head / (p.heads_q / p.heads_kv);
    const int64_t qb = p.cu_seqlens_q ? 0 : blk.batch;
    const T* gQ = static_cast<const T*>(p.q) + qb * p.q_batch_stride + (blk.q_row0 + blk.m0) * p.q_row_stride +
                  blk.head * p.q_head_stride;
    const T* gK = static_cast<const T*>(p.k) + kv_head * p.k_head_stride;
    const T* gV = static_cast<const T*>(p.v) + kv_head * p.v_head_stride;
    // Pages holding whole tiles read like any strided block; shorter pages are gathered row by row.
    const bool gather = blk.key.pages && p.keys.page_size % kBlockN != 0;
    auto load_kv = [&](T* tile, const T* g, int64_t batch_stride, int64_t row_stride, int n, int dim, bool vec) {
      const int key0 = n * kBlockN;
      if (!gather) {
        load_tile<KVTile, kThreads>(tile, g + key_offset(p.keys, blk.key, key0, batch_stride, row_stride), row_stride,
                                    blk.seqlen_k - key0, dim, vec);
      } else {
        load_tile_paged<KVTile, kThreads>(tile, g, p.keys, blk.key.pages, key0, batch_stride, row_stride,
                                          blk.seqlen_k - key0, dim, vec);
      }
    };
    auto load_k = [&](int n) { load_kv(sK, gK, p.k_batch_stride, p.k_row_stride, n, p.headdim_qk, p.vec_k); };
    auto load_v = [&](int n) { load_kv(sV, gV, p.v_batch_stride, p.v_row_stride, n, p.headdim_v, p.vec_v); };

    if (p.pack == 1) {
      load_tile<QTile, kThreads>(sQ, gQ, p.q_row_stride, blk.seqlen_q - blk.m0, p.headdim_qk, p.vec_q);
    } else {
      const T* gQ0 = static_cast<const T*>(p.q) + qb * p.q_batch_stride + blk.q_row0 * p.q_row_stride;
      auto row_address = [&](int r) {
        const int packed = blk.m0 + r;
        return gQ0 + int64_t(packed / p.pack) * p.q_row_stride + int64_t(blk.head * p.pack + packed % p.pack) * p.q_head_stride;
      };
      load_tile_rows<QTile, kThreads>(sQ, row_address, rows_q - blk.m0, p.headdim_qk, p.vec_q);
    }
    load_k(n_end - 1);
    cp_async_commit();

    // ldmatrix row addresses of this lane (see common/ptx.cuh for the fragment layouts).
    const auto q_addr = QTile::lane_addresses(sQ, warp_row + lane % 16, (lane / 16) * 8);            // Q as A
    // K and V share one lane pattern (matrices: rows 0-7 | cols 0-7, 8-15, then rows 8-15), so
    // V's addresses are K's plus a constant; for V (transposed) that pattern yields the
    // registers in the order {b0 of n-tile 0, b0 of n-tile 1, b1 of n-tile 0, b1 of n-tile 1}.
    const auto kv_addr = KVTile::lane_addresses(sK, lane % 8 + (lane / 16) * 8, ((lane / 8) % 2) * 8);
    constexpr int kVOffset = KVTile::kElements * int(sizeof(T));

    for (int n = n_end - 1; n >= n_begin; --n) {
      cp_async_wait<0>();
      __syncthreads();  // K(n) landed; every warp is done with V(n+1)
      load_v(n);
      cp_async_commit();

      // S = Q K^T
      float s[kMTiles][kSTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kSTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.0f;
      if (warp_has_rows) {
#pragma unroll
        for (int ks = 0; ks < kHeadDim / 16; ++ks) {
          uint32_t a[kMTiles][4];
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt)
            if (mtile_has_rows[mt]) ldmatrix_x4(a[mt], QTile::address(q_addr, ks, mt * 16));
#pragma unroll
          for (int np = 0; np < kSTiles / 2; ++np) {
            uint32_t b[4];
            ldmatrix_x4(b, KVTile::address(kv_addr, ks, np * 16));
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
              if (!mtile_has_rows[mt]) continue;
              mma_m16n8k16<T>(s[mt][2 * np], a[mt], b[0], b[1]);
              mma_m16n8k16<T>(s[mt][2 * np + 1], a[mt], b[2], b[3]);
            }
          }
        }
      }

      if (p.softcap_pre > 0.0f) softcap_scores(s, p.softcap_pre, p.softcap_post);
      const int key0 = n * kBlockN;
      if (alibi) alibi_scores(s, slope_raw, row0, key0, blk.seqlen_q, blk.seqlen_k);
      const bool interior = key0 >= full_begin && key0 + kBlockN <= full_end;
      if (!interior) mask_scores(s, mask, row0, key0, p.pack);

      cp_async_wait<0>();
      __syncthreads();  // V(n) landed; every warp is done with K(n)

      stats.update(s, acc_o, p.scale_log2);
      if constexpr (kDropout) dropout_weights(s, p.dropout, blk.batch, blk.head, row0, key0, p.pack);
      // P rounded to T, in the A layout of the P V mma (an S n-tile pair is one A k-step).
      uint32_t pa[kMTiles][kBlockN / 16][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int ks = 0; ks < kBlockN / 16; ++ks) {
          pa[mt][ks][0] = pack2<T>(s[mt][2 * ks][0], s[mt][2 * ks][1]);
          pa[mt][ks][1] = pack2<T>(s[mt][2 * ks][2], s[mt][2 * ks][3]);
          pa[mt][ks][2] = pack2<T>(s[mt][2 * ks + 1][0], s[mt][2 * ks + 1][1]);
          pa[mt][ks][3] = pack2<T>(s[mt][2 * ks + 1][2], s[mt][2 * ks + 1][3]);
        }
      // Issued once S is packed: the copy's address registers then do not compete with fp32 S.
      if (n > n_begin) {
        load_k(n - 1);
        cp_async_commit();
      }

      // O += P V
      if (warp_has_rows) {
#pragma unroll
        for (int ks = 0; ks < kBlockN / 16; ++ks)
#pragma unroll
          for (int dp = 0; dp < kOTiles / 2; ++dp) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, KVTile::address(kv_addr, dp, ks * 16) + kVOffset);
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
              if (!mtile_has_rows[mt]) continue;
              mma_m16n8k16<T>(acc_o[mt][2 * dp], pa[mt][ks], b[0], b[2]);
              mma_m16n8k16<T>(acc_o[mt][2 * dp + 1], pa[mt][ks], b[1], b[3]);
            }
          }
      }
    }
  }

  // Rows that saw no key keep sum 0: O = 0 and L = -inf.
  store_fwd_output<T>(p, blk, row0, acc_o, stats);
}

}  // namespace tileattn::cuda
