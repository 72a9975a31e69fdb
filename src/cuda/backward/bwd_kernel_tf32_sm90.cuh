#pragma once
// The Hopper backward of fp32 attention in fast mode (TF32 wgmma): dK and dV. One block per
// (128 keys, batch, kv head), three warpgroups, the 16-bit kernel's shape (bwd_kernel_sm90.cuh)
// with dQ in a pass of its own (bwd_dq_kernel_tf32_sm90.cuh):
//   producer warp 0   one thread loads K and V once, then streams (Q, dO, L, D) of the query
//                     tiles that see these keys, for every query head of the kv head's group
//   producer warps 1-3  rewrite each step's Q and dO K-major (Q^T, dO^T; TF32 wgmma reads no
//                     N-major operand) into one of two buffers (tf32_operands_sm90.cuh)
//   consumers         64 keys each:
//     S^T  = K Q^T     dP^T = V dO^T    wgmma, K and V in registers (read once), Q and dO in
//                                       shared memory
//     P^T, dS^T        rounded to TF32 in the A-fragment layout (bwd::grads_to_fragments)
//     dV  += P^T dO    dK  += dS^T Q    wgmma, B = dO^T and Q^T
// A fused dQ would add K^T, a dS tile and a dQ tile to these stages and pass the shared memory
// (docs/perf-log.md); with its own pass no sum depends on timing, so both kernels are
// deterministic. kAlibi: P carries ALiBi's bias, in an instance of its own.
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
#include "cuda/common/bwd_params.hpp"

