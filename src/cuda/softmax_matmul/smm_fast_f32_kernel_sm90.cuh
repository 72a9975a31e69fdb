#pragma once
// fp32 fast-mode softmax(X) @ V on Hopper for column slices of 256, computed transposed:
// out^T = V^T P^T. TF32 wgmma reads B from shared memory only K-major, and V is N-major, so the
// untransposed kernel (smm_kernel_sm90.cuh) rewrites every V tile. Here the roles swap:
//
//   warpgroup 0      loads: one thread issues X's TMA copies, another V's, each as soon as a
//                    stage is free.
//   warpgroup 1      softmax: thread r owns row r of the block's 128 rows of X. It reads its
//                    row of the tile from the TMA stage, updates the row's max and sum, and
//                    writes P (TF32-rounded) back over X in the same place. P is then the
//                    K-major B operand (N = 128 rows of X), exactly as TMA laid X out.
//   warpgroups 2, 3  products, 128 output columns each (two m64n128k8 per k-step): A = V^T is
//                    read from the V stage straight into the A-fragment layout (registers take
//                    any layout), so nothing is transposed through shared memory.
//
// The loads have a warpgroup of their own, at 24 registers, because any wait on a product
// warp's path idles the tensor cores (H100: 0.96-0.98 ms against 1.08-1.10 with the loads issued
// from a product warpgroup; docs/perf.md).
//
// CTAs run in pairs on neighbouring row bands of the same column slice, each loading half of
// every V tile into both (multicast): a third less L2 traffic per tile (whole kernel 1.08 ms
// against 1.25 unpaired).
//
// Orders inside a tile are free where both operands agree:
// - columns (M): accumulator rows g and g + 8 of a warp's 16 are output columns 2g and 2g + 1,
//   so a thread's two A values of a key are one 8-byte load;
// - keys (K): k-step slot s holds key 8 ks + key_of_slot(s), and the softmax writes P in that
//   order. The 16 lanes that one 8-byte load serves at a time then read rows with k % 8 in
//   {0, 2, 4, 6} (or {1, 3, 5, 7}), whose 128-byte swizzles put their 32 bytes in four different
//   quarters of the banks: two wavefronts per load, the minimum (the natural order took four).
//
// The reference row max moves only when a row passes it by 2^kSlack, and then to a whole number
// (lazy_row_max, as in the untransposed kernel); when a row's does, its factor goes to shared
// memory beside P and a per-warp flag tells the product warpgroups to rescale before adding the
// tile.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/online_softmax.hpp"
#include "cuda/arch/pipeline_sm90.cuh"
#include "cuda/arch/ptx_sm80.cuh"
#include "cuda/arch/ptx_sm90.cuh"
#include "cuda/softmax_matmul/smm_kernel_sm90.cuh"
#include "cuda/arch/smm_ptx.cuh"
#include "cuda/arch/wgmma_ops.cuh"

