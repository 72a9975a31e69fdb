#pragma once
// The sm90 forward kernel: one block per (64 x kConsumers query rows, head, batch[, key split]),
// a producer warpgroup and two or three consumers.
//
//   warpgroup 0      producer: one thread streams Q once and K(j), V(j) through kStages
//                    shared-memory stages with TMA; each stage has a "full" barrier (the copy
//                    engine completes it) and an "empty" one (the consumers release it).
//   warpgroups 1-3   consumers, 64 query rows each:
//                      S = Q K(j)^T     wgmma, both operands in shared memory
//                      P = exp2(S * scale_log2 - rowmax), online-softmax rescale of O
//                      O += P V(j)      wgmma, P from registers (the S accumulator layout is the
//                                       A-fragment layout), V read N-major from shared memory
//                    with S(j + 1) issued beside P V(j), so that the softmax of j + 1 runs while
//                    P V(j) is on the tensor cores, and the two consumers issue their products
//                    in turn (ping-pong), so that one's softmax runs beside the other's products.
// Registers move from the producer (which needs few) to the consumers. The two overlaps together
// gain 13% at D = 128 and 8% at D = 64 (H100, bf16, N = 16k; docs/perf.md).
// Key tiles are visited from the first to the last, so that the tile a mask cuts (the causal
// diagonal, a ragged end) comes last, its softmax beside the P V before it: a tile's first softmax
// has no product to hide behind.
// kAlibi: ALiBi's bias joins the scores where the cap and the mask do; an instance of its own, so
// that the kernel without it keeps its registers (the bias needs the slope and both lengths live).
// kSoftcap: soft-capping (tanhf on every score, about 1,100 instructions a step) in an instance of
// its own too, so that the others do not carry that code between a step's hot paths: jumps over
// it left the step waiting for instructions to be fetched (the ALiBi instance caps at run time).
// O leaves through the consumers' rows of Q and TMA stores (epilogue_fwd_sm90.cuh).
// kPersistent: one block per SM walks units of equal work a grid apart (scheduler_fwd_sm90.cuh;
// one length, no mask but the causal one), with two Q buffers, so that the next tile's Q and
// first K/V stages load while this tile finishes: at N = 1k a block per tile waited for its Q and
// first K for 10% of its time.
#include <cuda_runtime.h>

#include <type_traits>

#include "common/mask.hpp"
#include "cuda/forward/fwd_block.cuh"
#include "cuda/forward/softmax_fwd_sm80.cuh"
#include "cuda/forward/epilogue_fwd_sm90.cuh"
#include "cuda/forward/fwd_params_sm90.hpp"
#include "cuda/forward/scheduler_fwd_sm90.cuh"
#include "cuda/arch/panel_tile_sm90.cuh"
#include "cuda/arch/pingpong_sm90.cuh"
#include "cuda/arch/pipeline_sm90.cuh"
#include "cuda/arch/ptx_sm90.cuh"
#include "cuda/arch/wgmma_ops.cuh"

