#pragma once
// The Hopper backward of fp32 attention in exact mode (split TF32): passes of one kernel shape,
// run in this order after the preprocess:
//   stats  (128 queries a block) each row's max and sum of the scaled scores and
//          D = rowsum(P dP) / rowsum(P), online over the row's key tiles, into the workspace;
//          with BwdParams::delta_from_out, blocks whose rows all see many keys run max_sum
//          instead: S alone, for the max and sum, D being the preprocess's rowsum(O dO)
//   dK     (128 keys a block)    S^T, dP^T, dS^T, dK += dS^T Q; and, where dQ is summed
//          (ExactPass::dkdq, head dim 64), dQ^T += K^T dS^T, each consumer's part of a step added
//          into the workspace's fp32 dQ by one bulk reduction
//   dV     (128 keys a block)    S^T, P^T, dV += P^T dO, in the dK pass's grid
//   dQ     (128 queries a block) S, dP, dS, dQ += dS K, where dQ is not summed (the
//          deterministic mode, head dim 32)
// the portable exact kernels' sequence (bwd_row_stats.cuh says why the statistics are rebuilt and
// D taken from the passes' own P and dP, and how dropout enters them) with every product on the
// tensor core; dropout's instances draw the mask per fragment (dropout_weights.cuh). Each pass streams
// 32 rows of the other side a step (64 where it forms no dP):
//   producer warp 0     one thread loads the block's rows once and each step's two tiles (and,
//                       rows being keys, the step's query statistics) with TMA
//   producer warps 1-3  split each step's tiles in place, x = hi + lo (fp32::split_tf32, both
//                       rounded to nearest), write the gradient product's B operand K-major in
//                       two parts (TF32 wgmma reads no N-major operand) and, rows being keys,
//                       the reciprocals of the step's row sums
//   consumers           64 rows each: the rows' hi parts in registers (A of every product), their
//                       lo parts over the loaded rows in shared memory
// A split product a b ~ a_lo b_hi + a_hi b_lo + a_hi b_hi, whatever the pass, in one order
// (q_lo k_hi, q_hi k_lo, then q_hi k_hi, 32 products an accumulator: the tensor core's sums drop
// bits toward zero, so few hi products meet in one), so that the passes' S and dP are the same
// sums term for term. A gradient step goes 32 products a dot into two fresh accumulators of 16 hi
// products, then is added to the gradient in fp32.
// dV has its own pass so that no consumer holds two gradients and two fresh sums: registers, not
// products, bound this shape (docs/perf-log.md). dQ's product in the dK pass reads K^T as A
// fragments loaded each step from the block's K (hi kept beside lo) and dS from a tile each
// consumer writes; shared memory then holds two stages, not three.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/mask.hpp"
#include "common/online_softmax.hpp"
#include "common/score_mod.hpp"
#include "cuda/arch/mma_fp32.cuh"
#include "cuda/arch/panel_tile_sm90.cuh"
#include "cuda/arch/pipeline_sm90.cuh"
#include "cuda/arch/ptx_sm90.cuh"
#include "cuda/arch/tf32_operands_sm90.cuh"
#include "cuda/arch/wgmma_ops.cuh"
#include "cuda/backward/bwd_grads.cuh"
#include "cuda/backward/bwd_params_sm90.hpp"
#include "cuda/backward/bwd_stream_sm90.cuh"
#include "cuda/backward/bwd_tile_io.cuh"
#include "cuda/common/bwd_params.hpp"
#include "cuda/common/dropout_weights.cuh"

