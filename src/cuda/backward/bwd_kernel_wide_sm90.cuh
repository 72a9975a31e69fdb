#pragma once
// The Hopper backward for head dims above 128: one block per (64 keys, batch, kv head), three
// warpgroups. dK and dV of 64 keys at D = 256 are 128 fp32 registers per thread for one
// warpgroup alone, so the consumers split the head dim instead of the keys: consumer c owns
// columns [128 c, 128 c + 128) of dK, dV and dQ (192 splits 128 + 64), and each step shares the
// tile's P^T and dS^T through shared memory:
//   S^T, dP^T  of its 32 queries     K Q_c^T, V dO_c^T (all 64 keys; operands in shared memory)
//   P^T, dS^T  of its 32 queries     into shared memory; both consumers' halves make the tile
//   dV_c += P^T dO_c    dK_c += dS^T Q_c    dQ_c = dS K_c      A from shared memory (dS M-major)
// dQ_c leaves through the stage's own Q and dO buffers (an fp32 tile is exactly their size): the
// dQ warp adds the tile to the workspace accumulator with one bulk reduction and only then frees
// the stage, so the producer reloads it. dK and dV sum over the group in registers and are
// written once. Named barriers (pipeline_sm90.cuh): kBwdPdsReady the step's P^T and dS^T
// written; kBwdDqFull a dQ tile written (consumers arrive, the dQ warp waits); kBwdStepDone both
// consumers' products of the step done.
// kFusedDq = false (the deterministic mode): dK and dV only; every consumer warp frees the stage
// once its products are read, and dQ has its own pass (bwd_dq_kernel_wide_sm90.cuh).
// kAlibi: P carries ALiBi's bias (bwd::grads_to_fragments, bwd_grads.cuh), in an instance of its own.
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
struct BwdWideSm90Traits {
  using Roles = sm90::WarpRoles<2, 24, 240>;
  static constexpr int kConsumers = Roles::kConsumers;
  static constexpr int kThreads = Roles::kThreads;
  static constexpr int kBlockN = 64;  // keys per block
  static constexpr int kBlockM = 64;  // queries per step, 32 per consumer for S^T and dP^T
  static constexpr int kStages = 2;
  using KVTile = sm90::PanelTile<kBlockN, kHeadDim>;
  using QTile = sm90::PanelTile<kBlockM, kHeadDim>;
  using PTile = sm90::PanelTile<kBlockN, kBlockM>;  // P^T and dS^T: keys x queries
  using DqOrder = DqTileOrder<kHeadDim>;
  static constexpr int kCols0 = DqOrder::kPartCols;  // consumer 0's columns; consumer 1 has the rest
  using Stages = BwdStages<QTile, kBlockM, kStages>;
  using Barriers = BwdBarriers<kStages>;
  // K, V, then per stage: Q, dO (the dQ tile after them), L * log2(e), D (rounded up to 1024
  // bytes: the swizzle is on address bits); then P^T, dS^T and the barriers.
  enum Region { kK, kV, kStagesRegion, kP, kDs, kBarriers };
  using Smem = sm90::SmemRegions<KVTile::kBytes, KVTile::kBytes, (kStages * Stages::kBytes + 1023) / 1024 * 1024,
                                 PTile::kBytes, PTile::kBytes, Barriers::kBytes>;
  static constexpr int kSmemBytes = Smem::kBytes;
  static constexpr int kConsumerThreads = 128 * kConsumers;
  static constexpr int kDqBarrierThreads = kConsumerThreads + 32;
  static_assert(kHeadDim % 64 == 0 && kHeadDim > 128 && kHeadDim <= 256, "wide sm90 backward: head dims 192, 256");
  static_assert(DqOrder::kBlockM == kBlockM && !DqOrder::kSplitRows, "one tile shape");
  static_assert(kBlockM * kHeadDim * 4 == 2 * QTile::kBytes, "the fp32 dQ tile fills the stage's Q and dO");
  static_assert(bwd::kWorkspaceRowTile % kBlockM == 0, "query tiles never reach past the workspace padding");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory");
};

