#pragma once
// The Hopper backward: one block per (128 keys, batch, kv head), three warpgroups. The producer
// loads K and V once, then streams (Q, dO, L, D) tiles of the query tiles that see these keys,
// for every query head of the kv head's group; each consumer owns 64 keys:
//   S^T  = K Q^T      dP^T = V dO^T      wgmma, all operands in shared memory
//   P^T, dS^T         from S^T, dP^T and the queries' L and D (bwd_grads.cuh, per element)
//   dV  += P^T dO     dK  += dS^T Q      wgmma, P^T and dS^T from registers (the accumulator
//                                         layout of S^T is the A-fragment layout), dO and Q
//                                         read N-major
// dK and dV sum over the group in registers and are written once, in a fixed order.
//
// With kFusedDq (the default mode), dQ is the fifth product, one step late:
//   dQ_tile(it-1) = dS(it-1) K   issued in step it beside dV(it) and dK(it); dS^T through shared
//                                 memory (a ring of three tiles, two at D <= 64), read M-major;
//                                 K read N-major; the consumers split the tile (by queries at
//                                 D <= 64, by 64-column panels above)
// Each consumer needs the other's half of dS^T, so issued in the same step it held both at a
// barrier every step: they reached the exp unit together and left the tensor cores idle meanwhile.
// One step late, the other's half has long been written (the ring's full barrier does not wait),
// and the consumers drift apart, one's gradients beside the other's products (perf-log: +1-6%; a
// start half a step apart, forced by a barrier, measured the same).
// Each consumer's part of the dQ tile leaves in fp32 through shared memory: a warp of the producer
// warpgroup adds it to the workspace accumulator with one bulk reduction, off the consumers' path,
// and convert_dq_tiles_sm90 scales and converts it. The tile is stored in the order the consumers
// hold it (DqTileOrder, bwd_dq_tiles_sm90.cuh), so their shared-memory writes are whole 512-byte
// runs per warp and each part is one contiguous run (row by row, the 256-byte reductions at D = 64
// cost 28% of the backward's time; docs/perf-log.md). Reductions land in any order, so dQ's low
// bits vary run to run. The deterministic mode either gives each query tile's reductions a fixed
// order (p.dq_order: one length, no mask but the causal one; BwdKeyBlock in bwd_stream_sm90.cuh
// says which order and why it cannot stall the grid), each landing before the next starts, with a
// second dQ warp taking the odd steps so that the wait for landing stays off the consumers' path,
// or runs without kFusedDq and gives dQ its own pass (bwd_dq_kernel_sm90.cuh).
//
// kAlibi: P carries ALiBi's bias (bwd::grads_to_fragments, bwd_grads.cuh); an instance of its own, so
// that the kernels without it keep their registers.
//
// kPersistent (kFusedDq only): one block per SM walks key blocks (scheduler_bwd_sm90.cuh). The
// stage ring, dS^T's ring and the dQ tile's hand-shakes run on across key blocks (their items
// counted over the walk); K and V are refilled once the consumers release them (kv_free), after
// the key block's last products and before its dK/dV stores.
//
// Named barriers (kFusedDq only; pipeline_sm90.cuh): kBwdDqPartFull0 + c consumer c's part of a dQ
// tile written (it arrives, the dQ warp waits); kBwdDqPartEmpty0 + c that part's shared memory
// read (the dQ warp arrives).
#include <cuda_runtime.h>

#include <type_traits>

#include "common/mask.hpp"
#include "cuda/backward/bwd_grads.cuh"
#include "cuda/backward/bwd_launch.hpp"
#include "cuda/common/bwd_params.hpp"
#include "cuda/backward/bwd_tile_io.cuh"
#include "cuda/backward/bwd_params_sm90.hpp"
#include "cuda/backward/bwd_stream_sm90.cuh"
#include "cuda/backward/bwd_dq_tiles_sm90.cuh"
#include "cuda/backward/scheduler_bwd_sm90.cuh"
#include "cuda/arch/panel_tile_sm90.cuh"
#include "cuda/arch/pipeline_sm90.cuh"
#include "cuda/arch/ptx_sm90.cuh"
#include "cuda/arch/wgmma_ops.cuh"