namespace tileattn::cuda::smm {

struct Sm90FastF32Tile {
  static constexpr int kThreads = 512;
  static constexpr int kBlockRows = 128;   // rows of X (wgmma N)
  static constexpr int kBlockCols = 256;   // output columns: 128 per product warpgroup (2 x M = 64)
  static constexpr int kBlockK = 32;       // keys per stage: one 128-byte row of X
  static constexpr int kKSteps = kBlockK / 8;
  // (Depths from 4/4 to 7/3 ran within their spread, 3/5 about 10% slower: docs/perf-log.md.)
  static constexpr int kXStages = 6;
  static constexpr int kVStages = 3;
  // CTAs on neighbouring row bands that share V tiles: pairs, because only 30 clusters of four
  // fit at once against 66 pairs, so 512 blocks would take five waves, not four.
  static constexpr int kCluster = 2;
  static constexpr int kXBytes = kBlockRows * 128;
  static constexpr int kVPanelBytes = kBlockK * 128;  // 32 keys x 32 columns
  static constexpr int kVBytes = (kBlockCols / 32) * kVPanelBytes;
  // X's ring, whose stages the softmax also publishes as P (p_full, one barrier per stage), and
  // V's, which every product warp of the cluster releases.
  using XRing = sm90::StageRing<kXStages>;
  using VRing = sm90::StageRing<kVStages>;
  enum Region { kX, kV, kFactors, kFlags, kInvSum, kBarriers };
  using Smem = sm90::SmemRegions<kXStages * kXBytes, kVStages * kVBytes,
                                 kXStages * kBlockRows * 4,  // [stage][row] rescale factors
                                 kXStages * 16,              // [stage][softmax warp] "a factor moved"
                                 kBlockRows * 4,             // the row sums' inverses
                                 XRing::kBarrierBytes + 8 * kXStages + VRing::kBarrierBytes + 8>;
  static constexpr int kSmemBytes = Smem::kBytes;
  static_assert(kSmemBytes <= 227 * 1024, "softmax_matmul sm90 fast f32: stages exceed shared memory");
  // 24 + 72 + 2 x 208 = 512 registers over four warpgroups: the launch allocation at 512 threads.
  static constexpr int kLoaderRegisters = 24;
  static constexpr int kSoftmaxRegisters = 72;
  static constexpr int kProductRegisters = 208;
};

// The key (within its group of 8) at slot s of a k-step: 0, 2, 4, 6, 1, 3, 5, 7.
__device__ __forceinline__ constexpr int key_of_slot(int s) { return 2 * (s % 4) + s / 4; }

__global__ void __cluster_dims__(Sm90FastF32Tile::kCluster, 1, 1) __launch_bounds__(Sm90FastF32Tile::kThreads, 1)
    softmax_matmul_fast_f32_kernel_sm90(const __grid_constant__ Sm90Params p) {
#if defined(TILEATTN_SM90_ENABLED)
  using Tile = Sm90FastF32Tile;
  constexpr int kXSt = Tile::kXStages, kBlockK = Tile::kBlockK, kKSteps = Tile::kKSteps;
  constexpr float kSlack = 8.0f;

  extern __shared__ unsigned char smem_raw[];
  const Tile::Smem smem(smem_raw);
  unsigned char* sX = smem.at<Tile::kX>();  // X as loaded, then P over it
  unsigned char* sV = smem.at<Tile::kV>();
  float* factors = smem.at<Tile::kFactors, float>();
  int* flags = smem.at<Tile::kFlags, int>();
  float* inv_sum = smem.at<Tile::kInvSum, float>();
  const Tile::XRing x_ring{smem.at<Tile::kBarriers, uint64_t>()};
  uint64_t* p_full = x_ring.end();  // [kXSt]: P is in stage s
  const Tile::VRing v_ring{p_full + kXSt};
  uint64_t* sums_ready = v_ring.end();  // the row sums' inverses are in inv_sum

  // Clusters of two CTAs on neighbouring row bands and the same column slice: each loads half of
  // every V tile into both. The slices of a band pair are neighbours, so X's second read is
  // from L2.
  constexpr int kCluster = Tile::kCluster;
  const uint32_t rank = sm90::cluster_rank();
  const int cluster = int(blockIdx.x) / kCluster, batch = int(blockIdx.y);
  const int band = kCluster * (cluster / p.d3_blocks) + int(rank), slice = cluster % p.d3_blocks;
  const int r0 = band * Tile::kBlockRows, c0 = slice * Tile::kBlockCols;
  const int n_tiles = (p.d2 + kBlockK - 1) / kBlockK;

  if (threadIdx.x == 0) {
    x_ring.init(1, 8);  // released by every product warp, once its products have completed
    for (int s = 0; s < kXSt; ++s) sm90::barrier_init(p_full + s, 4);  // every softmax warp
    v_ring.init(1, 8 * kCluster);  // the product warps of every CTA
    sm90::barrier_init(sums_ready, 4);  // every softmax warp
    sm90::barrier_init_fence();
  }
  sm90::cluster_sync();

  const int warpgroup = int(threadIdx.x) / 128;
  const int warp = (int(threadIdx.x) / 32) % 4, lane = int(threadIdx.x) % 32;

  // Tile i of X (of V) into its stage once tile i - stages let it go.
  auto issue_x = [&](int i) {
    uint64_t* full = x_ring.acquire_bytes(i, Tile::kXBytes);
    sm90::tma_load_4d(sX + x_ring.slot(i) * Tile::kXBytes, &p.x, full, i * kBlockK, r0, 0, batch);
  };
  // This CTA's half of V tile i, into both CTAs; each CTA's barrier expects the whole tile.
  auto issue_v = [&](int i) {
    constexpr int kPanels = Tile::kVBytes / Tile::kVPanelBytes;
    uint64_t* full = v_ring.acquire_bytes(i, Tile::kVBytes);
#pragma unroll
    for (int h = 0; h < kPanels / kCluster; ++h) {
      const int c = int(rank) * (kPanels / kCluster) + h;
      sm90::tma_load_4d_multicast(sV + v_ring.slot(i) * Tile::kVBytes + c * Tile::kVPanelBytes, &p.v, full,
                                  uint16_t((1u << kCluster) - 1),
                                  c0 + 32 * c, i * kBlockK, 0, batch);
    }
  };

  if (warpgroup == 0) {
    sm90::registers_decrease<Tile::kLoaderRegisters>();
    if (lane == 0 && warp == 0)
      for (int i = 0; i < n_tiles; ++i) issue_x(i);
    else if (lane == 0 && warp == 1)
      for (int i = 0; i < n_tiles; ++i) issue_v(i);
  } else if (warpgroup == 1) {
    sm90::registers_decrease<Tile::kSoftmaxRegisters>();
    const int row = int(threadIdx.x) - 128;
    float row_max = -INFINITY, row_sum = 0.0f;

    const int swz = row % 8;
    for (int i = 0; i < n_tiles; ++i) {
      const int s = x_ring.slot(i);
      x_ring.wait(i);
      unsigned char* xr = sX + s * Tile::kXBytes + row * 128;
      float x[kBlockK];
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const float4 u = *reinterpret_cast<const float4*>(xr + ((c ^ swz) * 16));
        x[4 * c] = u.x, x[4 * c + 1] = u.y, x[4 * c + 2] = u.z, x[4 * c + 3] = u.w;
      }
      const int n0 = i * kBlockK;
      if (n0 + kBlockK > p.d2) {
#pragma unroll
        for (int j = 0; j < kBlockK; ++j)
          if (n0 + j >= p.d2) x[j] = -INFINITY;
      }
      const float tile_max = tree_reduce(x, [](float a, float b) { return fmaxf(a, b); });
      const float mx = lazy_row_max(row_max, tile_max * kLog2e, kSlack);  // log2 domain
      const float factor = rescale_factor(row_max, mx);
      const bool moved = mx != row_max;
      row_max = mx;
      const float base = safe_row_max(row_max);
#pragma unroll
      for (int j = 0; j < kBlockK; ++j) x[j] = exp2_fast(fmaf(x[j], kLog2e, -base));
      row_sum = row_sum * factor + tree_reduce(x, [](float a, float b) { return a + b; });
      // Chunk 2 ks + h holds slots 4h .. 4h + 3 of k-step ks.
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const int k0 = 8 * (c / 2), s0 = 4 * (c % 2);
        const uint4 q = make_uint4(tf32_bits(x[k0 + key_of_slot(s0)]), tf32_bits(x[k0 + key_of_slot(s0 + 1)]),
                                   tf32_bits(x[k0 + key_of_slot(s0 + 2)]), tf32_bits(x[k0 + key_of_slot(s0 + 3)]));
        *reinterpret_cast<uint4*>(xr + ((c ^ swz) * 16)) = q;
      }
      factors[s * Tile::kBlockRows + row] = factor;
      const bool warp_moved = __any_sync(0xffffffffu, moved);
      if (lane == 0) flags[4 * s + warp] = warp_moved ? 1 : 0;
      sm90::fence_shared_to_async();  // P is read by wgmma (async proxy)
      __syncwarp();
      if (lane == 0) sm90::barrier_arrive(p_full + s);
    }
    inv_sum[row] = inverse_row_sum(row_sum);
    __syncwarp();
    if (lane == 0) sm90::barrier_arrive(sums_ready);
  } else {
    sm90::registers_increase<Tile::kProductRegisters>();
    const int wg = warpgroup - 2;
    const int g = lane / 4, t = lane % 4;

    float acc[2][16][4];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int n = 0; n < 16; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][n][e] = 0.0f;
    // A fragments of V^T for one tile: [k-step][m64 half][e]. A tile's products are two commit
    // groups of two k-steps; a group's fragments are reloaded for the next tile once it has
    // completed, while the other group keeps the tensor cores busy. (Two whole tiles of
    // fragments leave ptxas too few registers, and one group per k-step with wait_group 3 it
    // cannot follow: either way it serialises every wgmma.)
    uint32_t fr[kKSteps][2][4];

    // Column 128 wg + 64 j + 16 warp + 2 g (+1) of the slice is in panel 4 wg + 2 j + warp / 2,
    // 16-byte chunk 4 (warp % 2) + g / 2, byte 8 (g % 2); key 8 ks + kp is row 8 ks + kp.
    const int chunk = 4 * (warp % 2) + g / 2;
    const int kp_lo = key_of_slot(t), kp_hi = key_of_slot(t + 4);
    const int panel0 = (4 * wg + warp / 2) * Tile::kVPanelBytes + 8 * (g % 2);
    const int off_lo = panel0 + kp_lo * 128 + ((chunk ^ kp_lo) * 16);
    const int off_hi = panel0 + kp_hi * 128 + ((chunk ^ kp_hi) * 16);

    // Fragments of k-step KS of tile i; the products that last read them have completed.
    auto load_step = [&](auto ks, int i) {
      constexpr int KS = decltype(ks)::value;
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(fr[KS][j][e])::"memory");
      const unsigned char* vs = sV + v_ring.slot(i) * Tile::kVBytes;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int step = j * 2 * Tile::kVPanelBytes + KS * 8 * 128;
        const uint2 lo = *reinterpret_cast<const uint2*>(vs + off_lo + step);
        const uint2 hi = *reinterpret_cast<const uint2*>(vs + off_hi + step);
        fr[KS][j][0] = lo.x, fr[KS][j][1] = lo.y, fr[KS][j][2] = hi.x, fr[KS][j][3] = hi.y;
      }
    };
    auto issue_step = [&](auto ks, int i) {
      constexpr int KS = decltype(ks)::value;
      const uint32_t base = smem_address(sX + x_ring.slot(i) * Tile::kXBytes);
#pragma unroll
      for (int j = 0; j < 2; ++j)
        sm90::Wgmma<float, 128>::rs(acc[j], fr[KS][j], sm90::k_major_descriptor(base + KS * 32), 1);
    };
    // Some row's max moved at tile i: its columns shrink before the tile's products join them.
    auto rescale_if_moved = [&](int i) {
      const int s = x_ring.slot(i);
      const int4 f = *reinterpret_cast<const int4*>(flags + 4 * s);
      if (i == 0 || !(f.x | f.y | f.z | f.w)) return;
      sm90::wgmma_wait<0>();
#pragma unroll
      for (int j = 0; j < 2; ++j) sm90::fence_registers(acc[j]);
      const float* fs = factors + s * Tile::kBlockRows;
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        const float2 fc = *reinterpret_cast<const float2*>(fs + 8 * n + 2 * t);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          acc[j][n][0] *= fc.x, acc[j][n][2] *= fc.x;
          acc[j][n][1] *= fc.y, acc[j][n][3] *= fc.y;
        }
      }
    };

    // V's stage i goes back, in every CTA of the cluster, once this warp's fragments of tile i
    // are in registers. The wgmma issue waited for their values, so the loads have completed and
    // no later copy can change what they read: no proxy fence (it cost 1.11 against 1.08 ms).
    uint32_t v_empty_at[kCluster];  // v_empty in each CTA, mapped once (mapa costs a special-register read)