namespace tileattn::cuda {

enum class ExactPass { stats, max_sum, dk, dkdq, dv, dq };

template <int kHeadDim, ExactPass kPass>
struct BwdExactSm90Traits {
  static constexpr bool kSumsDq = kPass == ExactPass::dkdq;    // dQ's product too, into the workspace
  static constexpr bool kRowsAreKeys = kPass == ExactPass::dk || kSumsDq || kPass == ExactPass::dv;
  static constexpr bool kStatsPass = kPass == ExactPass::stats || kPass == ExactPass::max_sum;
  static constexpr bool kHasDp = kPass != ExactPass::dv && kPass != ExactPass::max_sum;  // dP = dO V^T is formed
  static constexpr bool kLoadsY = kPass != ExactPass::max_sum;  // V or dO each step
  static constexpr bool kHasGrad = !kStatsPass;                 // a gradient product follows
  using Roles = sm90::WarpRoles<2, 56, 224>;
  static constexpr int kConsumers = Roles::kConsumers;
  static constexpr int kThreads = Roles::kThreads;
  static constexpr int kSplitThreads = 96;  // producer warps 1-3
  static_assert(kBwdExactBoxRows <= kSplitThreads, "one split thread a row sum");
  static constexpr int kDim = kHeadDim;
  static constexpr int kBlockRows = 64 * kConsumers;
  // Passes that hold no dP (max_sum, dV) take two boxes of the other side a step: their registers
  // allow it, a step's waits, hand-offs and shuffles are halved, and dV's score product is n64, not
  // n32 (the tensor core's rate falls with n). dV's stage is then 80 KB: two of them.
  static constexpr bool kWideStep = !kHasDp;
  static constexpr int kStep = kWideStep ? 2 * kBwdExactBoxRows : kBwdExactBoxRows;
  static constexpr int kStages = kSumsDq || (kWideStep && kHasGrad) ? 2 : 3;
  using RowTile = sm90::PanelTile<kBlockRows, kHeadDim, 4>;
  using StepTile = sm90::PanelTile<kStep, kHeadDim, 4>;
  using StepT = sm90::Tf32Transposed<kStep, kHeadDim>;
  static_assert(StepT::kBytes == StepTile::kBytes, "a step's tiles and their transposes take the same bytes");
  static constexpr int kTile = StepTile::kBytes;
  // The rows: Q, dO (queries) or K, V (keys); dV's pass holds K alone. Each consumer's lo parts go
  // over its rows; summing dQ, K's hi parts stay too, in a third tile.
  static constexpr int kRowTiles = kHasDp ? 2 : 1;
  static constexpr int kKeptTiles = kRowTiles + (kSumsDq ? 1 : 0);
  // Summing dQ: each consumer's dS of a step (queries x its 64 keys, K-major) in two parts, and
  // after dQ's product, its part of the step's dQ (queries x head dim, row-major) over them.
  using DsTile = sm90::PanelTile<kStep, 64, 4>;
  static constexpr int kDsBytes = kSumsDq ? 2 * DsTile::kBytes : 0;
  static_assert(!kSumsDq || (kHeadDim == 64 && kStep * kHeadDim * 4 <= kDsBytes),
                "dQ's product: m64 over the head dim; its part fits the dS tiles");
  // A stage: X (K or Q: the score product's B) and its lo part; Y (V or dO) and its lo part for
  // dP (dV's pass: the raw dO, read only to transpose); the gradient product's B (K^T, Q^T or
  // dO^T) in two parts. Beside it, rows being keys: the step's queries' max, sum and D, and the
  // split warps' reciprocals of the sums.
  static constexpr int kX = 0, kXLo = kTile, kY = 2 * kTile, kYLo = 3 * kTile;
  static constexpr int kZT = (kHasDp ? 4 : kLoadsY ? 3 : 2) * kTile;
  static constexpr int kStageBytes = kZT + (kHasGrad ? 2 * kTile : 0);
  static constexpr int kStatsBytes = kRowsAreKeys ? 3 * kStep * 4 : 0;
  static constexpr int kInvSums = kStatsBytes;
  static constexpr int kStatsStride = kRowsAreKeys ? kStatsBytes + kStep * 4 : 0;
  static constexpr bool kLoadsD = kRowsAreKeys && kHasDp;  // the queries' D, which dS needs and P does not
  static constexpr int kLoadBytes = (kLoadsY ? 2 : 1) * kTile + (kRowsAreKeys ? (kLoadsD ? 3 : 2) * kStep * 4 : 0);
  using Barriers = BwdBarriers<kStages>;
  using Ready = sm90::StageRing<kStages>;  // a stage's parts are written (its full barriers only)
  enum Region { kRows, kStagesRegion, kDs, kStats, kBarriers };
  using Smem = sm90::SmemRegions<kKeptTiles * RowTile::kBytes, kStages * kStageBytes, kConsumers * kDsBytes,
                                 kStages * kStatsStride, Barriers::kBytes + Ready::kBarrierBytes>;
  static constexpr int kSmemBytes = Smem::kBytes;
  static_assert(kHeadDim == 32 || kHeadDim == 64, "exact sm90 backward: head dims 32 and 64");
  static_assert(bwd::kWorkspaceRowTile % kStep == 0 && bwd::kWorkspaceRowTile % kBlockRows == 0,
                "query tiles never reach past the workspace padding");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory");
};

#if defined(TILEATTN_SM90_ENABLED)
namespace exact {

// x over itself as its hi part, its lo part at `lo` (same layout): threads [0, threads).
template <int kBytes>
__device__ __forceinline__ void split_in_place(unsigned char* x, unsigned char* lo, int tid, int threads) {
  float4* v = reinterpret_cast<float4*>(x);
  float4* l = reinterpret_cast<float4*>(lo);
#pragma unroll 2
  for (int i = tid; i < kBytes / 16; i += threads) {
    float4 hi, rest;
    fp32::split_tf32(v[i], hi, rest);
    v[i] = hi;
    l[i] = fp32::tf32_rn(rest);
  }
}

// S (or dP) of a step, the split product of the rows (a_hi in registers, a_lo the consumer's rows
// at descriptor a_lo) and the step's tile (descriptors b_hi, b_lo), issued into kSplitAccs
// accumulators and committed (split_sum waits and adds them). The terms go in the order (query lo,
// key hi), (query hi, key lo), (hi, hi) whichever side the rows are, the hi products kHiSteps
// k-steps (32 products) an accumulator.
constexpr int kHiSteps = 4;
template <int kD>
constexpr int kSplitAccs = kD / 8 / kHiSteps;

template <class RowTile, class StepTile, bool kRowsAreKeys, int kD, int kN>
__device__ __forceinline__ void split_scores(float (&acc)[kSplitAccs<kD>][kN / 8][4], const uint32_t (&a_hi)[kD / 8][4],
                                             uint64_t a_lo, uint64_t b_hi, uint64_t b_lo) {
  using Mma = sm90::Wgmma<float, kN>;
  sm90::wgmma_fence();
  if constexpr (!kRowsAreKeys) {
#pragma unroll
    for (int ks = 0; ks < kD / 8; ++ks)
      Mma::ss(acc[0], RowTile::k_step(a_lo, ks), StepTile::k_step(b_hi, ks), ks > 0);
#pragma unroll
    for (int ks = 0; ks < kD / 8; ++ks) Mma::rs(acc[0], a_hi[ks], StepTile::k_step(b_lo, ks), 1);
  } else {
#pragma unroll
    for (int ks = 0; ks < kD / 8; ++ks) Mma::rs(acc[0], a_hi[ks], StepTile::k_step(b_lo, ks), ks > 0);
#pragma unroll
    for (int ks = 0; ks < kD / 8; ++ks)
      Mma::ss(acc[0], RowTile::k_step(a_lo, ks), StepTile::k_step(b_hi, ks), 1);
  }
#pragma unroll
  for (int ks = 0; ks < kD / 8; ++ks)
    Mma::rs(acc[ks / kHiSteps], a_hi[ks], StepTile::k_step(b_hi, ks), ks >= kHiSteps && ks % kHiSteps == 0 ? 0 : 1);
  sm90::wgmma_commit();
}

template <int kAccs, int kN>
__device__ __forceinline__ void split_sum(float (&acc)[kAccs][kN / 8][4], float (&s)[kN / 8][4]) {
  sm90::wgmma_wait<0>();
#pragma unroll
  for (int a = 0; a < kAccs; ++a) sm90::fence_registers(acc[a]);
#pragma unroll
  for (int j = 0; j < kN / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float x = acc[0][j][e];
#pragma unroll
      for (int a = 1; a < kAccs; ++a) x += acc[a][j][e];
      s[j][e] = x;
    }
}

// A query row's running statistics over its key tiles: max m and sum l of exp(score - m), and
// with kWithD dn = sum of exp(score - m) dP, the sums in double (rescaled as m grows), as the
// portable pass sums P dP. Each of this thread's two rows (g, g + 8) has its own. Without D (rows
// of many keys) a step's terms meet in fp32 first and l takes one conversion a step: the
// conversions to double, not the products, bounded that pass.
template <bool kWithD>
struct OnlineRowStats {
  float m[2] = {-INFINITY, -INFINITY};
  double l[2] = {0.0, 0.0}, dn[2] = {0.0, 0.0};