namespace tileattn::cuda {

template <class T, int kHeadDim, bool kFusedDq>
struct BwdSm90Traits {
  using Roles = sm90::WarpRoles<2, 24, 240>;
  static constexpr int kConsumers = Roles::kConsumers;
  static constexpr int kThreads = Roles::kThreads;
  static constexpr int kBlockN = 64 * kConsumers;          // keys per block
  static constexpr int kBlockM = kHeadDim <= 64 ? 128 : 64;  // queries per step (registers: S^T, dP^T)
  static constexpr int kStages = 2;
  using KVTile = sm90::PanelTile<kBlockN, kHeadDim>;
  using QTile = sm90::PanelTile<kBlockM, kHeadDim>;
  // dS^T (keys x queries). Step it writes one buffer while dQ(it - 1) reads another and the
  // consumer half a step behind may still read dQ(it - 2)'s: three buffers, where they fit (at
  // D <= 64 a buffer is twice the size and the third would pass the limit by 88 bytes; with two, the
  // ring holds the consumers less than a step apart).
  using DsTile = sm90::PanelTile<kBlockN, kBlockM>;
  static constexpr int kDsBuffers = kHeadDim <= 64 ? 2 : 3;
  using DsRing = sm90::StageRing<kDsBuffers>;
  using DqOrder = DqTileOrder<kHeadDim>;
  static constexpr bool kDqSplitRows = DqOrder::kSplitRows;
  static constexpr int kDqTileBytes = kBlockM * kHeadDim * 4;
  static constexpr int kDqPartBytes = DqOrder::kPartFloats * 4;
  using Stages = BwdStages<QTile, kBlockM, kStages>;
  using Barriers = BwdBarriers<kStages>;
  // K, V, then per stage: Q, dO, L * log2(e), D (rounded up to 1024 bytes: dS^T's swizzle is on
  // address bits); then dS^T, the dQ tile (both only with kFusedDq) and the barriers (dS^T's ring
  // after the stages', then kv_free).
  enum Region { kK, kV, kStagesRegion, kDs, kDq, kBarriers };
  using Smem = sm90::SmemRegions<KVTile::kBytes, KVTile::kBytes, (kStages * Stages::kBytes + 1023) / 1024 * 1024,
                                 kFusedDq ? kDsBuffers * DsTile::kBytes : 0, kFusedDq ? kDqTileBytes : 0,
                                 Barriers::kBytes + (kFusedDq ? DsRing::kBarrierBytes + 8 : 0)>;
  static constexpr int kSmemBytes = Smem::kBytes;
  // bar.sync count: one consumer and the dQ warp.
  static constexpr int kDqPartBarrierThreads = 128 + 32;
  static_assert(kHeadDim % 16 == 0 && kHeadDim <= 128, "sm90 backward: head dims 16..128 in steps of 16");
  static_assert(DqOrder::kBlockM == kBlockM, "one tile shape");
  static_assert(bwd::kWorkspaceRowTile % kBlockM == 0, "query tiles never reach past the workspace padding");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory");
};

template <class T, int kHeadDim, bool kFusedDq, bool kAlibi, bool kPersistent = false>
__global__ void __launch_bounds__(BwdSm90Traits<T, kHeadDim, kFusedDq>::kThreads, 1)
    bwd_kernel_sm90(const __grid_constant__ BwdSm90Params params) {
#if defined(TILEATTN_SM90_ENABLED)
  static_assert(kFusedDq || !kPersistent, "the walk carries the fused dQ's hand-shakes");
  using Traits = BwdSm90Traits<T, kHeadDim, kFusedDq>;
  using Roles = typename Traits::Roles;
  using KVTile = typename Traits::KVTile;
  using QTile = typename Traits::QTile;
  using DsTile = typename Traits::DsTile;
  constexpr int BN = Traits::kBlockN, BM = Traits::kBlockM, kStages = Traits::kStages;
  // Consumer 1 skips the steps whose queries see none of its keys (the causal diagonal at D > 64,
  // where a step is half a key block) in the walk's instance, which runs the short key ranges
  // where that step is a larger share; the one-block-per-key-block instance spilled with it.
  constexpr bool kSkipHidden = kPersistent;
  const bwd::BwdParams& p = params.bwd;

  extern __shared__ unsigned char smem_raw[];
  const typename Traits::Smem smem(smem_raw);
  unsigned char* sK = smem.template at<Traits::kK>();
  unsigned char* sV = smem.template at<Traits::kV>();
  const typename Traits::Stages stages{smem.template at<Traits::kStagesRegion>()};
  auto ds_buffer = [&](int it) { return smem.template at<Traits::kDs>() + (it % Traits::kDsBuffers) * DsTile::kBytes; };
  float* sdq = smem.template at<Traits::kDq, float>();
  const typename Traits::Barriers bars(smem.template at<Traits::kBarriers, uint64_t>());
  const auto& ring = bars.ring;
  // dS^T's ring: each consumer warp fills its rows of a buffer, and each frees it once its dQ
  // product has read the buffer.
  const typename Traits::DsRing ds_ring{ring.end()};
  // kPersistent: K and V's buffer read to the end (one release per consumer warp).
  uint64_t* kv_free = ds_ring.end();

  const BwdSm90Schedule<kPersistent, BN, BM> schedule(p);
  // dQ's additions in p.dq_order's order (BwdKeyBlock): each waits until it has landed, which takes
  // about a step at D = 64, so two dQ warps take the steps in turn.
  const bool ordered_dq = !kPersistent && p.dq_order != nullptr;
  if constexpr (!kPersistent) {
    const BwdKeyBlock<BN, BM> kb(p);
    if (kb.k0 >= kb.seq.sk) return;
  }

  if constexpr (kFusedDq)
    if (threadIdx.x == 0) {
      ds_ring.init(4 * Traits::kConsumers, 4 * Traits::kConsumers);
      if constexpr (kPersistent) sm90::barrier_init(kv_free, 4 * Traits::kConsumers);
    }
  bars.init(4 * Traits::kConsumers);  // one release per consumer warp

  const Roles roles;
  if (roles.warpgroup == 0) {
    Roles::enter_producer();
    if constexpr (kFusedDq) {
      const int dq_warp = threadIdx.x / 32 - 1;
      if (dq_warp == 0 || (dq_warp == 1 && ordered_dq)) {
        // The dQ warps (the second takes the odd steps, ordered_dq only; they pass the turn to
        // read the one tile): a consumer's part of the tile is free again once its reduction has
        // read it, except after the walk's last tile.
        const int total = kPersistent ? schedule.steps(p) : 0;
        int g0 = 0;
        for (BwdWalk w = schedule.begin(); schedule.more(w); schedule.next(w)) {
          const BwdKeyBlock<BN, BM> kb = schedule.key_block(p, w);
          const int left = kPersistent ? total - g0 : kb.n_iter;  // tiles from this key block's first on
          reduce_dq_tiles<kHeadDim, Traits::kDqTileBytes, Traits::kConsumers, Traits::kDqPartBytes,
                          Traits::kDqPartBarrierThreads, !kPersistent>(
              p, kb, kb.n_iter, sm90::kBwdDqPartFull0, [sdq](int) { return sdq; }, [](int, int) {},
              [left](int it, int part) {
                if (it + 1 < left)
                  sm90::named_barrier_arrive(sm90::kBwdDqPartEmpty0 + part, Traits::kDqPartBarrierThreads);
              },
              dq_warp, ordered_dq ? 2 : 1, sm90::kBwdDqTurn0 + dq_warp, sm90::kBwdDqTurn0 + 1 - dq_warp);
          g0 += kb.n_iter;
        }
        return;
      }
    }
    if (threadIdx.x == 0) {
      int g0 = 0, uses = 0;
      for (BwdWalk w = schedule.begin(); schedule.more(w); schedule.next(w)) {
        const BwdKeyBlock<BN, BM> kb = schedule.key_block(p, w);
        if (kb.n_iter == 0) continue;
        load_key_block<KVTile>(params, kb, sK, sV, stages, bars, g0, uses, kPersistent ? kv_free : nullptr);
        g0 += kb.n_iter;
        ++uses;
      }
    }
    return;
  }

  Roles::enter_consumer();
  const int consumer = roles.consumer();
  const int warp = Roles::warp(), lane = Roles::lane();
  const int key_row = 64 * consumer + 16 * warp + lane / 4;  // tile row of (g, e < 2)

  float dk[1][kHeadDim / 8][4], dv[1][kHeadDim / 8][4];

  // Key block kb's steps, the ring items g0.. of the walk; its K and V are the uses-th fill.
  // kDqCols: this consumer's columns of the dQ tile (all of them where the split is by rows).
  auto steps = [&](auto dq_cols, const BwdKeyBlock<BN, BM>& kb, int g0, int uses) {
    constexpr int kDqCols = decltype(dq_cols)::value;
    const int n_iter = kb.n_iter;
    const uint32_t k_base = smem_address(sK) + consumer * 64 * 128;
    const uint32_t v_base = smem_address(sV) + consumer * 64 * 128;
    // dQ's operands and this thread's first dQ element: queries 64 c.. and K's panel 0, or all
    // queries and K's panel c.
    [[maybe_unused]] const int ds_panel = Traits::kDqSplitRows ? consumer : 0;
    const int k_panel = Traits::kDqSplitRows ? 0 : consumer;
    const uint64_t k_dq = KVTile::n_major(smem_address(sK) + k_panel * KVTile::kPanelBytes, 0);
    [[maybe_unused]] float* dq_part = sdq + consumer * Traits::DqOrder::kPartFloats + 4 * (int(threadIdx.x) % 128);
    [[maybe_unused]] float dq[1][kDqCols / 8][4];
    // dQ(t) = dS(t) K (t: the walk's item), issued once both consumers' halves of dS^T(t) are
    // written (zeros where consumer 1 skipped the step: a product over the first half alone, in a
    // branch, made ptxas fence the accumulators at ten more places, and the walk 1-5% slower).
    [[maybe_unused]] auto issue_dq = [&](int t) {
      ds_ring.wait(t);
      const uint64_t ds_desc = DsTile::n_major(smem_address(ds_buffer(t)) + ds_panel * DsTile::kPanelBytes, 0);
      sm90::wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < BN / 16; ++ks)
        sm90::Wgmma<T, kDqCols>::template ss<1, 1>(dq[0], DsTile::n_step(ds_desc, ks), KVTile::n_step(k_dq, ks), ks > 0);
      sm90::wgmma_commit();
    };
    // Once dQ(t) has landed: its dS^T buffer is free of this warp, and this consumer's part of the
    // tile goes to the dQ warp.
    [[maybe_unused]] auto hand_over_dq = [&](int t) {
      sm90::fence_registers(dq[0]);
      ds_ring.release_warp(t, lane);
      if (t > 0) sm90::named_barrier_sync(sm90::kBwdDqPartEmpty0 + consumer, Traits::kDqPartBarrierThreads);
#pragma unroll
      for (int j = 0; j < kDqCols / 8; ++j)
        *reinterpret_cast<float4*>(dq_part + j * 512) = make_float4(dq[0][j][0], dq[0][j][1], dq[0][j][2], dq[0][j][3]);
      sm90::fence_shared_to_async();
      sm90::named_barrier_arrive(sm90::kBwdDqPartFull0 + consumer, Traits::kDqPartBarrierThreads);
    };
    // This warp's rows of dS^T(g) into its ring buffer in the tile format: A fragment (ks, i) holds
    // rows g + 8 (i % 2) and columns 16 ks + 8 (i / 2) + 2 t, + 1; `value(ks, i)` gives it.
    [[maybe_unused]] auto store_ds = [&](int g, auto value) {
      ds_ring.acquire(g);
      unsigned char* ds = ds_buffer(g);
#pragma unroll
      for (int ks = 0; ks < BM / 16; ++ks)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = key_row + 8 * (i % 2), chunk = (2 * ks + i / 2) % 8;
          *reinterpret_cast<uint32_t*>(ds + (ks / 4) * DsTile::kPanelBytes + r * 128 + ((chunk ^ (r % 8)) * 16) +
                                       4 * (lane % 4)) = value(ks, i);
        }
      sm90::fence_shared_to_async();
      ds_ring.publish_warp(g, lane);
    };
    // Step it of the key block (item g of the walk); with_dq: it > 0, and the step issues
    // dQ(g - 1) (constant, so that every step's wgmma groups are known to ptxas: with a run-time
    // test it serialised the products).
    auto step = [&](int it, auto with_dq) {
      constexpr bool kWithDq = kFusedDq && decltype(with_dq)::value;
      const int g = g0 + it;
      const int s = g % kStages;  // in the loop's own words: see StageRing::wait_slot
      const int q0 = kb.q0(it);
      const uint32_t q_addr = smem_address(stages.q(s)), do_addr = smem_address(stages.dout(s));
      const float slope = kAlibi ? p.mod.slope(kb.b, kb.head(it)) : 0.0f;
      ring.wait_slot(g, s);
      if (kSkipHidden && consumer == 1 && kb.second_half_hidden(it)) {
        // No query of the step sees this consumer's keys: P^T = dS^T = 0 and dK, dV gain nothing.
        // Its half of dS^T is written as zeros; the hand-shakes go on.
        if constexpr (kFusedDq) store_ds(g, [](int, int) { return 0u; });
        if constexpr (kWithDq) {
          issue_dq(g - 1);
          sm90::wgmma_wait<0>();
          hand_over_dq(g - 1);
        }
        ring.release_warp(g, lane);
        return;
      }

      float st[1][BM / 8][4], dpt[1][BM / 8][4];
      score_products<T, BM, kHeadDim, KVTile, QTile>(st, dpt, k_base, q_addr, v_base, do_addr);

      // P^T and dS^T, rounded to T in the A-fragment layout (two column tiles = one k-step).
      const int q1 = min(q0 + BM, kb.seq.sq);
      const bool masked = !(kb.mask.full_begin_key(q1) <= kb.k0 && kb.mask.full_end_key(q0) >= kb.k0 + BN);
      uint32_t pa[BM / 16][4], da[BM / 16][4];
      const bwd::Fragment grads{stages.lse2(s), stages.dsum(s), {0.0f, 0.0f}, {0.0f, 0.0f}, q0, kb.k0 + key_row, kb.mask};
      bwd::grads_to_fragments<T, true, kAlibi>(masked, st, dpt, grads, p, pa, da, slope);

      const uint64_t do_desc = QTile::n_major(do_addr, 0), q_desc = QTile::n_major(q_addr, 0);
      sm90::fence_registers(dv[0]);
      sm90::fence_registers(dk[0]);
      sm90::wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < BM / 16; ++ks)
        sm90::Wgmma<T, kHeadDim>::template rs<1>(dv[0], pa[ks], QTile::n_step(do_desc, ks), 1);
      sm90::wgmma_commit();

