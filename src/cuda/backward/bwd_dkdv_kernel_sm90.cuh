#pragma once
// dK and dV on Hopper: one block per (128 keys, batch, kv head), three warpgroups. The producer
// loads K and V once, then streams (Q, dO, L, D) tiles of the query tiles that see these keys,
// for every query head of the kv head's group; each consumer owns 64 keys:
//   S^T  = K Q^T      dP^T = V dO^T      wgmma, all operands in shared memory
//   P^T, dS^T         from S^T, dP^T and the queries' L and D (bwd_grads.cuh, per element)
//   dV  += P^T dO     dK  += dS^T Q      wgmma, P^T and dS^T from registers (the accumulator
//                                         layout of S^T is the A-fragment layout), dO and Q
//                                         read N-major
// dK and dV sum over the group in registers and are written once; nothing is atomic, so the
// result is the same bits on every run. dQ has its own kernel (bwd_dq_kernel_sm90.cuh).
#include <cuda_runtime.h>

#include "common/mask.hpp"
#include "cuda/backward/bwd_grads.cuh"
#include "cuda/backward/bwd_launch.hpp"
#include "cuda/common/bwd_params.hpp"
#include "cuda/backward/bwd_tile_io.cuh"
#include "cuda/backward/bwd_params_sm90.hpp"
#include "cuda/arch/panel_tile_sm90.cuh"
#include "cuda/arch/ptx_sm90.cuh"
#include "cuda/arch/wgmma_ops.cuh"

