#pragma once
// dQ on Hopper for head dims above 128, its own pass (the deterministic mode): one block per (64
// queries, head, batch), three warpgroups. The producer loads Q and dO once and streams K(j), V(j)
// of the key tiles these queries see. dQ of 64 queries at D = 256 is 128 fp32 registers per
// thread for one warpgroup alone, so the consumers split the head dim for dQ, as the wide dK/dV
// kernel does (bwd_kernel_wide_sm90.cuh), and the keys of a step for S and dP:
//   S, dP   of the 64 queries and its 32 keys      Q K_c^T, dO V_c^T (operands in shared memory)
//   dS      of its 32 keys into shared memory;  both consumers' halves make the step's tile
//   dQ_c += dS K_c                                  its columns [128 c, ...) (192: 128 + 64)
// dS has two buffers, so one named barrier a step (kBwdPdsReady: both halves written) orders a
// buffer's writes after the other consumer's reads of it two steps before. No atomics: every dQ
// element is summed by one thread in a fixed order. kAlibi: dS carries ALiBi's bias through P
// (bwd::grads_to_fragments, bwd_grads.cuh), in an instance of its own.
#include <cuda_runtime.h>

#include <type_traits>

#include "common/mask.hpp"
#include "cuda/arch/panel_tile_sm90.cuh"
#include "cuda/arch/pipeline_sm90.cuh"
#include "cuda/arch/ptx_sm90.cuh"
#include "cuda/arch/wgmma_ops.cuh"
#include "cuda/backward/bwd_dq_tiles_sm90.cuh"
#include "cuda/backward/bwd_grads.cuh"
#include "cuda/backward/bwd_launch.hpp"
#include "cuda/backward/bwd_params_sm90.hpp"
#include "cuda/backward/bwd_stream_sm90.cuh"
#include "cuda/backward/bwd_tile_io.cuh"
#include "cuda/common/bwd_params.hpp"