  // One step's scores s (raw q.k) and dP of this thread's fragment, columns from key col0. With
  // dropout D sums P z dP (bwd_row_stats.cuh); the max and sum stay undropped.
  template <bool kCapped, bool kMasked, bool kAlibi, bool kDropout, int NT>
  __device__ __forceinline__ void add(const float (&s)[NT][4], const float (&dp)[NT][4], const bwd::Fragment& f,
                                      const bwd::BwdParams& p, float slope) {
    const int t = threadIdx.x % 4;
    [[maybe_unused]] Dropout dr;
    if constexpr (kWithD && kDropout) dr = p.dropout.resolved();
    [[maybe_unused]] const bwd::VisibleSpan<false> shown(f.mask, f.row, f.col0);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float v[NT][2];
      float tile_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          v[j][e] = bwd::stats_score<kCapped, kAlibi>(s[j][2 * half + e], f.row + 8 * half, f.col0 + j * 8 + 2 * t + e,
                                                      kMasked && !shown(half, j * 8 + e), slope, f.mask, p);
          tile_max = fmaxf(tile_max, v[j][e]);
        }
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      const float mn = fmaxf(m[half], tile_max);
      if (mn == -INFINITY) continue;  // nothing visible yet (the same in the whole quad)
      if (mn != m[half]) {
        const double factor = m[half] == -INFINITY ? 0.0 : double(expf(m[half] - mn));
        l[half] *= factor;
        dn[half] *= factor;
        m[half] = mn;
      }
      [[maybe_unused]] float step_sum = 0.0f;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        [[maybe_unused]] float keep[2];
        if constexpr (kWithD && kDropout)
          dropout_factors_of_query(dr, f.batch, f.head, f.row + 8 * half, f.col0 + j * 8 + 2 * t, keep);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float x = expf(v[j][e] - mn);
          if constexpr (kWithD) {
            l[half] += double(x);
            const float dpe = kDropout ? dp[j][2 * half + e] * keep[e] : dp[j][2 * half + e];
            dn[half] += double(x) * double(dpe);
          } else {
            step_sum += x;
          }
        }
      }
      if constexpr (!kWithD) l[half] += double(step_sum);
    }
  }

  template <bool kAlibi, bool kDropout, int NT>
  __device__ __forceinline__ void add(bool masked, const float (&s)[NT][4], const float (&dp)[NT][4],
                                      const bwd::Fragment& f, const bwd::BwdParams& p, float slope) {
    if (p.softcap > 0.0f) {
      if (masked) add<true, true, kAlibi, kDropout>(s, dp, f, p, slope);
      else add<true, false, kAlibi, kDropout>(s, dp, f, p, slope);
    } else {
      if (masked) add<false, true, kAlibi, kDropout>(s, dp, f, p, slope);
      else add<false, false, kAlibi, kDropout>(s, dp, f, p, slope);
    }
  }

  // The quad's sums merged (its lanes share m); lane t = 0 writes rows that saw a key: lse2 := m,
  // row_sum and, kWithD, D less dL (dl: the row's dlse, or null). Others keep the preprocess's
  // (+inf, 1, 0), which make P zero.
  __device__ __forceinline__ void store(const bwd::BwdParams& p, int64_t w, int row, int sq, const float* dl) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int off = 1; off < 4; off <<= 1) {
        l[half] += __shfl_xor_sync(0xffffffffu, l[half], off);
        dn[half] += __shfl_xor_sync(0xffffffffu, dn[half], off);
      }
      if (threadIdx.x % 4 == 0 && row + 8 * half < sq && l[half] > 0.0) {
        p.lse2[w + 8 * half] = m[half];
        p.row_sum[w + 8 * half] = float(l[half]);
        if constexpr (kWithD) p.dsum[w + 8 * half] = float(dn[half] / l[half] - (dl ? dl[8 * half] : 0.0f));
      }
    }
  }
};