      if constexpr (kFusedDq) store_ds(g, [&](int ks, int i) { return da[ks][i]; });
      // The dK products read da after the dS^T stores did: without dQ's fence between them (a key
      // block's first step), ptxas would inject one (C7519) itself.
      if constexpr (kWithDq) issue_dq(g - 1);
      else if constexpr (kFusedDq) sm90::wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < BM / 16; ++ks)
        sm90::Wgmma<T, kHeadDim>::template rs<1>(dk[0], da[ks], QTile::n_step(q_desc, ks), 1);
      sm90::wgmma_commit();

      if constexpr (kWithDq) {
        sm90::wgmma_wait<1>();  // dV and dQ(g - 1) done; dK may still run
        hand_over_dq(g - 1);
      }
      sm90::wgmma_wait<0>();
      sm90::fence_registers(dv[0]);
      sm90::fence_registers(dk[0]);
      ring.release_warp(g, lane);
    };

    if constexpr (kPersistent) bars.wait_once(uses);
    else bars.wait_once();
    if constexpr (!kFusedDq) {
      for (int it = 0; it < n_iter; ++it) step(it, std::false_type{});
    } else {
      step(0, std::false_type{});
      for (int it = 1; it < n_iter; ++it) step(it, std::true_type{});
      issue_dq(g0 + n_iter - 1);
      sm90::wgmma_wait<0>();
      if constexpr (kPersistent) {
        __syncwarp();
        if (lane == 0) sm90::barrier_arrive(kv_free);  // every product on K and V has landed
      }
      hand_over_dq(g0 + n_iter - 1);
    }
  };

  int g0 = 0, uses = 0;
  for (BwdWalk w = schedule.begin(); schedule.more(w); schedule.next(w)) {
    const BwdKeyBlock<BN, BM> kb = schedule.key_block(p, w);
#pragma unroll
    for (int j = 0; j < kHeadDim / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[0][j][e] = dv[0][j][e] = 0.0f;
    if (kb.n_iter > 0) {
      if constexpr (!kFusedDq || Traits::kDqSplitRows) {
        steps(std::integral_constant<int, kHeadDim>{}, kb, g0, uses);
      } else if constexpr (kHeadDim == 128) {
        steps(std::integral_constant<int, 64>{}, kb, g0, uses);
      } else {
        if (consumer == 0) steps(std::integral_constant<int, 64>{}, kb, g0, uses);
        else steps(std::integral_constant<int, kHeadDim - 64>{}, kb, g0, uses);
      }
      g0 += kb.n_iter;
      ++uses;
    }
    kb.template store_grads<T>(p, 64 * consumer + 16 * warp, 0, dk, dv);  // from this warp's first tile row
  }
#endif
}

}  // namespace tileattn::cuda