namespace tileattn::cuda {

template <int kHeadDim>
struct BwdTf32Sm90Traits {
  using Roles = sm90::WarpRoles<2, 48, 224>;  // the rewrite's unit indices spill at 40 producer registers
  static constexpr int kConsumers = Roles::kConsumers;
  static constexpr int kThreads = Roles::kThreads;
  static constexpr int kTransposeThreads = 96;  // producer warps 1-3
  static constexpr int kBlockN = 64 * kConsumers;  // keys per block
  static constexpr int kBlockM = 64;               // queries per step
  static constexpr int kStages = 2;
  using KVTile = sm90::PanelTile<kBlockN, kHeadDim, 4>;
  using QTile = sm90::PanelTile<kBlockM, kHeadDim, 4>;
  using QT = sm90::Tf32Transposed<kBlockM, kHeadDim>;  // Q^T or dO^T of a step
  using Stages = BwdStages<QTile, kBlockM, kStages, 1024>;  // the rewrite swizzles from each tile's start
  using Barriers = BwdBarriers<kStages>;
  using TRing = sm90::StageRing<2>;
  // K, V, the stages (Q, dO, L, D; each on a 1024-byte swizzle period), two buffers of
  // (Q^T, dO^T), the barriers (the transposed ring's after the stages').
  enum Region { kK, kV, kStagesRegion, kTransposed, kBarriers };
  using Smem = sm90::SmemRegions<KVTile::kBytes, KVTile::kBytes, kStages * Stages::kStride,
                                 2 * 2 * QT::kBytes, Barriers::kBytes + TRing::kBarrierBytes>;
  static constexpr int kSmemBytes = Smem::kBytes;
  static_assert(kHeadDim == 32 || kHeadDim == 64, "TF32 sm90 backward: head dims 32 and 64");
  static_assert(bwd::kWorkspaceRowTile % kBlockM == 0, "query tiles never reach past the workspace padding");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory");
};

template <int kHeadDim, bool kAlibi>
__global__ void __launch_bounds__(BwdTf32Sm90Traits<kHeadDim>::kThreads, 1)
    bwd_kernel_tf32_sm90(const __grid_constant__ BwdSm90Params params) {
#if defined(TILEATTN_SM90_ENABLED)
  using Traits = BwdTf32Sm90Traits<kHeadDim>;
  using Roles = typename Traits::Roles;
  using KVTile = typename Traits::KVTile;
  using QTile = typename Traits::QTile;
  using QT = typename Traits::QT;
  constexpr int BN = Traits::kBlockN, BM = Traits::kBlockM, kStages = Traits::kStages;
  const bwd::BwdParams& p = params.bwd;

  extern __shared__ unsigned char smem_raw[];
  const typename Traits::Smem smem(smem_raw);
  unsigned char* sK = smem.template at<Traits::kK>();
  unsigned char* sV = smem.template at<Traits::kV>();
  const typename Traits::Stages stages{smem.template at<Traits::kStagesRegion>()};
  auto q_t = [&](int slot) { return smem.template at<Traits::kTransposed>() + slot * 2 * QT::kBytes; };
  auto dout_t = [&](int slot) { return q_t(slot) + QT::kBytes; };
  const typename Traits::Barriers bars(smem.template at<Traits::kBarriers, uint64_t>());
  const auto& ring = bars.ring;
  const typename Traits::TRing t_ring{ring.end()};

  const BwdKeyBlock<BN, BM> kb(p);
  if (kb.k0 >= kb.seq.sk) return;
  const int n_iter = kb.n_iter;

  // A stage is free once every consumer warp and every transposing warp has read it; a
  // transposed buffer is full once the three transposing warps wrote it.
  if (threadIdx.x == 0) t_ring.init(Traits::kTransposeThreads / 32, 4 * Traits::kConsumers);
  bars.init(4 * Traits::kConsumers + Traits::kTransposeThreads / 32);

  const Roles roles;
  if (roles.warpgroup == 0) {
    Roles::enter_producer();
    const int warp = Roles::warp(), lane = Roles::lane();
    if (warp == 0) {
      if (lane == 0 && n_iter > 0) load_key_block<KVTile>(params, kb, sK, sV, stages, bars);
      return;
    }
    const int tid = int(threadIdx.x) - 32;
    rewrite_stages(n_iter, ring, t_ring, lane, [=](int s, int slot) {
      QT::write(stages.q(s), q_t(slot), tid, Traits::kTransposeThreads);
      QT::write(stages.dout(s), dout_t(slot), tid, Traits::kTransposeThreads);
    });
    return;
  }

  Roles::enter_consumer();
  const int consumer = roles.consumer();
  const int warp = Roles::warp(), lane = Roles::lane();
  const int key_row = 64 * consumer + 16 * warp + lane / 4;  // tile row of (g, e < 2)

  float dk[1][kHeadDim / 8][4], dv[1][kHeadDim / 8][4];
#pragma unroll
  for (int j = 0; j < kHeadDim / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[0][j][e] = dv[0][j][e] = 0.0f;

  if (n_iter > 0) {
    bars.wait_once();
    // K and V, the A operands of every step's score products, in registers for the whole loop.
    uint32_t ka[kHeadDim / 8][4], va[kHeadDim / 8][4];
    sm90::tf32_a_fragments<kHeadDim>(ka, sK, BN, 64 * consumer + 16 * warp, lane);
    sm90::tf32_a_fragments<kHeadDim>(va, sV, BN, 64 * consumer + 16 * warp, lane);
    for (int it = 0; it < n_iter; ++it) {
      const int s = it % kStages;  // in the loop's own words: see StageRing::wait_slot
      const int q0 = kb.q0(it);
      const float slope = kAlibi ? p.mod.slope(kb.b, kb.head(it)) : 0.0f;
      ring.wait_slot(it, s);

      float st[1][BM / 8][4], dpt[1][BM / 8][4];
      score_products_tf32<BM, kHeadDim, QTile>(st, dpt, ka, smem_address(stages.q(s)), va,
                                               smem_address(stages.dout(s)));

      const int q1 = min(q0 + BM, kb.seq.sq);
      const bool masked = !(kb.mask.full_begin_key(q1) <= kb.k0 && kb.mask.full_end_key(q0) >= kb.k0 + BN);
      uint32_t pa[BM / 8][4], da[BM / 8][4];
      const bwd::Fragment grads{stages.lse2(s), stages.dsum(s), {0.0f, 0.0f}, {0.0f, 0.0f}, q0, kb.k0 + key_row, kb.mask};
      bwd::grads_to_fragments<float, true, kAlibi>(masked, st, dpt, grads, p, pa, da, slope);
      ring.release_warp(it, lane);  // Q, dO, L and D of the stage are read

      const int ts = it % 2;
      const uint32_t qt_addr = smem_address(q_t(ts)), dot_addr = smem_address(dout_t(ts));
      t_ring.wait(it);
      sm90::fence_registers(dv[0]);
      sm90::fence_registers(dk[0]);
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BM / 8; ++kk) sm90::Wgmma<float, kHeadDim>::rs(dv[0], pa[kk], QT::k_major(dot_addr, kk), 1);
#pragma unroll
      for (int kk = 0; kk < BM / 8; ++kk) sm90::Wgmma<float, kHeadDim>::rs(dk[0], da[kk], QT::k_major(qt_addr, kk), 1);
      sm90::wgmma_commit();
      sm90::wgmma_wait<0>();
      sm90::fence_registers(dv[0]);
      sm90::fence_registers(dk[0]);
      t_ring.release_warp(it, lane);
    }
  }

  kb.template store_grads<float>(p, 64 * consumer + 16 * warp, 0, dk, dv);  // from this warp's first tile row
#endif
}

}  // namespace tileattn::cuda
