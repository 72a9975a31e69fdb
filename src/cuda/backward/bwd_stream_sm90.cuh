#pragma once
// What the Hopper backward kernels share: the block of keys (BwdKeyBlock) or of queries (dQ's own
// passes: BwdQueryBlock) and its steps, the barriers of what a block loads once beside its stage
// ring (BwdBarriers), the stage format and the producer threads that stream them
// (load_key_block, load_query_block), the two score products every step starts with (the step
// from them to P and dS is bwd::grads_to_fragments, bwd_grads.cuh), the dQ warp's reduction loop
// (reduce_dq_tiles) and the dK/dV epilogue (BwdKeyBlock::store_grads).
#include <cuda_runtime.h>

#include <cstdint>

#include "common/mask.hpp"
#include "common/score_mod.hpp"
#include "cuda/arch/pipeline_sm90.cuh"
#include "cuda/arch/ptx_sm90.cuh"
#include "cuda/arch/wgmma_ops.cuh"
#include "cuda/backward/bwd_grads.cuh"
#include "cuda/backward/bwd_params_sm90.hpp"
#include "cuda/backward/bwd_tile_io.cuh"
#include "cuda/common/bwd_params.hpp"

namespace tileattn::cuda {

// Keys [k0, k1) of sequence b under kv head hk, and its steps: the query tiles of kBlockM rows
// that see these keys, for every query head of the kv head's group, head by head.
//
// With p.dq_order (one length, no mask but the causal one: the launch rule), a query tile's dQ
// additions land in a fixed order: from the key block on the tile's diagonal down to block 0, then
// (unmasked) from the last block down. Each key block walks a head's tiles from its own diagonal
// tile on (unmasked: round to the tiles before it), so that a tile's additions come in that order
// a step or more apart and none waits long for the one before. Under the causal mask a block
// waits only for later key blocks, which the grid then starts first (every wait is on a block
// already running or done); unmasked, the order is a cycle, and the launch rule keeps a kv head's
// key blocks few enough to run at once.
template <int kBlockN, int kBlockM>
struct BwdKeyBlock {
  bwd::SeqInfo seq;
  Mask mask;
  bwd::TileSpan queries;
  int b, hk, group, k0, k1, n_iter;
  int shift;  // the walk's first tile, counted from queries.first

  // This CTA's block of the (key blocks, batch, kv heads) grid; k0 >= seq.sk: past the sequence.
  __device__ __forceinline__ explicit BwdKeyBlock(const bwd::BwdParams& p) : BwdKeyBlock(p, int(blockIdx.z)) {}
  // The same with the kv head given (a grid whose z also picks the pass).
  __device__ __forceinline__ BwdKeyBlock(const bwd::BwdParams& p, int hk_)
      : BwdKeyBlock(p, p.dq_order != nullptr && p.window_right == 0 ? int(gridDim.x - 1 - blockIdx.x) : int(blockIdx.x),
                    int(blockIdx.y), hk_, p.dq_order != nullptr) {}
  // Key block `block` of sequence b_ under kv head hk_; ordered: walked for p.dq_order.
  __device__ __forceinline__ BwdKeyBlock(const bwd::BwdParams& p, int block, int b_, int hk_, bool ordered = false)
      : seq(bwd::seq_info(p, b_)), mask(bwd::seq_mask(p, seq)), b(b_), hk(hk_), group(p.group), k0(block * kBlockN) {
    k1 = min(k0 + kBlockN, seq.sk);
    queries = bwd::tile_span(mask.tile_begin_query(k0), mask.tile_end_query(k1), kBlockM);
    n_iter = queries.count * group;
    shift = ordered ? k0 / kBlockM - queries.first : 0;
  }
  __device__ __forceinline__ int head(int it) const { return hk * group + it / queries.count; }
  __device__ __forceinline__ int q0(int it) const {
    int i = it % queries.count + shift;
    if (i >= queries.count) i -= queries.count;
    return (queries.first + i) * kBlockM;
  }
  // Whether no query of step it sees a key of the block's second half (consumer 1's keys): under a
  // causal mask, the diagonal step where query tiles are half a key block.
  __device__ __forceinline__ bool second_half_hidden(int it) const {
    return mask.end_key(min(q0(it) + kBlockM, seq.sq) - 1) <= k0 + kBlockN / 2;
  }
  // How many of step it's query tile's dQ additions land before this block's (p.dq_order's order).
  __device__ __forceinline__ int dq_rank(int it) const {
    const int blocks = (seq.sk + kBlockN - 1) / kBlockN, n = k0 / kBlockN;
    const int diagonal = min(blocks - 1, (min(q0(it) + kBlockM, seq.sq) - 1) / kBlockN);
    return n <= diagonal ? diagonal - n : diagonal + blocks - n;
  }