namespace tileattn::cuda {

template <class T, int kHeadDim>
struct DqWideSm90Traits {
  using Roles = sm90::WarpRoles<2, 24, 240>;
  static constexpr int kConsumers = Roles::kConsumers;
  static constexpr int kThreads = Roles::kThreads;
  static constexpr int kBlockM = 64;  // queries per block
  static constexpr int kBlockN = 64;  // keys per step, 32 per consumer for S and dP
  static constexpr int kStages = 2;
  using QTile = sm90::PanelTile<kBlockM, kHeadDim>;
  using KVTile = sm90::PanelTile<kBlockN, kHeadDim>;
  using DsTile = sm90::PanelTile<kBlockM, kBlockN>;  // queries x keys
  static constexpr int kCols0 = DqTileOrder<kHeadDim>::kPartCols;  // consumer 0's columns of dQ
  using Barriers = BwdBarriers<kStages>;
  // Q, dO, then per stage K, V; two dS tiles; the barriers.
  static constexpr int kStageBytes = 2 * KVTile::kBytes;
  enum Region { kQ, kDout, kStagesRegion, kDs, kBarriers };
  using Smem = sm90::SmemRegions<QTile::kBytes, QTile::kBytes, kStages * kStageBytes, 2 * DsTile::kBytes,
                                 Barriers::kBytes>;
  static constexpr int kSmemBytes = Smem::kBytes;
  static constexpr int kConsumerThreads = 128 * kConsumers;
  static_assert(kHeadDim % 64 == 0 && kHeadDim > 128 && kHeadDim <= 256, "wide sm90 dQ: head dims 192, 256");
  static_assert(bwd::kWorkspaceRowTile % kBlockM == 0, "query tiles never reach past the workspace padding");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory");
};

template <class T, int kHeadDim, bool kAlibi>
__global__ void __launch_bounds__(DqWideSm90Traits<T, kHeadDim>::kThreads, 1)
    dq_kernel_wide_sm90(const __grid_constant__ BwdSm90Params params) {
#if defined(TILEATTN_SM90_ENABLED)
  using Traits = DqWideSm90Traits<T, kHeadDim>;
  using Roles = typename Traits::Roles;
  using QTile = typename Traits::QTile;
  using KVTile = typename Traits::KVTile;
  using DsTile = typename Traits::DsTile;
  constexpr int BM = Traits::kBlockM, BN = Traits::kBlockN;
  const bwd::BwdParams& p = params.bwd;

  extern __shared__ unsigned char smem_raw[];
  const typename Traits::Smem smem(smem_raw);
  unsigned char* sQ = smem.template at<Traits::kQ>();
  unsigned char* sdO = smem.template at<Traits::kDout>();
  auto stage_k = [&](int s) { return smem.template at<Traits::kStagesRegion>() + s * Traits::kStageBytes; };
  auto stage_v = [&](int s) { return stage_k(s) + KVTile::kBytes; };
  unsigned char* sdS = smem.template at<Traits::kDs>();
  const typename Traits::Barriers bars(smem.template at<Traits::kBarriers, uint64_t>());
  const auto& ring = bars.ring;

  const bwd::SeqInfo seq = bwd::seq_info(p, int(blockIdx.z));
  if (BwdQueryBlock<BM, BN>::first_query() >= seq.sq) return;
  const BwdQueryBlock<BM, BN> qb(p, seq);

  bars.init(4 * Traits::kConsumers);  // one release per consumer warp

  const Roles roles;
  if (roles.warpgroup == 0) {
    Roles::enter_producer();
    if (threadIdx.x == 0 && qb.keys.count > 0) load_query_block<QTile, KVTile>(params, qb, sQ, sdO, stage_k, stage_v, bars);
    return;
  }

  Roles::enter_consumer();
  const int consumer = roles.consumer();
  const int warp = Roles::warp(), lane = Roles::lane();
  const int row = 16 * warp + lane / 4;         // tile row (query) of (g, e < 2)
  const int col0 = Traits::kCols0 * consumer;  // this consumer's first column of dQ

  auto run = [&](auto cols) {
    constexpr int kCols = decltype(cols)::value;
    float dq[1][kCols / 8][4];
#pragma unroll
    for (int j = 0; j < kCols / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) dq[0][j][e] = 0.0f;

    if (qb.keys.count > 0) {
      bwd::Fragment grads{nullptr, nullptr, {0.0f, 0.0f}, {0.0f, 0.0f}, 0, qb.q0 + row, qb.mask};
      const int64_t w = bwd::ws_row(p, qb.b, qb.h) + qb.q0 + row;  // rows past the end: padding
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        grads.row_lse2[half] = p.lse2[w + 8 * half];
        grads.row_dsum[half] = p.dsum[w + 8 * half];
      }
      const float slope = kAlibi ? p.mod.slope(qb.b, qb.h) : 0.0f;
      const uint32_t q_addr = smem_address(sQ), do_addr = smem_address(sdO);
      const uint32_t panel0 = (col0 / 64) * KVTile::kPanelBytes;  // the consumer's columns of K
      bars.wait_once();
      for (int i = 0; i < qb.keys.count; ++i) {
        const int s = i % Traits::kStages;  // in the loop's own words: see StageRing::wait_slot
        const int key0 = qb.key0(i);
        const uint32_t k_addr = smem_address(stage_k(s)), v_addr = smem_address(stage_v(s));
        unsigned char* ds_tile = sdS + (i % 2) * DsTile::kBytes;
        ring.wait_slot(i, s);

        // This consumer's 32 keys: rows 32 c.. of the K and V panels (4 KB apart: swizzle-aligned).
        float st[1][BN / 16][4], dpt[1][BN / 16][4];
        score_products<T, BN / 2, kHeadDim, QTile, KVTile>(st, dpt, q_addr, k_addr + consumer * 32 * 128, do_addr,
                                                           v_addr + consumer * 32 * 128);

        uint32_t pa[BN / 32][4], da[BN / 32][4];
        grads.col0 = key0 + 32 * consumer;
        bwd::grads_to_fragments<T, false, kAlibi>(qb.masked(key0), st, dpt, grads, p, pa, da, slope);

        // Into the (queries x keys) tile: A fragment (ks, i) holds rows g + 8 (i % 2) and this
        // consumer's columns 32 c + 16 ks + 8 (i / 2) + 2 t, + 1.
#pragma unroll
        for (int ks = 0; ks < BN / 32; ++ks)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = row + 8 * (e % 2), chunk = 4 * consumer + 2 * ks + e / 2;
            *reinterpret_cast<uint32_t*>(ds_tile + r * 128 + ((chunk ^ (r % 8)) * 16) + 4 * (lane % 4)) = da[ks][e];
          }
        sm90::fence_shared_to_async();
        sm90::named_barrier_sync(sm90::kBwdPdsReady, Traits::kConsumerThreads);

        const uint64_t ds_k = DsTile::k_major(smem_address(ds_tile), 0);
        const uint64_t k_n = KVTile::n_major(k_addr + panel0, 0);
        sm90::fence_registers(dq[0]);
        sm90::wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < BN / 16; ++ks)
          sm90::Wgmma<T, kCols>::template ss<0, 1>(dq[0], DsTile::k_step(ds_k, ks), KVTile::n_step(k_n, ks), 1);
        sm90::wgmma_commit();
        sm90::wgmma_wait<0>();
        sm90::fence_registers(dq[0]);
        ring.release_warp(i, lane);
      }
    }

    T* gdQ = static_cast<T*>(p.dq.ptr) + bwd::seq_base(p, p.dq, qb.b, true) + int64_t(qb.h) * p.dq.head +
             int64_t(qb.q0 + 16 * warp) * p.dq.seq + col0;
    bwd::store_grad_frag<T>(p.pair_grads, dq, p.scale, gdQ, p.dq.seq, qb.q1 - qb.q0 - 16 * warp, p.headdim_qk - col0);
  };
  if (consumer == 0) run(std::integral_constant<int, Traits::kCols0>{});
  else run(std::integral_constant<int, kHeadDim - Traits::kCols0>{});
#endif
}

}  // namespace tileattn::cuda