template <class T, int kHeadDim, bool kFusedDq, bool kAlibi>
__global__ void __launch_bounds__(BwdWideSm90Traits<T, kHeadDim>::kThreads, 1)
    bwd_kernel_wide_sm90(const __grid_constant__ BwdSm90Params params) {
#if defined(TILEATTN_SM90_ENABLED)
  using Traits = BwdWideSm90Traits<T, kHeadDim>;
  using Roles = typename Traits::Roles;
  using KVTile = typename Traits::KVTile;
  using QTile = typename Traits::QTile;
  using PTile = typename Traits::PTile;
  constexpr int BN = Traits::kBlockN, BM = Traits::kBlockM, kStages = Traits::kStages;
  const bwd::BwdParams& p = params.bwd;

  extern __shared__ unsigned char smem_raw[];
  const typename Traits::Smem smem(smem_raw);
  unsigned char* sK = smem.template at<Traits::kK>();
  unsigned char* sV = smem.template at<Traits::kV>();
  const typename Traits::Stages stages{smem.template at<Traits::kStagesRegion>()};
  unsigned char* sP = smem.template at<Traits::kP>();
  unsigned char* sdS = smem.template at<Traits::kDs>();
  const typename Traits::Barriers bars(smem.template at<Traits::kBarriers, uint64_t>());
  const auto& ring = bars.ring;

  const BwdKeyBlock<BN, BM> kb(p);
  if (kb.k0 >= kb.seq.sk) return;
  const int n_iter = kb.n_iter;

  // The dQ warp frees a stage once the stage's dQ tile is read; without it, each consumer warp.
  bars.init(kFusedDq ? 1 : 4 * Traits::kConsumers);

  const Roles roles;
  if (roles.warpgroup == 0) {
    Roles::enter_producer();
    if (kFusedDq && threadIdx.x / 32 == 1) {
      // The dQ warp: the tile lies over its stage's Q and dO, so the stage is free once the
      // reduction has read it.
      reduce_dq_tiles<kHeadDim, 2 * QTile::kBytes, 1, 2 * QTile::kBytes, Traits::kDqBarrierThreads, false>(
          p, kb, n_iter, sm90::kBwdDqFull, [stages](int it) { return reinterpret_cast<const float*>(stages.q(it % kStages)); },
          [ring](int it, int) { ring.release(it); }, [](int, int) {});
      return;
    }
    if (threadIdx.x == 0 && n_iter > 0) load_key_block<KVTile>(params, kb, sK, sV, stages, bars);
    return;
  }

  Roles::enter_consumer();
  const int consumer = roles.consumer();
  const int warp = Roles::warp(), lane = Roles::lane();
  const int key_row = 16 * warp + lane / 4;  // tile row of (g, e < 2)
  const int col0 = Traits::kCols0 * consumer;   // this consumer's first column of dK, dV, dQ

  auto run = [&](auto cols) {
    constexpr int kCols = decltype(cols)::value;
    float dk[1][kCols / 8][4], dv[1][kCols / 8][4];
#pragma unroll
    for (int j = 0; j < kCols / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[0][j][e] = dv[0][j][e] = 0.0f;

    if (n_iter > 0) {
      const uint32_t k_addr = smem_address(sK), v_addr = smem_address(sV);
      const uint32_t p_addr = smem_address(sP), ds_addr = smem_address(sdS);
      const uint32_t panel0 = (col0 / 64) * KVTile::kPanelBytes;  // the consumer's columns, in K, Q, dO
      bars.wait_once();
      for (int it = 0; it < n_iter; ++it) {
        const int s = it % kStages;  // in the loop's own words: see StageRing::wait_slot
        const int q0 = kb.q0(it);
        const uint32_t q_addr = smem_address(stages.q(s)), do_addr = smem_address(stages.dout(s));
        const float slope = kAlibi ? p.mod.slope(kb.b, kb.head(it)) : 0.0f;
        ring.wait_slot(it, s);

        // This consumer's 32 queries: rows 32 c.. of the Q and dO panels (4 KB apart: swizzle-aligned).
        float st[1][BM / 16][4], dpt[1][BM / 16][4];
        score_products<T, BM / 2, kHeadDim, KVTile, QTile>(st, dpt, k_addr, q_addr + consumer * 32 * 128, v_addr,
                                                           do_addr + consumer * 32 * 128);

        const int q1 = min(q0 + BM, kb.seq.sq);
        const bool masked = !(kb.mask.full_begin_key(q1) <= kb.k0 && kb.mask.full_end_key(q0) >= kb.k0 + BN);
        uint32_t pa[BM / 32][4], da[BM / 32][4];
        const bwd::Fragment grads{stages.lse2(s) + 32 * consumer, stages.dsum(s) + 32 * consumer, {0.0f, 0.0f},
                                  {0.0f, 0.0f}, q0 + 32 * consumer, kb.k0 + key_row, kb.mask};
        bwd::grads_to_fragments<T, true, kAlibi>(masked, st, dpt, grads, p, pa, da, slope);

        // Into the (keys x queries) tiles: A fragment (ks, i) holds rows g + 8 (i % 2) and this
        // consumer's columns 32 c + 16 ks + 8 (i / 2) + 2 t, + 1.
#pragma unroll
        for (int ks = 0; ks < BM / 32; ++ks)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int r = key_row + 8 * (i % 2), chunk = 4 * consumer + 2 * ks + i / 2;
            const int at = r * 128 + ((chunk ^ (r % 8)) * 16) + 4 * (lane % 4);
            *reinterpret_cast<uint32_t*>(sP + at) = pa[ks][i];
            *reinterpret_cast<uint32_t*>(sdS + at) = da[ks][i];
          }
        sm90::fence_shared_to_async();
        sm90::named_barrier_sync(sm90::kBwdPdsReady, Traits::kConsumerThreads);

        [[maybe_unused]] float dq[1][kCols / 8][4];
        const uint64_t p_k = PTile::k_major(p_addr, 0), ds_k = PTile::k_major(ds_addr, 0);
        [[maybe_unused]] const uint64_t ds_n = PTile::n_major(ds_addr, 0), k_n = KVTile::n_major(k_addr + panel0, 0);
        const uint64_t do_n = QTile::n_major(do_addr + panel0, 0), q_n = QTile::n_major(q_addr + panel0, 0);
        sm90::fence_registers(dv[0]);
        sm90::fence_registers(dk[0]);
        sm90::wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < BM / 16; ++ks)
          sm90::Wgmma<T, kCols>::template ss<0, 1>(dv[0], PTile::k_step(p_k, ks), QTile::n_step(do_n, ks), 1);
#pragma unroll
        for (int ks = 0; ks < BM / 16; ++ks)
          sm90::Wgmma<T, kCols>::template ss<0, 1>(dk[0], PTile::k_step(ds_k, ks), QTile::n_step(q_n, ks), 1);
        if constexpr (kFusedDq) {
#pragma unroll
          for (int ks = 0; ks < BN / 16; ++ks)
            sm90::Wgmma<T, kCols>::template ss<1, 1>(dq[0], PTile::n_step(ds_n, ks), KVTile::n_step(k_n, ks), ks > 0);
        }
        sm90::wgmma_commit();
        sm90::wgmma_wait<0>();
        sm90::fence_registers(dv[0]);
        sm90::fence_registers(dk[0]);
        if constexpr (kFusedDq) {
          sm90::fence_registers(dq[0]);
          // Both consumers' reads of the stage's Q and dO (and of P^T, dS^T) are done: the dQ
          // tile goes over them.
          sm90::named_barrier_sync(sm90::kBwdStepDone, Traits::kConsumerThreads);
          float* dq_part = reinterpret_cast<float*>(stages.q(s)) + consumer * Traits::DqOrder::kPartFloats +
                           4 * (int(threadIdx.x) % 128);
#pragma unroll
          for (int j = 0; j < kCols / 8; ++j)
            *reinterpret_cast<float4*>(dq_part + j * 512) =
                make_float4(dq[0][j][0], dq[0][j][1], dq[0][j][2], dq[0][j][3]);
          sm90::fence_shared_to_async();
          sm90::named_barrier_arrive(sm90::kBwdDqFull, Traits::kDqBarrierThreads);
        } else {
          // The stage is read; P^T and dS^T are written again only once both consumers read them.
          ring.release_warp(it, lane);
          sm90::named_barrier_sync(sm90::kBwdStepDone, Traits::kConsumerThreads);
        }
      }
    }

    kb.template store_grads<T>(p, 16 * warp, col0, dk, dv);
  };
  if (consumer == 0) run(std::integral_constant<int, Traits::kCols0>{});
  else run(std::integral_constant<int, kHeadDim - Traits::kCols0>{});
#endif
}

}  // namespace tileattn::cuda