#pragma unroll
    for (int c = 0; c < kCluster; ++c) v_empty_at[c] = sm90::cluster_address(v_ring.empty(), uint32_t(c));
    auto release_v = [&](int i) {
      __syncwarp();
      if (lane == 0) {
#pragma unroll
        for (int c = 0; c < kCluster; ++c) sm90::barrier_arrive_remote(v_empty_at[c] + 8 * v_ring.slot(i));
      }
    };
    // X's stage (P) goes back once every k-step of tile i's products has completed.
    auto retire = [&](int i) { x_ring.release_warp(i, lane); };

    using S0 = std::integral_constant<int, 0>;
    using S1 = std::integral_constant<int, 1>;
    using S2 = std::integral_constant<int, 2>;
    using S3 = std::integral_constant<int, 3>;
    static_assert(kKSteps == 4, "softmax_matmul sm90 fast f32: four k-steps per tile");
    auto load_first_half = [&](int i) {
      v_ring.wait(i);
      load_step(S0{}, i), load_step(S1{}, i);
    };
    load_first_half(0);
    for (int i = 0; i < n_tiles; ++i) {
      sm90::barrier_wait(p_full + x_ring.slot(i), x_ring.phase(i));
      rescale_if_moved(i);
      sm90::wgmma_fence();
      issue_step(S0{}, i), issue_step(S1{}, i);
      sm90::wgmma_commit();
      sm90::wgmma_wait<1>();  // tile i - 1 has completed
      if (i > 0) retire(i - 1);
      load_step(S2{}, i), load_step(S3{}, i);
      sm90::wgmma_fence();
      issue_step(S2{}, i), issue_step(S3{}, i);
      sm90::wgmma_commit();
      release_v(i);
      sm90::wgmma_wait<1>();  // the first half of tile i has completed
      if (i + 1 < n_tiles) load_first_half(i + 1);
    }
    sm90::wgmma_wait<0>();