// A consumer's share of dQ in the dK pass: dQ^T (head dim x step queries) += K^T dS^T over its 64
// keys, split as the other products (K^T's hi and lo parts as A fragments from the block's K, dS's
// from the tiles the consumer writes), then added into the workspace's fp32 dQ (rows of kD floats)
// by one bulk reduction. Its tiles: dS hi and lo (PanelTile<kStep, 64, 4>, the keys K-major), and
// over them once the product has read them, the step's dQ part row-major. One thread of the
// consumer issues the reductions.
template <class Traits>
struct DqSum {
  using DsTile = typename Traits::DsTile;
  static constexpr int kD = Traits::kDim, kStep = Traits::kStep, kBlockRows = Traits::kBlockRows;
  static constexpr int kLoOffset = -Traits::kRowTiles * Traits::RowTile::kBytes;
  unsigned char* tiles;
  const unsigned char* k_hi;  // the block's K: hi parts (Traits::RowTile), lo parts kLoOffset after
  int key0, consumer;

  // The lane and warp in the consumer, the thread index read again where used: the offsets they
  // give, hoisted out of the step loop, would hold registers the products need (spills).
  __device__ __forceinline__ static int tid() {
    uint32_t x;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(x));
    return int(x);
  }
  __device__ __forceinline__ static int lane() { return tid() % 32; }
  __device__ __forceinline__ static int warp() { return tid() / 32 % 4; }
  __device__ __forceinline__ static bool issuer() { return threadIdx.x % 128 == 0; }
  __device__ __forceinline__ void sync() const { sm90::named_barrier_sync(sm90::kBwdExactDs0 + consumer, 128); }

  // dS^T's fragments (keys of this warp's rows, the step's queries; see exact_grad_fragments) into
  // the tiles, once the last reduction has read them.
  template <int NT>
  __device__ __forceinline__ void write(const uint32_t (&hi)[NT][4], const uint32_t (&lo)[NT][4]) const {
    if (issuer()) sm90::bulk_wait_read();
    sync();
    const int w = warp(), g = lane() / 4, t = lane() % 4;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int at = sm90::tf32_panel_offset(8 * j + 2 * t + e, 16 * w + g + 8 * half, kStep);
          *reinterpret_cast<uint32_t*>(tiles + at) = hi[j][bwd::tf32_a_slot(half, e)];
          *reinterpret_cast<uint32_t*>(tiles + DsTile::kBytes + at) = lo[j][bwd::tf32_a_slot(half, e)];
        }
    sm90::fence_shared_to_async();
  }

  // The product over the written tiles, K^T's fragments loaded 32 keys at a time, then the part
  // into `dq` (the step's first query row of the workspace).
  __device__ __forceinline__ void add_dq(float* dq) const {
    using Mma = sm90::Wgmma<float, kStep>;
    sync();  // every warp's dS is written
    const uint64_t ds_hi = sm90::k_major_descriptor(smem_address(tiles));
    const uint64_t ds_lo = sm90::descriptor_plus(ds_hi, DsTile::kBytes);
    // An accumulator a half (its 32 keys' lo, then hi, products), the two summed once in fp32. The
    // tensor core's sums drop bits toward zero each time a product lands on a large accumulator:
    // with one accumulator taking both halves' lo terms after the first half's hi products, dQ
    // drifted toward zero past the 2x rule on short sequences. Not a pair of fresh accumulators
    // a half: with the first half's read and the second's restarting them (scale-d 0), ptxas
    // issued the second half's products alone and doubled them.
    float acc[2][kStep / 8][4];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      uint32_t kt_hi[4][4], kt_lo[4][4];
      const int k0 = key0 + 32 * half;
      sm90::tf32_a_fragments_of_transpose<32>(kt_hi, k_hi, kBlockRows, k0, 16 * warp(), lane());
      sm90::tf32_a_fragments_of_transpose<32>(kt_lo, k_hi + kLoOffset, kBlockRows, k0, 16 * warp(), lane());
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) Mma::rs(acc[half], kt_lo[kk], DsTile::k_step(ds_hi, 4 * half + kk), kk > 0);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) Mma::rs(acc[half], kt_hi[kk], DsTile::k_step(ds_lo, 4 * half + kk), 1);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) Mma::rs(acc[half], kt_hi[kk], DsTile::k_step(ds_hi, 4 * half + kk), 1);
    }
    sm90::wgmma_commit();
    float part[kStep / 8][4];
    split_sum<2, kStep>(acc, part);
    sync();  // every warp's product has read the tiles
    // Accumulator (row g + 8 (e / 2), column 8 j + 2 t + e % 2) of this warp's 16 head-dim rows:
    // dQ[query][d] at query * kD + d.
    float* out = reinterpret_cast<float*>(tiles);
    const int w = warp(), g = lane() / 4, t = lane() % 4;