  // dK (times the scale) and dV from this thread's accumulators: the warp's rows row0.. of the
  // block, columns col0.. of the head dim.
  template <class T, int NT>
  __device__ __forceinline__ void store_grads(const bwd::BwdParams& p, int row0, int col0,
                                              const float (&dk)[1][NT][4], const float (&dv)[1][NT][4]) const {
    T* gdK = static_cast<T*>(p.dk.ptr) + bwd::seq_base(p, p.dk, b, false) + int64_t(hk) * p.dk.head +
             int64_t(k0 + row0) * p.dk.seq + col0;
    T* gdV = static_cast<T*>(p.dv.ptr) + bwd::seq_base(p, p.dv, b, false) + int64_t(hk) * p.dv.head +
             int64_t(k0 + row0) * p.dv.seq + col0;
    bwd::store_grad_frag<T>(p.pair_grads, dk, p.scale, gdK, p.dk.seq, k1 - k0 - row0, p.headdim_qk - col0);
    bwd::store_grad_frag<T>(p.pair_grads, dv, 1.0f, gdV, p.dv.seq, k1 - k0 - row0, p.headdim_v - col0);
  }
};

// Queries [q0, q1) of sequence b under query head h (dQ's own passes: a block per (query tile,
// head, batch), heavy tiles -- late rows under a causal mask -- launched first), and the key tiles
// of kBlockN keys they see; keys in [full_begin, full_end) are seen by every query of the block,
// so tiles inside need no mask arithmetic.
template <int kBlockM, int kBlockN>
struct BwdQueryBlock {
  int h, b;
  bwd::SeqInfo seq;
  int q0, q1;
  Mask mask;
  bwd::TileSpan keys;
  int full_begin, full_end;

  // This CTA's first query: heavy tiles first.
  __device__ __forceinline__ static int first_query() { return (int(gridDim.x) - 1 - int(blockIdx.x)) * kBlockM; }
  // The kernel returns before this when first_query() >= seq_.sq (the block is past the sequence):
  // formed before that test, the dQ passes' prologues compiled differently.
  __device__ __forceinline__ BwdQueryBlock(const bwd::BwdParams& p, const bwd::SeqInfo& seq_)
      : h(int(blockIdx.y)), b(int(blockIdx.z)), seq(seq_), q0(first_query()), q1(min(q0 + kBlockM, seq.sq)),
        mask(bwd::seq_mask(p, seq)),
        keys(bwd::tile_span(mask.tile_begin_key(q0), mask.tile_end_key(q1), kBlockN)),
        full_begin(mask.full_begin_key(q1)), full_end(mask.full_end_key(q0)) {}
  // A key tile's first key.
  __device__ __forceinline__ int key0(int i) const { return (keys.first + i) * kBlockN; }
  // Whether key tile [key0, key0 + kBlockN) needs the mask.
  __device__ __forceinline__ bool masked(int key0) const { return !(key0 >= full_begin && key0 + kBlockN <= full_end); }
};

// kStages stages of one step each, from `base`: Q, dO (tiles of kBlockM rows), then the rows'
// L * log2(e) and D; stages kStride bytes apart. kAlign = 1024 starts every stage on the swizzle
// period, for readers that swizzle addresses relative to a tile's start (the TF32 rewrite).
template <class QTile, int kBlockM, int kStages, int kAlign = 1>
struct BwdStages {
  static constexpr int kBytes = 2 * QTile::kBytes + 2 * kBlockM * 4;  // one stage's loads
  static constexpr int kStride = (kBytes + kAlign - 1) / kAlign * kAlign;
  unsigned char* base;
  __device__ __forceinline__ unsigned char* q(int s) const { return base + s * kStride; }
  __device__ __forceinline__ unsigned char* dout(int s) const { return q(s) + QTile::kBytes; }
  __device__ __forceinline__ float* lse2(int s) const { return reinterpret_cast<float*>(q(s) + 2 * QTile::kBytes); }
  __device__ __forceinline__ float* dsum(int s) const { return lse2(s) + kBlockM; }
};

// The barriers of a block's operands loaded once (K and V of a key block, Q and dO of a query
// block) and of the ring its steps stream through, kBytes of shared memory from `at`.
template <int kStages>
struct BwdBarriers {
  using Ring = sm90::StageRing<kStages>;
  static constexpr int kBytes = int(sizeof(uint64_t)) + Ring::kBarrierBytes;
  uint64_t* once;
  Ring ring;
  __device__ __forceinline__ explicit BwdBarriers(uint64_t* at) : once(at), ring{at + 1} {}