#pragma unroll
    for (int j = 0; j < 2; ++j) sm90::fence_registers(acc[j]);
    retire(n_tiles - 1);
    sm90::barrier_wait(sums_ready, 0);

    // acc[j][n][e]: output column c0 + 128 wg + 64 j + 16 warp + 2 g + e / 2, row 8 n + 2 t + e % 2.
    // A thread's two columns of a row are neighbours: one 8-byte store where rows keep that
    // alignment (c is even).
    float* out = static_cast<float*>(p.out) + batch * p.out_batch_stride;
    const bool pairs = (reinterpret_cast<uintptr_t>(out) | uintptr_t(p.out_row_stride) * 4) % 8 == 0;
#pragma unroll
    for (int n = 0; n < 16; ++n)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int rr = 8 * n + 2 * t + h, r = r0 + rr;
        if (r >= p.d1) continue;
        const float inv = inv_sum[rr];
        float* orow = out + int64_t(r) * p.out_row_stride;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int c = c0 + 128 * wg + 64 * j + 16 * warp + 2 * g;
          const float lo = acc[j][n][h] * inv, hi = acc[j][n][2 + h] * inv;
          if (pairs && c + 1 < p.d3) {
            *reinterpret_cast<float2*>(orow + c) = make_float2(lo, hi);
          } else {
            if (c < p.d3) orow[c] = lo;
            if (c + 1 < p.d3) orow[c + 1] = hi;
          }
        }
      }
  }
  sm90::cluster_sync();
#endif
}

}  // namespace tileattn::cuda::smm
