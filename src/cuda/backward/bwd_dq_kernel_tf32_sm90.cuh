#pragma once
// dQ of fp32 attention in fast mode on Hopper (TF32 wgmma), its own pass: one block per (128
// queries, head, batch), three warpgroups, the 16-bit dQ pass's shape (bwd_dq_kernel_sm90.cuh):
//   producer warp 0     one thread loads Q and dO once and streams K(j), V(j) of the key tiles
//                       these queries see
//   producer warps 1-3  rewrite each K(j) K-major with its keys as rows' positions (K^T; TF32
//                       wgmma reads no N-major operand) into one of two buffers
//   consumers           64 queries each:
//     S = Q K^T     dP = dO V^T     wgmma, Q and dO in registers (read once), K and V in shared
//                                   memory
//     dS            rounded to TF32 in the A-fragment layout (bwd::grads_to_fragments)
//     dQ += dS K    wgmma, B = K^T
// No atomics: every dQ element is summed by one thread in a fixed order.
#include <cuda_runtime.h>

#include "common/mask.hpp"
#include "cuda/arch/panel_tile_sm90.cuh"
#include "cuda/arch/pipeline_sm90.cuh"
#include "cuda/arch/ptx_sm90.cuh"
#include "cuda/arch/tf32_operands_sm90.cuh"
#include "cuda/arch/wgmma_ops.cuh"
#include "cuda/backward/bwd_grads.cuh"
#include "cuda/backward/bwd_launch.hpp"
#include "cuda/backward/bwd_params_sm90.hpp"
#include "cuda/backward/bwd_stream_sm90.cuh"
#include "cuda/backward/bwd_tile_io.cuh"
#include "cuda/common/bwd_params.hpp"