#pragma unroll
    for (int j = 0; j < kStep / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) out[(8 * j + 2 * t + e % 2) * kD + 16 * w + g + 8 * (e / 2)] = part[j][e];
    sm90::fence_shared_to_async();
    sync();
    if (issuer()) {
      sm90::bulk_reduce_add(dq, out, kStep * kD * 4);
      sm90::bulk_commit();
    }
  }

  // Before the block ends: its last reduction has completed.
  __device__ __forceinline__ void drain() const {
    if (issuer()) sm90::bulk_wait();
  }
};

// One block of pass kPass: its rows' statistics or gradient; rows being keys, those of kv head
// `kv_head` (the grid's z picks the pass too: bwd_exact_keys_kernel_sm90).
template <int kHeadDim, ExactPass kPass, bool kAlibi, bool kDropout>
__device__ __forceinline__ void pass_block(const BwdSm90Params& params, [[maybe_unused]] int kv_head = 0) {
  using Traits = BwdExactSm90Traits<kHeadDim, kPass>;
  using Roles = typename Traits::Roles;
  using RowTile = typename Traits::RowTile;
  using StepTile = typename Traits::StepTile;
  using StepT = typename Traits::StepT;
  constexpr bool kRowsAreKeys = Traits::kRowsAreKeys, kHasDp = Traits::kHasDp, kHasGrad = Traits::kHasGrad;
  constexpr int D = kHeadDim, BR = Traits::kBlockRows, BS = Traits::kStep, kStages = Traits::kStages;
  const bwd::BwdParams& p = params.bwd;

  extern __shared__ unsigned char smem_raw[];
  const typename Traits::Smem smem(smem_raw);
  auto rows = [&](int r) { return smem.template at<Traits::kRows>() + r * RowTile::kBytes; };
  auto stage = [&](int s) { return smem.template at<Traits::kStagesRegion>() + s * Traits::kStageBytes; };
  auto stage_stats = [&](int s) {
    return reinterpret_cast<float*>(smem.template at<Traits::kStats>() + s * Traits::kStatsStride);
  };
  const typename Traits::Barriers bars(smem.template at<Traits::kBarriers, uint64_t>());
  const auto& ring = bars.ring;
  const typename Traits::Ready ready{ring.end()};

  // The block: its rows [r0, r1) of sequence b under head h (queries) or kv head h (keys), and
  // its steps: key tiles of BS (rows are queries), or query tiles of BS for every query head of
  // the group (rows are keys, BwdKeyBlock).
  int b, h, r0, r1, n_steps;
  bwd::SeqInfo seq;
  Mask mask;
  bwd::TileSpan keys{0, 0};
  if constexpr (kRowsAreKeys) {
    const BwdKeyBlock<BR, BS> kb(p, kv_head);
    b = kb.b, h = kb.hk, r0 = kb.k0, r1 = kb.k1, seq = kb.seq, mask = kb.mask, n_steps = kb.n_iter;
    keys = kb.queries;  // query tiles, for the head walk below
  } else {
    h = int(blockIdx.y), b = int(blockIdx.z);
    seq = bwd::seq_info(p, b);
    mask = bwd::seq_mask(p, seq);
    r0 = (int(gridDim.x) - 1 - int(blockIdx.x)) * BR;  // late causal rows (most keys) first
    r1 = min(r0 + BR, seq.sq);
    keys = r0 < seq.sq ? bwd::tile_span(mask.tile_begin_key(r0), mask.tile_end_key(r1), BS) : bwd::TileSpan{0, 0};
    n_steps = keys.count;
  }
  if (r0 >= (kRowsAreKeys ? seq.sk : seq.sq)) return;
  if constexpr (Traits::kStatsPass) {
    // The statistics pass this block's rows take (BwdParams::delta_from_out); the other exits.
    const bool from_out = p.delta_from_out && mask.fewest_visible_keys(r0, r1) >= bwd::kDeltaFromOutMinKeys;
    if (from_out != (kPass == ExactPass::max_sum)) return;
  }
  if constexpr (kPass == ExactPass::max_sum) {
    // Rows whose max and sum the forward handed over (BwdParams::fwd_stats) need no pass.
    if (p.fwd_stats != nullptr) {
      const int i = r0 + int(threadIdx.x);
      bool given = true;
      if (int(threadIdx.x) < BR && i < r1) given = !isnan(p.fwd_stats[2 * bwd::lse_index(p, seq, b, h, i) + 1]);
      if (__syncthreads_and(given)) return;
    }
  }
  // Step i's first column (key or query) and, rows being keys, its query head.
  auto col0 = [&](int i) { return (keys.first + (kRowsAreKeys ? i % keys.count : i)) * BS; };
  auto step_head = [&](int i) { return kRowsAreKeys ? h * p.group + i / keys.count : h; };

  if (threadIdx.x == 0) ready.init(Traits::kSplitThreads / 32, 1);
  bars.init(4 * Traits::kConsumers);

  const Roles roles;
  if (roles.warpgroup == 0) {
    Roles::enter_producer();
    const int warp = Roles::warp(), lane = Roles::lane();
    const int batch = p.cu_seqlens_q != nullptr ? 0 : b;
    if (warp == 0) {
      if (lane != 0 || n_steps == 0) return;
      const CUtensorMap* row_maps[2] = {kRowsAreKeys ? &params.k : &params.q, kRowsAreKeys ? &params.v : &params.dout};
      const CUtensorMap* step_maps[2] = {kRowsAreKeys ? &params.q : &params.k, kRowsAreKeys ? &params.dout : &params.v};
      const int row_base = int(kRowsAreKeys ? seq.row_k : seq.row_q);
      const int step_base = int(kRowsAreKeys ? seq.row_q : seq.row_k);
      sm90::barrier_arrive_expect_bytes(bars.once, Traits::kRowTiles * RowTile::kBytes);
#pragma unroll
      for (int r = 0; r < Traits::kRowTiles; ++r)
        RowTile::template load<kBwdExactBoxRows>(rows(r), row_maps[r], bars.once, row_base + r0, h, batch);
      for (int i = 0; i < n_steps; ++i) {
        const int s = i % kStages;  // in the loop's own words: see StageRing::acquire_bytes_slot
        unsigned char* st = stage(s);
        uint64_t* full = ring.acquire_bytes_slot(i, s, Traits::kLoadBytes);
        const int c0 = col0(i), hs = step_head(i);
        const int map_head = kRowsAreKeys ? hs : h / p.group;
        StepTile::template load<kBwdExactBoxRows>(st + Traits::kX, step_maps[0], full, step_base + c0, map_head, batch);
        if constexpr (Traits::kLoadsY)
          StepTile::template load<kBwdExactBoxRows>(st + Traits::kY, step_maps[1], full, step_base + c0, map_head,
                                                    batch);
        if constexpr (kRowsAreKeys) {
          const int64_t w = bwd::ws_row(p, b, hs) + c0;
          float* stats = stage_stats(s);
          sm90::bulk_load(stats, p.lse2 + w, BS * 4, full);
          sm90::bulk_load(stats + BS, p.row_sum + w, BS * 4, full);
          if constexpr (Traits::kLoadsD) sm90::bulk_load(stats + 2 * BS, p.dsum + w, BS * 4, full);
        }
      }
      return;
    }
    // Warps 1-3: each stage's parts, published once the three warps wrote them.
    const int tid = int(threadIdx.x) - 32;
    for (int i = 0; i < n_steps; ++i) {
      const int s = i % kStages;
      unsigned char* st = stage(s);
      ring.wait_slot(i, s);
      if constexpr (kHasGrad) {
        // dQ, dK: the transpose of X (K or Q) before X is split over itself; dV: of the raw dO.
        StepT::template write_split<2>(st + (kPass == ExactPass::dv ? Traits::kY : Traits::kX), st + Traits::kZT,
                                       tid, Traits::kSplitThreads);
        if constexpr (kPass != ExactPass::dv) sm90::named_barrier_sync(sm90::kBwdExactRawRead, Traits::kSplitThreads);
      }
      exact::split_in_place<Traits::kTile>(st + Traits::kX, st + Traits::kXLo, tid, Traits::kSplitThreads);
      if constexpr (kRowsAreKeys) {
        // The reciprocals of the step's row sums, for the consumers' P (bwd_grads.cuh).
        float* stats = stage_stats(s);
        if (tid < BS) stats[Traits::kInvSums / 4 + tid] = 1.0f / stats[BS + tid];
      }
      if constexpr (kHasDp)
        exact::split_in_place<Traits::kTile>(st + Traits::kY, st + Traits::kYLo, tid, Traits::kSplitThreads);
      sm90::fence_shared_to_async();
      ready.publish_warp(i, lane);
    }
    return;
  }

  Roles::enter_consumer();
  const int consumer = roles.consumer();
  const int warp = Roles::warp(), lane = Roles::lane();
  const int row0 = 64 * consumer + 16 * warp;  // this warp's first row of the block

  [[maybe_unused]] float grad[1][D / 8][4];
  if constexpr (kHasGrad) {
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) grad[0][j][e] = 0.0f;
  }
  [[maybe_unused]] exact::OnlineRowStats<kHasDp> stats;
  bwd::Fragment frag{nullptr, nullptr, {0.0f, 0.0f}, {0.0f, 0.0f}, 0, r0 + row0 + lane / 4, mask};
  frag.batch = b, frag.head = h;
  const int64_t w_rows = kRowsAreKeys ? 0 : bwd::ws_row(p, b, h) + r0 + row0 + lane / 4;  // past the end: padding

  if (n_steps > 0) {
    if constexpr (kPass == ExactPass::dq) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        frag.row_lse2[half] = p.lse2[w_rows + 8 * half];
        frag.row_sum[half] = p.row_sum[w_rows + 8 * half];
        frag.row_inv_sum[half] = 1.0f / frag.row_sum[half];
        frag.row_dsum[half] = p.dsum[w_rows + 8 * half];
      }
    }
    bars.wait_once();
    // The rows' hi parts into registers, then their lo parts over them (each consumer its own 64
    // rows, once all four of its warps have read theirs).
    uint32_t a0[D / 8][4];
    [[maybe_unused]] uint32_t a1[kHasDp ? D / 8 : 1][4];
    sm90::tf32_a_fragments<D>(a0, rows(0), BR, row0, lane);
    if constexpr (kHasDp) sm90::tf32_a_fragments<D>(a1, rows(1), BR, row0, lane);
    sm90::named_barrier_sync(sm90::kBwdExactRowsSplit0 + consumer, 128);
    {
      const int ctid = int(threadIdx.x) % 128;
#pragma unroll
      for (int r = 0; r < Traits::kRowTiles; ++r)
#pragma unroll
        for (int c = 0; c < RowTile::kPanels; ++c) {
          const int offset = c * RowTile::kPanelBytes + consumer * 64 * 128;
          float4* at = reinterpret_cast<float4*>(rows(r) + offset);
          [[maybe_unused]] float4* kept = reinterpret_cast<float4*>(rows(Traits::kRowTiles) + offset);
#pragma unroll 2
          for (int idx = ctid; idx < 64 * 8; idx += 128) {
            float4 hi, lo;
            fp32::split_tf32(at[idx], hi, lo);
            at[idx] = fp32::tf32_rn(lo);
            if constexpr (Traits::kSumsDq)
              if (r == 0) kept[idx] = hi;  // K's, for dQ's product
          }
        }
    }
    sm90::fence_shared_to_async();
    sm90::named_barrier_sync(sm90::kBwdExactRowsSplit0 + consumer, 128);
    const uint64_t lo0 = sm90::k_major_descriptor(smem_address(rows(0)) + consumer * 64 * 128);
    const uint64_t lo1 = sm90::k_major_descriptor(smem_address(rows(Traits::kRowTiles - 1)) + consumer * 64 * 128);
    [[maybe_unused]] exact::DqSum<Traits> ds_tiles{
        smem.template at<Traits::kDs>() + consumer * Traits::kDsBytes, rows(Traits::kRowTiles), 64 * consumer,
        consumer};
    // Rows every column of a step sees in full need no mask arithmetic (rows are queries).
    const int full_begin = kRowsAreKeys ? 0 : mask.full_begin_key(r1);
    const int full_end = kRowsAreKeys ? 0 : mask.full_end_key(r0);

    for (int i = 0; i < n_steps; ++i) {
      const int s = i % kStages;  // in the loop's own words: see StageRing::wait_slot
      const unsigned char* st = stage(s);
      // Every operand's descriptor: the stage's plus the operand's offset in it.
      const uint64_t st_desc = sm90::k_major_descriptor(smem_address(st));
      auto at = [&](int offset) { return sm90::descriptor_plus(st_desc, offset); };
      const int c0 = col0(i);
      const float slope = kAlibi ? p.mod.slope(b, step_head(i)) : 0.0f;
      ready.wait_slot(i, s);

      // S and dP issued together, then summed.
      constexpr int kAccs = exact::kSplitAccs<D>;
      float sc[BS / 8][4];
      [[maybe_unused]] float dp[BS / 8][4];
      {
        float acc_s[kAccs][BS / 8][4];
        [[maybe_unused]] float acc_dp[kAccs][BS / 8][4];
        exact::split_scores<RowTile, StepTile, kRowsAreKeys, D, BS>(acc_s, a0, lo0, at(Traits::kX), at(Traits::kXLo));
        if constexpr (kHasDp)
          exact::split_scores<RowTile, StepTile, kRowsAreKeys, D, BS>(acc_dp, a1, lo1, at(Traits::kY),
                                                                      at(Traits::kYLo));
        exact::split_sum<kAccs, BS>(acc_s, sc);
        if constexpr (kHasDp) exact::split_sum<kAccs, BS>(acc_dp, dp);
      }

      frag.col0 = c0;
      if constexpr (kRowsAreKeys) frag.head = step_head(i);
      bool masked;
      if constexpr (kRowsAreKeys) {
        const float* col_stats = stage_stats(s);
        frag.col_lse2 = col_stats;
        frag.col_sum = col_stats + BS;
        frag.col_inv_sum = col_stats + Traits::kInvSums / 4;
        frag.col_dsum = col_stats + 2 * BS;
        masked = !(mask.full_begin_key(min(c0 + BS, seq.sq)) <= r0 && mask.full_end_key(c0) >= r0 + BR);
      } else {
        masked = !(c0 >= full_begin && c0 + BS <= full_end);
      }

      if constexpr (Traits::kStatsPass) {
        stats.template add<kAlibi, kDropout>(masked, sc, dp, frag, p, slope);  // dp unread without D
      } else {
        uint32_t g_hi[BS / 8][4], g_lo[BS / 8][4];
        if constexpr (kPass == ExactPass::dv)
          bwd::exact_grad_fragments<true, true, kAlibi, kDropout>(masked, sc, sc, frag, p, g_hi, g_lo, slope);
        else
          bwd::exact_grad_fragments<kRowsAreKeys, false, kAlibi, kDropout>(masked, sc, dp, frag, p, g_hi, g_lo, slope);

        // dS for dQ's product, before dK's product reads the same registers (a wgmma's A registers
        // may not be read until it completes).
        if constexpr (Traits::kSumsDq) ds_tiles.write(g_hi, g_lo);
        // This step's gradient terms, 32 positions at a time, in two fresh accumulators of 16 hi
        // products each (the lo terms first, in the first), added to the gradient in fp32: more hi
        // products an accumulator failed the 2x rule on dV (docs/perf-log.md).
        const uint64_t zt_hi = at(Traits::kZT), zt_lo = at(Traits::kZT + StepT::kBytes);
        using Mma = sm90::Wgmma<float, D>;
        float fresh[2][D / 8][4];
#pragma unroll
        for (int k0 = 0; k0 < BS / 8; k0 += 4) {
          sm90::wgmma_fence();
#pragma unroll
          for (int kk = k0; kk < k0 + 4; ++kk) Mma::rs(fresh[0], g_lo[kk], StepT::k_step(zt_hi, kk), kk > k0);
#pragma unroll
          for (int kk = k0; kk < k0 + 4; ++kk) Mma::rs(fresh[0], g_hi[kk], StepT::k_step(zt_lo, kk), 1);
#pragma unroll
          for (int kk = k0; kk < k0 + 4; ++kk)
            Mma::rs(fresh[(kk - k0) / 2], g_hi[kk], StepT::k_step(zt_hi, kk), kk == k0 + 2 ? 0 : 1);
          sm90::wgmma_commit();
          sm90::wgmma_wait<0>();
          sm90::fence_registers(fresh[0]);
          sm90::fence_registers(fresh[1]);
#pragma unroll
          for (int j = 0; j < D / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) grad[0][j][e] += fresh[0][j][e] + fresh[1][j][e];
        }
      }
      ring.release_warp(i, lane);  // the stage is read
      if constexpr (Traits::kSumsDq) ds_tiles.add_dq(p.dq_accum + (bwd::ws_row(p, b, step_head(i)) + c0) * D);
    }
    if constexpr (Traits::kSumsDq) ds_tiles.drain();
  }

  if constexpr (Traits::kStatsPass) {
    const int row = r0 + row0 + lane / 4;
    stats.store(p, w_rows, row, seq.sq, p.dlse ? p.dlse + bwd::lse_index(p, seq, b, h, row) : nullptr);
  } else if constexpr (kPass == ExactPass::dq) {
    float* g = static_cast<float*>(p.dq.ptr) + bwd::seq_base(p, p.dq, b, true) + int64_t(h) * p.dq.head +
               int64_t(r0 + row0) * p.dq.seq;
    bwd::store_grad_frag<float>(false, grad, p.scale, g, p.dq.seq, r1 - r0 - row0, p.headdim_qk);
  } else {
    constexpr bool kDk = kPass != ExactPass::dv;
    const bwd::Strided& t = kDk ? p.dk : p.dv;
    float* g = static_cast<float*>(t.ptr) + bwd::seq_base(p, t, b, false) + int64_t(h) * t.head +
               int64_t(r0 + row0) * t.seq;
    bwd::store_grad_frag<float>(false, grad, kDk ? p.scale : 1.0f, g, t.seq, r1 - r0 - row0,
                                kDk ? p.headdim_qk : p.headdim_v);
  }
}

}  // namespace exact
#endif