  // By the whole block, before anything waits: one TMA thread fills each barrier, `releases`
  // arrivals free a stage.
  __device__ __forceinline__ void init(int releases) const {
    if (threadIdx.x == 0) {
      sm90::barrier_init(once, 1);
      ring.init(1, releases);
      sm90::barrier_init_fence();
    }
    __syncthreads();
  }
  __device__ __forceinline__ void wait_once() const { sm90::barrier_wait(once, 0); }
  // A block that fills `once` again for each key block it walks: the uses-th fill.
  __device__ __forceinline__ void wait_once(int uses) const { sm90::barrier_wait(once, uint32_t(uses) & 1u); }
};

#if defined(TILEATTN_SM90_ENABLED)
// The producer thread: K and V of the block once, then each step's stage through the ring (freed
// by whoever reads the stage last). A block that walks several key blocks (kv_free given) passes
// the steps its earlier key blocks took (g0: the ring's items before this one's first) and how
// many of them loaded K and V (uses): this key block's first stage is loaded before K and V,
// which wait for kv_free (the consumers' release of the previous key block's K and V), so that
// the stage's latency hides behind the previous block's last step.
template <class KVTile, class QTile, int kBlockN, int kBlockM, int kStages, int kAlign>
__device__ __forceinline__ void load_key_block(const BwdSm90Params& params, const BwdKeyBlock<kBlockN, kBlockM>& kb,
                                               unsigned char* sK, unsigned char* sV,
                                               const BwdStages<QTile, kBlockM, kStages, kAlign>& stages,
                                               const BwdBarriers<kStages>& bars, int g0 = 0, int uses = 0,
                                               uint64_t* kv_free = nullptr) {
  const bwd::BwdParams& p = params.bwd;
  const int batch = p.cu_seqlens_q != nullptr ? 0 : kb.b;
  const int k_row = int(kb.seq.row_k) + kb.k0, q_base = int(kb.seq.row_q);
  auto load_stage = [&](int it) {
    const int g = g0 + it;
    const int s = g % kStages;  // in the loop's own words: see StageRing::acquire_bytes_slot
    const int h = kb.head(it), q0 = kb.q0(it);
    uint64_t* full = bars.ring.acquire_bytes_slot(g, s, stages.kBytes);
    QTile::template load<kBwdBoxRows>(stages.q(s), &params.q, full, q_base + q0, h, batch);
    QTile::template load<kBwdBoxRows>(stages.dout(s), &params.dout, full, q_base + q0, h, batch);
    const int64_t w = bwd::ws_row(p, kb.b, h) + q0;
    sm90::bulk_load(stages.lse2(s), p.lse2 + w, kBlockM * 4, full);
    sm90::bulk_load(stages.dsum(s), p.dsum + w, kBlockM * 4, full);
  };
  int first = 0;
  if (kv_free != nullptr && uses > 0) {
    load_stage(0);
    first = 1;
    sm90::barrier_wait(kv_free, uint32_t(uses - 1) & 1u);
  }
  sm90::barrier_arrive_expect_bytes(bars.once, 2 * KVTile::kBytes);
  KVTile::template load<kBwdBoxRows>(sK, &params.k, bars.once, k_row, kb.hk, batch);
  KVTile::template load<kBwdBoxRows>(sV, &params.v, bars.once, k_row, kb.hk, batch);
  for (int it = first; it < kb.n_iter; ++it) load_stage(it);
}

// The producer thread of dQ's own passes: Q and dO of the block once, then K and V of each key
// tile through the ring (stage s at stage_k(s), stage_v(s)), freed by the consumer warps.
template <class QTile, class KVTile, int kBlockM, int kBlockN, int kStages, class StageK, class StageV>
__device__ __forceinline__ void load_query_block(const BwdSm90Params& params, const BwdQueryBlock<kBlockM, kBlockN>& qb,
                                                 unsigned char* sQ, unsigned char* sdO, StageK stage_k, StageV stage_v,
                                                 const BwdBarriers<kStages>& bars) {
  const bwd::BwdParams& p = params.bwd;
  const int batch = p.cu_seqlens_q != nullptr ? 0 : qb.b;
  const int hk = qb.h / p.group;
  const int q_row = int(qb.seq.row_q) + qb.q0;
  const int k_base = int(qb.seq.row_k);
  sm90::barrier_arrive_expect_bytes(bars.once, 2 * QTile::kBytes);
  QTile::template load<kBwdBoxRows>(sQ, &params.q, bars.once, q_row, qb.h, batch);
  QTile::template load<kBwdBoxRows>(sdO, &params.dout, bars.once, q_row, qb.h, batch);
  for (int i = 0; i < qb.keys.count; ++i) {
    const int s = bars.ring.slot(i);
    uint64_t* full = bars.ring.acquire_bytes(i, 2 * KVTile::kBytes);
    KVTile::template load<kBwdBoxRows>(stage_k(s), &params.k, full, k_base + qb.key0(i), hk, batch);
    KVTile::template load<kBwdBoxRows>(stage_v(s), &params.v, full, k_base + qb.key0(i), hk, batch);
  }
}

// A dQ warp (a warp of the producer warpgroup; whole warps take part in named barriers): steps
// first, first + stride, ... of the key block, each an fp32 dQ tile of kTileBytes in kParts parts
// of kPartBytes (the last may be shorter) that the consumers write on their own (named barrier
// full0 + part, kBarrierThreads taking part), each added to its place in the workspace accumulator
// with one bulk reduction as soon as it is written (a tile's order keeps each part one run there
// too; rows past the sequence land in workspace padding). kOrdered, where p.dq_order is given: in
// its order, each tile's addition waited for until it has landed, which takes about a step at
// D = 64 (so the fused kernel gives the odd steps a second warp). With stride 2 the two warps take
// turns at the tile's barriers: this one waits on named barrier turn_wait (64 threads) before a
// step's first part and, once it holds the step's last part, lets the other go (turn_signal).
// tile(it) is where step it's tile lies; read(it, part) runs on the warp's first thread once the
// reduction has read the part, done(it, part) on the whole warp after that. Callers' lambdas
// capture by value: captured by reference, they changed the consumers' code before the loop (fused
// kernel) and throughout (wide kernel; SASS).
template <int kHeadDim, int kTileBytes, int kParts, int kPartBytes, int kBarrierThreads, bool kOrdered, int kBlockN,
          int kBlockM, class Tile, class Read, class Done>
__device__ __forceinline__ void reduce_dq_tiles(const bwd::BwdParams& p, const BwdKeyBlock<kBlockN, kBlockM>& kb,
                                                int n_iter, int full0, Tile tile, Read read, Done done,
                                                int first = 0, int stride = 1, int turn_wait = 0, int turn_signal = 0) {
  static_assert((kParts - 1) * kPartBytes < kTileBytes && kParts * kPartBytes >= kTileBytes, "parts cover the tile");
  const bool issuer = threadIdx.x % 32 == 0;
  for (int it = first; it < n_iter; it += stride) {
    // The tile's earlier additions have landed before this one starts.
    int* landed = nullptr;
    if (kOrdered && p.dq_order != nullptr) {
      landed = p.dq_order + (bwd::ws_row(p, kb.b, kb.head(it)) + kb.q0(it)) / 64;
      if (issuer) {
        const int rank = kb.dq_rank(it);
        // A wait far past any real one (about 40 s) means the order cannot complete: the kernel
        // ends in an error rather than holding the device.
        const long long start = clock64();
        while (sm90::load_acquire_gpu(landed) != rank)
          if (clock64() - start > (1ll << 36)) __trap();
        sm90::fence_async_global();
      }
      __syncwarp();
    }
    if (stride == 2 && it > 0) sm90::named_barrier_sync(turn_wait, 64);
#pragma unroll
    for (int part = 0; part < kParts; ++part) {
      constexpr int kLast = kTileBytes - (kParts - 1) * kPartBytes;
      sm90::named_barrier_sync(full0 + part, kBarrierThreads);
      if (stride == 2 && part + 1 == kParts && it + 1 < n_iter) sm90::named_barrier_arrive(turn_signal, 64);
      if (issuer) {
        const int64_t at = (bwd::ws_row(p, kb.b, kb.head(it)) + kb.q0(it)) * kHeadDim + part * (kPartBytes / 4);
        sm90::bulk_reduce_add(p.dq_accum + at, tile(it) + part * (kPartBytes / 4),
                              part + 1 < kParts ? kPartBytes : kLast);
        sm90::bulk_commit();
        sm90::bulk_wait_read();
        read(it, part);
      }
      __syncwarp();
      done(it, part);
    }
    if (landed != nullptr && issuer) {  // landed: the tile's next addition may start
      sm90::bulk_wait();
      sm90::fence_async_global();
      sm90::add_release_gpu(landed, 1);
    }
  }
}

// Producer warps 1-3 of the TF32 kernels: each of the n stages of `ring` rewritten K-major into
// one of t_ring's buffers by rewrite(stage, buffer) (tf32_operands_sm90.cuh), published once the
// three warps wrote it; the stage is released as one of its readers.
template <int kStages, class TRing, class Rewrite>
__device__ __forceinline__ void rewrite_stages(int n, const sm90::StageRing<kStages>& ring, const TRing& t_ring,
                                               int lane, Rewrite rewrite) {
  for (int i = 0; i < n; ++i) {
    const int s = i % kStages;  // in the loop's own words: see StageRing::wait_slot
    ring.wait_slot(i, s);
    t_ring.acquire(i);
    rewrite(s, t_ring.slot(i));
    sm90::fence_shared_to_async();
    t_ring.publish_warp(i, lane);
    ring.release_warp(i, lane);
  }
}

// S = A_s B_s^T and dP = A_dp B_dp^T over the head dim (every operand K-major in shared memory,
// ATile and BTile giving the k-step descriptors; TF32 for fp32), issued together and waited for.
template <class T, int kN, int kHeadDim, class ATile, class BTile>
__device__ __forceinline__ void score_products(float (&s)[1][kN / 8][4], float (&dp)[1][kN / 8][4], uint32_t a_s,
                                               uint32_t b_s, uint32_t a_dp, uint32_t b_dp) {
  constexpr int kSteps = kHeadDim / sm90::Wgmma<T, kN>::kK;
  // Each operand's descriptor is formed once and stepped by adds (sm90::descriptor_plus).
  const uint64_t as = ATile::k_major(a_s, 0), bs = BTile::k_major(b_s, 0);
  const uint64_t adp = ATile::k_major(a_dp, 0), bdp = BTile::k_major(b_dp, 0);
  sm90::wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks)
    sm90::Wgmma<T, kN>::ss(s[0], ATile::k_step(as, ks), BTile::k_step(bs, ks), ks > 0);
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks)
    sm90::Wgmma<T, kN>::ss(dp[0], ATile::k_step(adp, ks), BTile::k_step(bdp, ks), ks > 0);
  sm90::wgmma_commit();
  sm90::wgmma_wait<0>();
  sm90::fence_registers(s[0]);
  sm90::fence_registers(dp[0]);
}

// score_products with both A operands in registers (TF32 A fragments, tf32_a_fragments).
template <int kN, int kHeadDim, class BTile>
__device__ __forceinline__ void score_products_tf32(float (&s)[1][kN / 8][4], float (&dp)[1][kN / 8][4],
                                                    const uint32_t (&a_s)[kHeadDim / 8][4], uint32_t b_s,
                                                    const uint32_t (&a_dp)[kHeadDim / 8][4], uint32_t b_dp) {
  sm90::wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 8; ++ks) sm90::Wgmma<float, kN>::rs(s[0], a_s[ks], BTile::k_major(b_s, ks), ks > 0);
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 8; ++ks)
    sm90::Wgmma<float, kN>::rs(dp[0], a_dp[ks], BTile::k_major(b_dp, ks), ks > 0);
  sm90::wgmma_commit();
  sm90::wgmma_wait<0>();
  sm90::fence_registers(s[0]);
  sm90::fence_registers(dp[0]);
}
#endif

}  // namespace tileattn::cuda
