#pragma once
// dQ on Hopper, its own pass: one block per (128 queries, head, batch), three warpgroups. The
// producer loads Q and dO once and streams K(j), V(j) of the key tiles these queries see; each
// consumer owns 64 queries:
//   S = Q K^T      dP = dO V^T       wgmma, all operands in shared memory
//   dS             from S, dP and the rows' L and D (bwd_grads.cuh, per element)
//   dQ += dS K     wgmma, dS from registers, K read N-major
// No atomics: every dQ element is summed by one thread in a fixed order. kAlibi: dS carries
// ALiBi's bias through P (bwd::grads_to_fragments, bwd_grads.cuh), in an instance of its own.
#include <cuda_runtime.h>

#include "common/mask.hpp"
#include "cuda/backward/bwd_grads.cuh"
#include "cuda/backward/bwd_launch.hpp"
#include "cuda/common/bwd_params.hpp"
#include "cuda/backward/bwd_tile_io.cuh"
#include "cuda/backward/bwd_params_sm90.hpp"
#include "cuda/backward/bwd_stream_sm90.cuh"
#include "cuda/arch/panel_tile_sm90.cuh"
#include "cuda/arch/pipeline_sm90.cuh"
#include "cuda/arch/ptx_sm90.cuh"
#include "cuda/arch/wgmma_ops.cuh"

namespace tileattn::cuda {

template <class T, int kHeadDim>
struct DqSm90Traits {
  using Roles = sm90::WarpRoles<2, 24, 240>;
  static constexpr int kConsumers = Roles::kConsumers;
  static constexpr int kThreads = Roles::kThreads;
  static constexpr int kBlockM = 64 * kConsumers;           // queries per block
  static constexpr int kBlockN = kHeadDim <= 64 ? 128 : 64;  // keys per step (registers: S, dP)
  static constexpr int kStages = 2;
  using QTile = sm90::PanelTile<kBlockM, kHeadDim>;
  using KVTile = sm90::PanelTile<kBlockN, kHeadDim>;
  using Barriers = BwdBarriers<kStages>;
  // Q, dO, then per stage K, V; then the barriers.
  static constexpr int kStageBytes = 2 * KVTile::kBytes;
  enum Region { kQ, kDout, kStagesRegion, kBarriers };
  using Smem = sm90::SmemRegions<QTile::kBytes, QTile::kBytes, kStages * kStageBytes, Barriers::kBytes>;
  static constexpr int kSmemBytes = Smem::kBytes;
  static_assert(kHeadDim % 16 == 0 && kHeadDim <= 128, "sm90 backward: head dims 16..128 in steps of 16");
  static_assert(bwd::kWorkspaceRowTile % kBlockM == 0, "query tiles never reach past the workspace padding");
};

template <class T, int kHeadDim, bool kAlibi>
__global__ void __launch_bounds__(DqSm90Traits<T, kHeadDim>::kThreads, 1)
    dq_kernel_sm90(const __grid_constant__ BwdSm90Params params) {
#if defined(TILEATTN_SM90_ENABLED)
  using Traits = DqSm90Traits<T, kHeadDim>;
  using Roles = typename Traits::Roles;
  using QTile = typename Traits::QTile;
  using KVTile = typename Traits::KVTile;
  constexpr int BM = Traits::kBlockM, BN = Traits::kBlockN;
  const bwd::BwdParams& p = params.bwd;

  extern __shared__ unsigned char smem_raw[];
  const typename Traits::Smem smem(smem_raw);
  unsigned char* sQ = smem.template at<Traits::kQ>();
  unsigned char* sdO = smem.template at<Traits::kDout>();
  auto stage_k = [&](int s) { return smem.template at<Traits::kStagesRegion>() + s * Traits::kStageBytes; };
  auto stage_v = [&](int s) { return stage_k(s) + KVTile::kBytes; };
  const typename Traits::Barriers bars(smem.template at<Traits::kBarriers, uint64_t>());
  const auto& ring = bars.ring;

  const bwd::SeqInfo seq = bwd::seq_info(p, int(blockIdx.z));
  if (BwdQueryBlock<BM, BN>::first_query() >= seq.sq) return;
  const BwdQueryBlock<BM, BN> qb(p, seq);
  const int h = qb.h, b = qb.b, q0 = qb.q0, q1 = qb.q1;

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
  const int row0 = 64 * consumer + 16 * warp;  // this warp's first tile row

  float dq[1][kHeadDim / 8][4];
#pragma unroll
  for (int j = 0; j < kHeadDim / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[0][j][e] = 0.0f;

  if (qb.keys.count > 0) {
    bwd::Fragment grads{nullptr, nullptr, {0.0f, 0.0f}, {0.0f, 0.0f}, 0, q0 + row0 + lane / 4, qb.mask};
    const int64_t w = bwd::ws_row(p, b, h) + q0 + row0 + lane / 4;  // rows past the end: padding
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      grads.row_lse2[half] = p.lse2[w + 8 * half];
      grads.row_dsum[half] = p.dsum[w + 8 * half];
    }
    const float slope = kAlibi ? p.mod.slope(b, h) : 0.0f;
    const uint32_t q_addr = smem_address(sQ) + consumer * 64 * 128;
    const uint32_t do_addr = smem_address(sdO) + consumer * 64 * 128;
    bars.wait_once();
    for (int i = 0; i < qb.keys.count; ++i) {
      const int s = i % Traits::kStages;  // in the loop's own words: see StageRing::wait_slot
      const int key0 = qb.key0(i);
      const uint32_t k_addr = smem_address(stage_k(s)), v_addr = smem_address(stage_v(s));
      ring.wait_slot(i, s);

      float st[1][BN / 8][4], dpt[1][BN / 8][4];
      score_products<T, BN, kHeadDim, QTile, KVTile>(st, dpt, q_addr, k_addr, do_addr, v_addr);

      uint32_t pa[BN / 16][4], da[BN / 16][4];
      grads.col0 = key0;
      bwd::grads_to_fragments<T, false, kAlibi>(qb.masked(key0), st, dpt, grads, p, pa, da, slope);

      const uint64_t k_desc = KVTile::n_major(k_addr, 0);
      sm90::fence_registers(dq[0]);
      sm90::wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < BN / 16; ++ks)
        sm90::Wgmma<T, kHeadDim>::template rs<1>(dq[0], da[ks], KVTile::n_step(k_desc, ks), 1);
      sm90::wgmma_commit();
      sm90::wgmma_wait<0>();
      sm90::fence_registers(dq[0]);
      ring.release_warp(i, lane);
    }
  }

  T* gdQ = static_cast<T*>(p.dq.ptr) + bwd::seq_base(p, p.dq, b, true) + int64_t(h) * p.dq.head +
           int64_t(q0 + row0) * p.dq.seq;
  bwd::store_grad_frag<T>(p.pair_grads, dq, p.scale, gdQ, p.dq.seq, q1 - q0 - row0, p.headdim_qk);
#endif
}

}  // namespace tileattn::cuda