namespace tileattn::cuda {

// Keys per step: the O accumulator grows with the head dim, so S shrinks (128 + 40 registers at
// D = 256). Above D = 128, the widest step whose two K/V stages fit beside Q: 112 keys at D = 192,
// 80 at D = 256 (steps of 64 paid their waits and turns more often; docs/perf-log.md). At
// D = 128, long key ranges take 192 keys a step: fewer steps to pay each step's waits for,
// against a longer pipeline fill and a ragged last tile (H100, bf16: N = 16k 632-634 against
// 609-612 TFLOP/s, N = 1k 424-426 against 458-460).
constexpr int fwd_sm90_block_n(int head_dim, bool long_keys) {
  return head_dim > 192 ? 80 : head_dim > 128 ? 112 : long_keys && head_dim == 128 ? 192 : 128;
}
// Where the key range is long enough for the 192-key instance.
constexpr int kFwdSm90LongKeys = 8192;

// kConsumers warpgroups of 64 query rows each: two, or three at head dims up to 64 on long
// unmasked or causal problems (launch_fwd_sm90.cuh), where a step's products are short beside its softmax:
// two warpgroups' softmax then runs beside the third's products. 24 x 128 + 240 x 256 or
// 24 x 128 + 160 x 384 registers fit the 64K register file.
template <class T, int kHeadDim, int kBlockN_ = fwd_sm90_block_n(kHeadDim, false), bool kPersistent = false,
          int kConsumers_ = 2>
struct FwdSm90Traits {
  using Roles = sm90::WarpRoles<kConsumers_, 24, kConsumers_ == 3 ? 160 : 240>;
  static constexpr int kConsumers = Roles::kConsumers;
  static constexpr int kThreads = Roles::kThreads;
  static constexpr int kBlockM = 64 * kConsumers;
  static constexpr int kBlockN = kBlockN_;
  using QTile = sm90::PanelTile<kBlockM, kHeadDim>;
  using KVTile = sm90::PanelTile<kBlockN, kHeadDim>;
  static constexpr int kQBytes = QTile::kBytes;
  static constexpr int kKVBytes = KVTile::kBytes;
  static constexpr int kQStages = kPersistent ? 2 : 1;
  // Three K/V stages where they fit (128-key steps up to head dim 128), else two.
  static constexpr int kStages = kQStages * kQBytes + 3 * 2 * kKVBytes + 160 + 1024 <= 227 * 1024 ? 3 : 2;
  // Q's ring (its "full" barriers only, without kPersistent), then the K and V rings (the
  // consumers release each stage, one arrival a warp).
  using QRing = sm90::StageRing<kQStages>;
  using KVRing = sm90::StageRing<kStages>;
  enum Region { kQ, kK, kV, kBarriers };
  static constexpr int kQBarriers = kPersistent ? 2 * kQStages : 1;
  using Smem = sm90::SmemRegions<kQStages * kQBytes, kStages * kKVBytes, kStages * kKVBytes,
                                 8 * kQBarriers + 2 * KVRing::kBarrierBytes>;
  static constexpr int kSmemBytes = Smem::kBytes;
  static_assert(kHeadDim % 16 == 0 && kHeadDim <= 256, "sm90 forward: head dims 16..256 in steps of 16");
};

template <class T, int kHeadDim, int kBlockN_, bool kAlibi, bool kPersistent, int kConsumers, bool kSoftcap = false>
__global__ void __launch_bounds__(FwdSm90Traits<T, kHeadDim, kBlockN_, kPersistent, kConsumers>::kThreads, 1)
    fwd_kernel_sm90(const __grid_constant__ FwdSm90Params params) {
#if defined(TILEATTN_SM90_ENABLED)
  using Traits = FwdSm90Traits<T, kHeadDim, kBlockN_, kPersistent, kConsumers>;
  using Roles = typename Traits::Roles;
  using QTile = typename Traits::QTile;
  using KVTile = typename Traits::KVTile;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kKVBytes = Traits::kKVBytes;
  constexpr int kQBytes = Traits::kQBytes;
  // A step's key tile in two halves of whole k-steps, where a mask may hide one: not in the
  // 192-key and three-consumer instances (unmasked ranges only) nor at the wide head dims' steps.
  constexpr bool kHalves = kBlockN == 128 && kConsumers == 2;
  const FwdParams& p = params.fwd;

  extern __shared__ unsigned char smem_raw[];
  const typename Traits::Smem smem(smem_raw);
  unsigned char* sQ0 = smem.template at<Traits::kQ>();
  unsigned char* sK = smem.template at<Traits::kK>();
  unsigned char* sV = smem.template at<Traits::kV>();
  uint64_t* q_full = smem.template at<Traits::kBarriers, uint64_t>();
  const typename Traits::QRing q_ring{q_full};  // kPersistent: Q's buffers, filled and released per tile
  const typename Traits::KVRing k_ring{q_full + Traits::kQBarriers};
  const typename Traits::KVRing v_ring{k_ring.end()};

  // The tiles this block works on (scheduler_fwd_sm90.cuh); u: how many it has begun before.
  const FwdSm90Schedule<kPersistent> schedule(p, kBlockM);
  if constexpr (!kPersistent) {
    const FwdBlock first = fwd_block_of_this_cta(p, kBlockM);
    if (first.m0 >= first.seqlen_q) return;
  }

  if (threadIdx.x == 0) {
    if constexpr (kPersistent) q_ring.init(1, Traits::kConsumers);
    else sm90::barrier_init(q_full, 1);
    k_ring.init(1, 4 * Traits::kConsumers);
    v_ring.init(1, 4 * Traits::kConsumers);
    sm90::barrier_init_fence();
  }
  __syncthreads();

  const Roles roles;
  if (roles.warpgroup == 0) {
    Roles::enter_producer();
    if (threadIdx.x != 0) return;
    int i = 0;  // K/V items loaded, over all of this block's tiles
    const int group = p.heads_q / p.heads_kv;
    for (FwdWalk w = schedule.begin(); schedule.more(w); schedule.next(w)) {
      const int u = w.tile;
      const FwdBlock blk = schedule.tile(p, w);
      const Mask mask{blk.seqlen_q, blk.seqlen_k, p.window_left, p.window_right};
      const KeyTiles tiles = key_tiles(p, blk, mask, kBlockM, kBlockN, 1);
      if (tiles.begin >= tiles.end) return;  // no key (kPersistent: the launch rule leaves none so)
      const bool varlen = p.cu_seqlens_q != nullptr;
      const int kv_head = blk.head / group;
      const int batch = varlen ? 0 : blk.batch;
      uint64_t* q_bar = kPersistent ? q_ring.acquire_bytes(u, kQBytes) : q_full;
      if constexpr (!kPersistent) sm90::barrier_arrive_expect_bytes(q_full, kQBytes);
      QTile::template load<kBlockM>(sQ0 + q_ring.slot(u) * kQBytes, &params.q, q_bar, int(blk.q_row0) + blk.m0,
                                    blk.head, batch);
      for (int n = tiles.begin; n < tiles.end; ++n, ++i) {
        const int row = int(blk.k_row0) + n * kBlockN;
        uint64_t* k_full = k_ring.acquire_bytes(i, kKVBytes);
        KVTile::template load<kBlockN>(sK + k_ring.slot(i) * kKVBytes, &params.k, k_full, row, kv_head, batch);
        uint64_t* v_full = v_ring.acquire_bytes(i, kKVBytes);
        KVTile::template load<kBlockN>(sV + v_ring.slot(i) * kKVBytes, &params.v, v_full, row, kv_head, batch);
      }
    }
    return;
  }

  Roles::enter_consumer();
  const int consumer = roles.consumer();
  const int warp = Roles::warp(), lane = Roles::lane();
  const bool store_thread = threadIdx.x % 128 == 0;  // issues the consumer's TMA stores
  // The consumers issue their products in turn (pingpong_sm90.cuh), on and on across tiles.
  const sm90::PingPong<Traits::kConsumers> turns{consumer};
  if constexpr (kPersistent) turns.start();
  int i0 = 0;  // K/V items consumed before this tile
  for (FwdWalk w = schedule.begin(); schedule.more(w); schedule.next(w)) {
    const int u = w.tile;
    const FwdBlock blk = schedule.tile(p, w);
    const Mask mask{blk.seqlen_q, blk.seqlen_k, p.window_left, p.window_right};
    const KeyTiles tiles = key_tiles(p, blk, mask, kBlockM, kBlockN, 1);  // rows never packed (backend.cu)
    unsigned char* sQ = sQ0 + q_ring.slot(u) * kQBytes;
    const int row0 = blk.m0 + 64 * consumer + 16 * warp + lane / 4;  // sequence row of (g, e < 2)

    float acc_o[1][kHeadDim / 8][4];
#pragma unroll
    for (int ot = 0; ot < kHeadDim / 8; ++ot)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[0][ot][e] = 0.0f;
    RowStats<1> stats;
    stats.init();
    // The bias in raw score units, as the scores are kept (slope / scale: ScoreMod::alibi_bias).
    [[maybe_unused]] float slope_raw = 0.0f;
    if constexpr (kAlibi) slope_raw = p.mod.slope(blk.batch, blk.head) / p.mod.scale;

    if (tiles.begin < tiles.end) {
      // Descriptors are formed once per tile and stepped by adds (forming one from an address
      // takes a chain of four dependent instructions, on the way to each product).
      const uint64_t q_desc = QTile::k_major(smem_address(sQ) + consumer * 64 * 128, 0);
      float acc_s[1][kBlockN / 8][4];
      uint32_t pa[kBlockN / 16][4];  // P of the previous tile, rounded to T, in the A-fragment layout

      // Whether no row of this consumer sees the second half of the last tile visited (under a
      // causal mask, consumer 0 on the diagonal tile; else a ragged last tile): where it is the only
      // tile, its softmax takes the first half alone. S and P V stay whole (P is 0 past the half):
      // a narrower S accumulator in one branch made ptxas serialise every wgmma of the kernel, and
      // a P V over the first half in a branch made it fence the accumulators at six more places.
      const bool half0 =
          kHalves && (tiles.end - 1) * kBlockN + kBlockN / 2 >= mask.end_key(blk.m0 + 64 * consumer + 63);
      const int count = tiles.end - tiles.begin;
      // S = Q K^T of the i-th tile visited, issued (not waited for).
      auto issue_s = [&](int i) {
        const uint64_t k_desc = KVTile::k_major(smem_address(sK + k_ring.slot(i0 + i) * kKVBytes), 0);
        k_ring.wait(i0 + i);
        sm90::wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kHeadDim / 16; ++ks)
          sm90::Wgmma<T, kBlockN>::ss(acc_s[0], QTile::k_step(q_desc, ks), KVTile::k_step(k_desc, ks), ks > 0);
        sm90::wgmma_commit();
      };
      // Once that S has completed: K's stage goes back, the scores s (acc_s, or its first half) are
      // modified and folded into the row statistics (P in s; alpha: how much the output so far must
      // shrink).
      auto score = [&](int i, auto& s, float (&alpha)[1][2]) -> bool {
        sm90::fence_registers(acc_s[0]);
        k_ring.release_warp(i0 + i, lane);
        if constexpr (kSoftcap || kAlibi) {
          if (p.softcap_pre > 0.0f) softcap_scores(s, p.softcap_pre, p.softcap_post);
        }
        const int key0 = (tiles.begin + i) * kBlockN;
        if constexpr (kAlibi) alibi_scores(s, slope_raw, row0, key0, blk.seqlen_q, blk.seqlen_k);
        if (!(key0 >= tiles.full_begin && key0 + kBlockN <= tiles.full_end)) {
          if (mask.has_left()) mask_scores<true>(s, mask, row0, key0);
          else mask_scores<false>(s, mask, row0, key0);
        }
        return stats.fold(s, p.scale_log2, alpha);
      };
      // P rounded to T in the A-fragment layout: an S column-tile pair is one k-step of 16 keys.
      auto pack_p = [&](const auto& s) {
        constexpr int kSteps = int(std::extent_v<std::remove_reference_t<decltype(s[0])>>) / 2;
#pragma unroll
        for (int ks = 0; ks < kSteps; ++ks) {
          pa[ks][0] = pack2<T>(s[0][2 * ks][0], s[0][2 * ks][1]);
          pa[ks][1] = pack2<T>(s[0][2 * ks][2], s[0][2 * ks][3]);
          pa[ks][2] = pack2<T>(s[0][2 * ks + 1][0], s[0][2 * ks + 1][1]);
          pa[ks][3] = pack2<T>(s[0][2 * ks + 1][2], s[0][2 * ks + 1][3]);
        }
      };
      // O += P V of the i-th tile visited, issued.
      auto issue_pv = [&](int i) {
        const uint64_t v_desc = KVTile::n_major(smem_address(sV + v_ring.slot(i0 + i) * kKVBytes), 0);
        v_ring.wait(i0 + i);
        sm90::fence_registers(acc_o[0]);
        sm90::wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kBlockN / 16; ++ks)
          sm90::Wgmma<T, kHeadDim>::template rs<1>(acc_o[0], pa[ks], KVTile::n_step(v_desc, ks), 1);
        sm90::wgmma_commit();
      };
      auto release_v = [&](int i) {
        sm90::fence_registers(acc_o[0]);
        v_ring.release_warp(i0 + i, lane);
      };

      // Tile i's S is issued together with tile i - 1's P V, and its softmax runs while that
      // product is still on the tensor cores (FlashAttention-3's intra-warpgroup overlap). O is
      // rescaled for tile i only after tile i - 1's product has landed in it.
      float alpha[1][2];
      if constexpr (!kPersistent) turns.start();
      if constexpr (kPersistent) q_ring.wait(u);
      else sm90::barrier_wait(q_full, 0);
      turns.take();
      issue_s(0);
      turns.hand_over();
      // The previous tile's O has been read out of its Q buffer by now: the producer may refill it.
      if constexpr (kPersistent) {
        if (u > 0 && store_thread) {
          sm90::bulk_wait_read();
          sm90::barrier_arrive(q_ring.empty() + q_ring.slot(u - 1));
        }
      }
      sm90::wgmma_wait<0>();
      // O is still zero: nothing to rescale. Where the first tile is the only one and a mask hides
      // its second half from this consumer, the softmax and P take the first half alone, and P's
      // second half is 0, in the walk's instance (it runs the short causal ranges; the other
      // instances' wgmmas were serialised by ptxas with it).
      if (kPersistent && half0 && count == 1) {
        auto& first = reinterpret_cast<float(&)[1][kBlockN / 16][4]>(acc_s);
        score(0, first, alpha);
        pack_p(first);
#pragma unroll
        for (int ks = kBlockN / 32; ks < kBlockN / 16; ++ks) pa[ks][0] = pa[ks][1] = pa[ks][2] = pa[ks][3] = 0u;
      } else {
        score(0, acc_s, alpha);
        pack_p(acc_s);
      }
      for (int i = 1; i < count; ++i) {
        turns.take();
        issue_s(i);
        issue_pv(i - 1);
        turns.hand_over();
        sm90::wgmma_wait<1>();  // S of tile i
        const bool moved = score(i, acc_s, alpha);
        sm90::wgmma_wait<0>();  // P V of tile i - 1
        release_v(i - 1);
        if (moved) stats.rescale(acc_o, alpha);
        pack_p(acc_s);
      }
      turns.take();
      issue_pv(count - 1);
      turns.hand_over();
      if constexpr (!kPersistent) turns.finish();
      sm90::wgmma_wait<0>();
      release_v(count - 1);
      i0 += count;
    }

    // Rows that saw no key keep sum 0: O = 0 and L = -inf. The 192-key instance (long key ranges,
    // where the output's cost is small) stores directly: the staged epilogue's extra live values
    // made ptxas spill inside its mainloop.
    if constexpr (kBlockN > 128) {
      store_fwd_output<T>(p, blk, row0, acc_o, stats);
    } else {
      store_fwd_output_sm90<T, kHeadDim, QTile::kPanelBytes, kAlibi>(params, blk, row0, acc_o, stats,
                                                                    sQ + consumer * 64 * 128, consumer, !kPersistent);
    }
  }
  if constexpr (kPersistent) {
    turns.finish();
    if (store_thread) sm90::bulk_wait_read();  // the block's shared memory must outlive the copies' reads
  }
#endif
}

}  // namespace tileattn::cuda