// The passes whose rows are queries (statistics, dQ): grid (query tiles, heads, batch).
template <int kHeadDim, ExactPass kPass, bool kAlibi, bool kDropout>
__global__ void __launch_bounds__(BwdExactSm90Traits<kHeadDim, kPass>::kThreads, 1)
    bwd_exact_kernel_sm90(const __grid_constant__ BwdSm90Params params) {
  static_assert(!BwdExactSm90Traits<kHeadDim, kPass>::kRowsAreKeys, "keys' passes: bwd_exact_keys_kernel_sm90");
#if defined(TILEATTN_SM90_ENABLED)
  exact::pass_block<kHeadDim, kPass, kAlibi, kDropout>(params);
#endif
}

// The dK pass (kDk: dk, or dkdq summing dQ) and dV's, which reads none of its output, as one grid
// of (key blocks, batch, 2 x kv heads): z below the kv heads takes the dK pass, the rest dV's, so
// that every dK block, the longer, is handed out before any dV block, which fill the last wave.
// At 1024 keys the two fill the card's two halves at once; dV launched as the dK pass's
// programmatic dependent also ran beside it, but 3.3x slower than alone (docs/perf-log.md).
template <int kHeadDim, ExactPass kDk, bool kAlibi, bool kDropout>
__global__ void __launch_bounds__(BwdExactSm90Traits<kHeadDim, kDk>::kThreads, 1)
    bwd_exact_keys_kernel_sm90(const __grid_constant__ BwdSm90Params params) {
  static_assert(kDk == ExactPass::dk || kDk == ExactPass::dkdq, "the dK pass");
  static_assert(BwdExactSm90Traits<kHeadDim, kDk>::kThreads == BwdExactSm90Traits<kHeadDim, ExactPass::dv>::kThreads &&
                    BwdExactSm90Traits<kHeadDim, kDk>::kBlockRows ==
                        BwdExactSm90Traits<kHeadDim, ExactPass::dv>::kBlockRows,
                "one block shape for both passes");
#if defined(TILEATTN_SM90_ENABLED)
  const int heads = int(gridDim.z) / 2, z = int(blockIdx.z);
  if (z < heads) exact::pass_block<kHeadDim, kDk, kAlibi, kDropout>(params, z);
  else exact::pass_block<kHeadDim, ExactPass::dv, kAlibi, kDropout>(params, z - heads);
#endif
}

}  // namespace tileattn::cuda