namespace tileattn::cuda {

template <int kHeadDim>
struct DqTf32Sm90Traits {
  using Roles = sm90::WarpRoles<2, 40, 232>;
  static constexpr int kConsumers = Roles::kConsumers;
  static constexpr int kThreads = Roles::kThreads;
  static constexpr int kTransposeThreads = 96;     // producer warps 1-3
  static constexpr int kBlockM = 64 * kConsumers;  // queries per block
  static constexpr int kBlockN = 64;               // keys per step
  static constexpr int kStages = 2;
  using QTile = sm90::PanelTile<kBlockM, kHeadDim, 4>;
  using KVTile = sm90::PanelTile<kBlockN, kHeadDim, 4>;
  using KT = sm90::Tf32Transposed<kBlockN, kHeadDim>;  // K^T of a step
  using Barriers = BwdBarriers<kStages>;
  using TRing = sm90::StageRing<2>;
  // Q, dO, then per stage K, V; two K^T buffers; the barriers (the transposed ring's last).
  static constexpr int kStageBytes = 2 * KVTile::kBytes;
  enum Region { kQ, kDout, kStagesRegion, kTransposed, kBarriers };
  using Smem = sm90::SmemRegions<QTile::kBytes, QTile::kBytes, kStages * kStageBytes, 2 * KT::kBytes,
                                 Barriers::kBytes + TRing::kBarrierBytes>;
  static constexpr int kSmemBytes = Smem::kBytes;
  static_assert(kHeadDim == 32 || kHeadDim == 64, "TF32 sm90 backward: head dims 32 and 64");
  static_assert(bwd::kWorkspaceRowTile % kBlockM == 0, "query tiles never reach past the workspace padding");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory");
};

template <int kHeadDim, bool kAlibi>
__global__ void __launch_bounds__(DqTf32Sm90Traits<kHeadDim>::kThreads, 1)
    dq_kernel_tf32_sm90(const __grid_constant__ BwdSm90Params params) {
#if defined(TILEATTN_SM90_ENABLED)
  using Traits = DqTf32Sm90Traits<kHeadDim>;
  using Roles = typename Traits::Roles;
  using QTile = typename Traits::QTile;
  using KVTile = typename Traits::KVTile;
  using KT = typename Traits::KT;
  constexpr int BM = Traits::kBlockM, BN = Traits::kBlockN;
  const bwd::BwdParams& p = params.bwd;

  extern __shared__ unsigned char smem_raw[];
  const typename Traits::Smem smem(smem_raw);
  unsigned char* sQ = smem.template at<Traits::kQ>();
  unsigned char* sdO = smem.template at<Traits::kDout>();
  auto stage_k = [&](int s) { return smem.template at<Traits::kStagesRegion>() + s * Traits::kStageBytes; };
  auto stage_v = [&](int s) { return stage_k(s) + KVTile::kBytes; };
  auto k_t = [&](int slot) { return smem.template at<Traits::kTransposed>() + slot * KT::kBytes; };
  const typename Traits::Barriers bars(smem.template at<Traits::kBarriers, uint64_t>());
  const auto& ring = bars.ring;
  const typename Traits::TRing t_ring{ring.end()};

  const bwd::SeqInfo seq = bwd::seq_info(p, int(blockIdx.z));
  if (BwdQueryBlock<BM, BN>::first_query() >= seq.sq) return;
  const BwdQueryBlock<BM, BN> qb(p, seq);
  const int h = qb.h, b = qb.b, q0 = qb.q0, q1 = qb.q1;

  // A stage is free once every consumer warp and every transposing warp has read it.
  if (threadIdx.x == 0) t_ring.init(Traits::kTransposeThreads / 32, 4 * Traits::kConsumers);
  bars.init(4 * Traits::kConsumers + Traits::kTransposeThreads / 32);

  const Roles roles;
  if (roles.warpgroup == 0) {
    Roles::enter_producer();
    const int warp = Roles::warp(), lane = Roles::lane();
    if (warp == 0) {
      if (lane == 0 && qb.keys.count > 0) load_query_block<QTile, KVTile>(params, qb, sQ, sdO, stage_k, stage_v, bars);
      return;
    }
    const int tid = int(threadIdx.x) - 32;
    rewrite_stages(qb.keys.count, ring, t_ring, lane,
                   [=](int s, int slot) { KT::write(stage_k(s), k_t(slot), tid, Traits::kTransposeThreads); });
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
    bars.wait_once();
    // Q and dO, the A operands of every step's score products, in registers for the whole loop.
    uint32_t qa[kHeadDim / 8][4], doa[kHeadDim / 8][4];
    sm90::tf32_a_fragments<kHeadDim>(qa, sQ, BM, row0, lane);
    sm90::tf32_a_fragments<kHeadDim>(doa, sdO, BM, row0, lane);
    for (int i = 0; i < qb.keys.count; ++i) {
      const int s = i % Traits::kStages;  // in the loop's own words: see StageRing::wait_slot
      const int key0 = qb.key0(i);
      ring.wait_slot(i, s);

      float st[1][BN / 8][4], dpt[1][BN / 8][4];
      score_products_tf32<BN, kHeadDim, KVTile>(st, dpt, qa, smem_address(stage_k(s)), doa,
                                                smem_address(stage_v(s)));

      uint32_t pa[BN / 8][4], da[BN / 8][4];
      grads.col0 = key0;
      bwd::grads_to_fragments<float, false, kAlibi>(qb.masked(key0), st, dpt, grads, p, pa, da, slope);
      ring.release_warp(i, lane);  // K and V of the stage are read

      const uint32_t kt_addr = smem_address(k_t(i % 2));
      t_ring.wait(i);
      sm90::fence_registers(dq[0]);
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BN / 8; ++kk) sm90::Wgmma<float, kHeadDim>::rs(dq[0], da[kk], KT::k_major(kt_addr, kk), 1);
      sm90::wgmma_commit();
      sm90::wgmma_wait<0>();
      sm90::fence_registers(dq[0]);
      t_ring.release_warp(i, lane);
    }
  }

  float* gdQ = static_cast<float*>(p.dq.ptr) + bwd::seq_base(p, p.dq, b, true) + int64_t(h) * p.dq.head +
               int64_t(q0 + row0) * p.dq.seq;
  bwd::store_grad_frag<float>(false, dq, p.scale, gdQ, p.dq.seq, q1 - q0 - row0, p.headdim_qk);
#endif
}

}  // namespace tileattn::cuda