namespace tileattn::cuda {

template <class T, int kHeadDim>
struct DkdvSm90Traits {
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kBlockN = 64 * kConsumers;          // keys per block
  static constexpr int kBlockM = kHeadDim <= 64 ? 128 : 64;  // queries per step (registers: S^T, dP^T)
  static constexpr int kStages = 2;
  using KVTile = sm90::PanelTile<kBlockN, kHeadDim>;
  using QTile = sm90::PanelTile<kBlockM, kHeadDim>;
  // K, V, then per stage: Q, dO, L * log2(e), D; then the barriers.
  static constexpr int kStageBytes = 2 * QTile::kBytes + 2 * kBlockM * 4;
  static constexpr int kStagesOffset = 2 * KVTile::kBytes;
  static constexpr int kBarrierOffset = kStagesOffset + kStages * kStageBytes;
  static constexpr int kSmemBytes = kBarrierOffset + 128 + 1024;
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  static_assert(kHeadDim % 16 == 0 && kHeadDim <= 128, "sm90 backward: head dims 16..128 in steps of 16");
  static_assert(bwd::kWorkspaceRowTile % kBlockM == 0, "query tiles never reach past the workspace padding");
};

template <class T, int kHeadDim>
__global__ void __launch_bounds__(DkdvSm90Traits<T, kHeadDim>::kThreads, 1)
    dkdv_kernel_sm90(const __grid_constant__ BwdSm90Params params) {
#if defined(TILEATTN_SM90_ENABLED)
  using Traits = DkdvSm90Traits<T, kHeadDim>;
  using KVTile = typename Traits::KVTile;
  using QTile = typename Traits::QTile;
  constexpr int BN = Traits::kBlockN, BM = Traits::kBlockM, kStages = Traits::kStages;
  const bwd::BwdParams& p = params.bwd;

  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = sm90::swizzle_aligned(smem_raw);
  unsigned char* sK = smem;
  unsigned char* sV = sK + KVTile::kBytes;
  auto stage_q = [&](int s) { return smem + Traits::kStagesOffset + s * Traits::kStageBytes; };
  auto stage_dout = [&](int s) { return stage_q(s) + QTile::kBytes; };
  auto stage_lse2 = [&](int s) { return reinterpret_cast<float*>(stage_q(s) + 2 * QTile::kBytes); };
  auto stage_dsum = [&](int s) { return stage_lse2(s) + BM; };
  uint64_t* kv_full = reinterpret_cast<uint64_t*>(smem + Traits::kBarrierOffset);
  uint64_t* full = kv_full + 1;
  uint64_t* empty = full + kStages;

  const int b = blockIdx.y, hk = blockIdx.z;
  const bwd::SeqInfo seq = bwd::seq_info(p, b);
  const int k0 = blockIdx.x * BN;
  if (k0 >= seq.sk) return;
  const int k1 = min(k0 + BN, seq.sk);
  const Mask mask = bwd::seq_mask(p, seq);
  const bwd::TileSpan queries = bwd::tile_span(mask.tile_begin_query(k0), mask.tile_end_query(k1), BM);
  const int n_iter = queries.count * p.group;
  auto head_of = [&](int it) { return hk * p.group + it / queries.count; };
  auto q0_of = [&](int it) { return (queries.first + it % queries.count) * BM; };

  if (threadIdx.x == 0) {
    sm90::barrier_init(kv_full, 1);
    for (int s = 0; s < kStages; ++s) {
      sm90::barrier_init(full + s, 1);
      sm90::barrier_init(empty + s, 4 * Traits::kConsumers);  // one arrival per consumer warp
    }
    sm90::barrier_init_fence();
  }
  __syncthreads();

  const bool varlen = p.cu_seqlens_q != nullptr;
  const int warpgroup = int(threadIdx.x) / 128;
  if (warpgroup == 0) {
    sm90::registers_decrease<Traits::kProducerRegisters>();
    if (threadIdx.x != 0 || n_iter == 0) return;
    const int batch = varlen ? 0 : b;
    const int k_row = int(seq.row_k) + k0;
    const int q_base = int(seq.row_q);
    sm90::barrier_arrive_expect_bytes(kv_full, 2 * KVTile::kBytes);
    KVTile::template load<kBwdBoxRows>(sK, &params.k, kv_full, k_row, hk, batch);
    KVTile::template load<kBwdBoxRows>(sV, &params.v, kv_full, k_row, hk, batch);
    for (int it = 0; it < n_iter; ++it) {
      const int s = it % kStages;
      const uint32_t phase = (it / kStages) & 1;
      const int h = head_of(it), q0 = q0_of(it);
      sm90::barrier_wait(empty + s, phase ^ 1);
      sm90::barrier_arrive_expect_bytes(full + s, Traits::kStageBytes);
      QTile::template load<kBwdBoxRows>(stage_q(s), &params.q, full + s, q_base + q0, h, batch);
      QTile::template load<kBwdBoxRows>(stage_dout(s), &params.dout, full + s, q_base + q0, h, batch);
      const int64_t w = bwd::ws_row(p, b, h) + q0;
      sm90::bulk_load(stage_lse2(s), p.lse2 + w, BM * 4, full + s);
      sm90::bulk_load(stage_dsum(s), p.dsum + w, BM * 4, full + s);
    }
    return;
  }

  sm90::registers_increase<Traits::kConsumerRegisters>();
  const int consumer = warpgroup - 1;
  const int warp = (int(threadIdx.x) / 32) % 4, lane = int(threadIdx.x) % 32;
  const int key_row = 64 * consumer + 16 * warp + lane / 4;  // tile row of (g, e < 2)

  float dk[1][kHeadDim / 8][4], dv[1][kHeadDim / 8][4];
#pragma unroll
  for (int j = 0; j < kHeadDim / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[0][j][e] = dv[0][j][e] = 0.0f;

  if (n_iter > 0) {
    const uint32_t k_base = smem_address(sK) + consumer * 64 * 128;
    const uint32_t v_base = smem_address(sV) + consumer * 64 * 128;
    sm90::barrier_wait(kv_full, 0);
    for (int it = 0; it < n_iter; ++it) {
      const int s = it % kStages;
      const uint32_t phase = (it / kStages) & 1;
      const int q0 = q0_of(it);
      const uint32_t q_addr = smem_address(stage_q(s)), do_addr = smem_address(stage_dout(s));
      sm90::barrier_wait(full + s, phase);

      float st[1][BM / 8][4], dpt[1][BM / 8][4];
      sm90::wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks)
        sm90::Wgmma<T, BM>::ss(st[0], KVTile::k_major(k_base, ks), QTile::k_major(q_addr, ks), ks > 0);
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks)
        sm90::Wgmma<T, BM>::ss(dpt[0], KVTile::k_major(v_base, ks), QTile::k_major(do_addr, ks), ks > 0);
      sm90::wgmma_commit();
      sm90::wgmma_wait<0>();
      sm90::fence_registers(st[0]);
      sm90::fence_registers(dpt[0]);

      // P^T and dS^T, rounded to T in the A-fragment layout (two column tiles = one k-step).
      const int q1 = min(q0 + BM, seq.sq);
      const bool masked = !(mask.full_begin_key(q1) <= k0 && mask.full_end_key(q0) >= k0 + BN);
      const float* lse2 = stage_lse2(s);
      const float* dsum = stage_dsum(s);
      uint32_t pa[BM / 16][4], da[BM / 16][4];
      const bwd::Fragment grads{lse2, dsum, {0.0f, 0.0f}, {0.0f, 0.0f}, q0, k0 + key_row, mask};
      bwd::grads_to_fragments<T, true>(masked, st, dpt, grads, p, pa, da);

      sm90::fence_registers(dv[0]);
      sm90::fence_registers(dk[0]);
      sm90::wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < BM / 16; ++ks)
        sm90::Wgmma<T, kHeadDim>::template rs<1>(dv[0], pa[ks], QTile::n_major(do_addr, ks), 1);
#pragma unroll
      for (int ks = 0; ks < BM / 16; ++ks)
        sm90::Wgmma<T, kHeadDim>::template rs<1>(dk[0], da[ks], QTile::n_major(q_addr, ks), 1);
      sm90::wgmma_commit();
      sm90::wgmma_wait<0>();
      sm90::fence_registers(dv[0]);
      sm90::fence_registers(dk[0]);
      __syncwarp();
      if (lane == 0) sm90::barrier_arrive(empty + s);
    }
  }

  const int row0 = 64 * consumer + 16 * warp;  // this warp's first tile row
  T* gdK = static_cast<T*>(p.dk.ptr) + bwd::seq_base(p, p.dk, b, false) + int64_t(hk) * p.dk.head +
           int64_t(k0 + row0) * p.dk.seq;
  T* gdV = static_cast<T*>(p.dv.ptr) + bwd::seq_base(p, p.dv, b, false) + int64_t(hk) * p.dv.head +
           int64_t(k0 + row0) * p.dv.seq;
  bwd::store_grad_frag<T>(p.pair_grads, dk, p.scale, gdK, p.dk.seq, k1 - k0 - row0, p.headdim_qk);
  bwd::store_grad_frag<T>(p.pair_grads, dv, 1.0f, gdV, p.dv.seq, k1 - k0 - row0, p.headdim_v);
#endif
}

}  // namespace tileattn::cuda
