#pragma once
// softmax(X) @ V on Hopper: one block per (128 rows of X, N columns of out, batch), three
// warpgroups. (fp32 fast mode over more than 128 columns runs the transposed kernel of
// smm_fast_f32_kernel_sm90.cuh instead, which needs no V transpose.)
//
//   warpgroup 0      producer: TMA streams X and V tiles of kBlockK keys through shared-memory
//                    stages (full/empty mbarriers as in the forward). fp32: the whole warpgroup
//                    also rewrites each V tile K-major (the only B layout TF32 wgmma reads)
//                    into a ring of transposed buffers.
//   warpgroups 1, 2  consumers, 64 rows each: P = exp2(X log2(e) - rowmax) read straight from the
//                    X tile into the A-fragment layout, out += P V with wgmma (A from registers).
//                    The products of one tile run while the softmax of the next is computed.
//
// X never enters a matrix product, so each thread reads exactly the elements of its A
// fragment. For fp32 the order of keys inside a tile is free as long as the transposed V uses
// the same one: thread (g, t) reads keys 8t..8t+7 of its rows (two 16-byte loads), and
// position p = 4 pg + i (i < 4) of a transposed row holds key 8 i + pg. For that order both the
// transpose's loads and its stores are free of bank conflicts.
//
// fp32 exact mode (kExact) splits both operands into two TF32 parts rounded to nearest,
// x = hi + lo with hi = rn_tf32(x), lo = rn_tf32(x - hi) (about 2^-22 relative left over, and
// unbiased: the tensor core would truncate fp32 bits, which biases every product the same way),
// and forms P V as P_lo V_hi + P_hi V_lo + P_hi V_hi. The producer writes V_hi and V_lo as two
// transposed tiles. The tensor core's own sums drop bits toward zero, so each tile's products
// go into a fresh accumulator that is added to the output with ordinary fp32 adds: only the 32
// keys of a tile ever meet the tensor core's adder. The exponential is exp2f, as in the portable
// exact kernel.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/online_softmax.hpp"
#include "cuda/arch/mma_fp32.cuh"
#include "cuda/arch/pipeline_sm90.cuh"
#include "cuda/arch/ptx_sm80.cuh"
#include "cuda/arch/ptx_sm90.cuh"
#include "cuda/arch/smm_ptx.cuh"
#include "cuda/arch/wgmma_ops.cuh"
#include "cuda/common/tree_reduce.cuh"

namespace tileattn::cuda::smm {

struct Sm90Params {
  CUtensorMap x;  // (d2, d1, 1, batch), boxes of 128 bytes x kBlockM rows
  CUtensorMap v;  // (d3, d2, 1, batch), boxes of 128 bytes x kBlockK rows
  void* out;
  int64_t out_batch_stride, out_row_stride;
  int d1, d2, d3;
  int d3_blocks;  // column slices per row band
};

template <class T, int N, bool kExact = false>
struct Sm90Tile {
  static constexpr bool kF32 = std::is_same_v<T, float>;
  static constexpr bool kSplit = kF32 && kExact;
  // The fp32 producer transposes and needs more than the one TMA thread.
  using Roles = sm90::WarpRoles<2, kF32 ? 72 : 24, kF32 ? 216 : 240>;
  static constexpr int kConsumers = Roles::kConsumers;
  static constexpr int kThreads = Roles::kThreads;
  static constexpr int kBlockM = 64 * kConsumers;
  static constexpr int kBlockK = 128 / int(sizeof(T));  // keys per stage: one 128-byte row of X
  static constexpr int kKSteps = kBlockK / (kF32 ? 8 : 16);
  static constexpr int kVals = kBlockK / 4;  // X values per thread per row and stage
  // Stage counts of X tiles, V tiles as loaded, and (fp32) transposed V tiles; the depth of the
  // rings does not set the pace (the depths tried ran within their spread: docs/perf-log.md).
  static constexpr int kXStages = kF32 ? 3 : 4;
  static constexpr int kVStages = kF32 ? (kSplit ? 3 : 2) : 4;
  static constexpr int kTStages = kF32 ? (kSplit ? 4 : 3) : 0;
  static_assert(kF32 || kXStages == kVStages, "softmax_matmul sm90: 16-bit X and V share their stages");
  static constexpr int kXBytes = kBlockM * 128;
  static constexpr int kVPanelBytes = kBlockK * 128;  // kBlockK rows x 128 bytes of columns
  static constexpr int kVPanels = N * int(sizeof(T)) / 128;
  static constexpr int kVBytes = kVPanels * kVPanelBytes;
  static constexpr int kTBytes = N * 128;  // N rows x kBlockK fp32 keys
  static constexpr int kTParts = kSplit ? 2 : 1;  // V_hi (and V_lo) per transposed buffer
  // X and V tiles as loaded; fp32: V transposed (16-bit types: a ring whose barriers go unused).
  using XRing = sm90::StageRing<kXStages>;
  using VRing = sm90::StageRing<kVStages>;
  using TRing = sm90::StageRing<kF32 ? kTStages : 2>;
  enum Region { kX, kV, kT, kBarriers };
  using Smem = sm90::SmemRegions<kXStages * kXBytes, kVStages * kVBytes, kTStages * kTParts * kTBytes,
                                 XRing::kBarrierBytes + VRing::kBarrierBytes + TRing::kBarrierBytes>;
  static constexpr int kSmemBytes = Smem::kBytes;
  static_assert(kSmemBytes <= 227 * 1024, "softmax_matmul sm90: stages exceed shared memory");
  // Transpose: each producer thread moves N / 64 units of 4 keys x 4 columns per tile, kUnits of
  // them loaded before the first is stored.
  static constexpr int kUnitsPerThread = N / 64;
  static constexpr int kUnits = kUnitsPerThread >= 2 ? 2 : 1;
  static_assert(N == 64 || N == 128 || N == 256, "softmax_matmul sm90: column slices of 64, 128 or 256");
  // Two accumulators and two P parts per thread, and two transposed V parts per buffer.
  static_assert(!kSplit || N <= 128, "softmax_matmul sm90: exact mode takes column slices of at most 128");
  static_assert(!kExact || kF32, "softmax_matmul sm90: exact mode is an fp32 mode");
};

using fp32::tf32_bits;
using fp32::tf32_rn;

template <class T, int N, bool kExact = false>
__global__ void __launch_bounds__(Sm90Tile<T, N, kExact>::kThreads, 1)
    softmax_matmul_kernel_sm90(const __grid_constant__ Sm90Params p) {
#if defined(TILEATTN_SM90_ENABLED)
  using Tile = Sm90Tile<T, N, kExact>;
  using Roles = typename Tile::Roles;
  constexpr bool kF32 = Tile::kF32, kSplit = Tile::kSplit;
  constexpr int kXSt = Tile::kXStages, kVSt = Tile::kVStages;
  constexpr int kBlockK = Tile::kBlockK, kKSteps = Tile::kKSteps, kVals = Tile::kVals;

  extern __shared__ unsigned char smem_raw[];
  const typename Tile::Smem smem(smem_raw);
  unsigned char* sX = smem.template at<Tile::kX>();
  unsigned char* sV = smem.template at<Tile::kV>();
  unsigned char* sT = smem.template at<Tile::kT>();
  const typename Tile::XRing x_ring{smem.template at<Tile::kBarriers, uint64_t>()};
  const typename Tile::VRing v_ring{x_ring.end()};  // 16-bit: the consumers release V
  const typename Tile::TRing t_ring{v_ring.end()};  // fp32: transposed V published / released

  // The column slices of a band are neighbours in the grid: they run together, and the second
  // read of an X tile comes from L2.
  const int band = int(blockIdx.x) / p.d3_blocks, slice = int(blockIdx.x) % p.d3_blocks, batch = int(blockIdx.y);
  const int r0 = band * Tile::kBlockM, c0 = slice * N;
  const int n_tiles = (p.d2 + kBlockK - 1) / kBlockK;

  if (threadIdx.x == 0) {
    // One release per reader warp: the consumers', or (fp32 V) the transposing producer warps'.
    x_ring.init(1, 4 * Tile::kConsumers);
    v_ring.init(1, kF32 ? 4 : 4 * Tile::kConsumers);
    t_ring.init(4, 4 * Tile::kConsumers);  // one publish per producer warp
    sm90::barrier_init_fence();
  }
  __syncthreads();

  const Roles roles;
  const int warp = Roles::warp(), lane = Roles::lane();

  // Tile i of X (of V) into its stage once its readers are done with it.
  auto issue_x = [&](int i) {
    uint64_t* full = x_ring.acquire_bytes(i, Tile::kXBytes);
    sm90::tma_load_4d(sX + x_ring.slot(i) * Tile::kXBytes, &p.x, full, i * kBlockK, r0, 0, batch);
  };
  auto issue_v = [&](int i) {
    uint64_t* full = v_ring.acquire_bytes(i, Tile::kVBytes);
#pragma unroll
    for (int c = 0; c < Tile::kVPanels; ++c)
      sm90::tma_load_4d(sV + v_ring.slot(i) * Tile::kVBytes + c * Tile::kVPanelBytes, &p.v, full,
                        c0 + c * (128 / int(sizeof(T))), i * kBlockK, 0, batch);
  };

  if (roles.warpgroup == 0) {
    Roles::enter_producer();
    if constexpr (!kF32) {
      if (threadIdx.x == 0)
        for (int i = 0; i < n_tiles; ++i) issue_v(i), issue_x(i);
    } else {
      // Thread 0 loads V, thread 32 loads X: a wait for the consumers to release X then holds up
      // only one transposing warp's start.
      const int tid = int(threadIdx.x);
      const bool loads_v = tid == 0, loads_x = tid == 32;
      if (loads_v)
        for (int i = 0; i < kVSt - 1 && i < n_tiles; ++i) issue_v(i);
      if (loads_x)
        for (int i = 0; i < kXSt - 1 && i < n_tiles; ++i) issue_x(i);
      // Unit (pg, nc) of the transpose: keys 8 k + pg (k < 4) of columns 4 nc .. 4 nc + 3 become
      // the 16-byte chunk pg of transposed rows 4 nc .. 4 nc + 3. Thread tid takes the units
      // u = tid + 128 it, so pg = tid % 8 and both swizzles (the loaded tile's, chunk ^ key % 8,
      // and the transposed one's, chunk ^ row % 8) depend on tid alone: every address is one of
      // these offsets plus a constant. Lanes of a quarter-warp differ in pg, which keeps the loads
      // and the stores free of bank conflicts.
      const int pg = tid % 8, grp = tid / 8;
      const int load0 = (tid / 64) * Tile::kVPanelBytes + pg * 128 + (((grp % 8) ^ pg) * 16);
      const int swz = (pg ^ (4 * (grp % 2))) * 16;
      int store0[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) store0[j] = (4 * grp + j) * 128 + (swz ^ (16 * j));
      constexpr int kLoadStep = 2 * Tile::kVPanelBytes, kStoreStep = 64 * 128;  // per it: 16 column groups
      for (int i = 0; i < n_tiles; ++i) {
        // Issued before waiting for the consumers: the loads get the most time in flight.
        if (loads_v && i + kVSt - 1 < n_tiles) issue_v(i + kVSt - 1);
        t_ring.acquire(i);
        if (loads_x && i + kXSt - 1 < n_tiles) issue_x(i + kXSt - 1);
        v_ring.wait(i);
        const unsigned char* src = sV + v_ring.slot(i) * Tile::kVBytes + load0;
        unsigned char* dst = sT + t_ring.slot(i) * Tile::kTParts * Tile::kTBytes;
#pragma unroll
        for (int it = 0; it < Tile::kUnitsPerThread; it += Tile::kUnits) {
          float4 in[Tile::kUnits][4];
#pragma unroll
          for (int uu = 0; uu < Tile::kUnits; ++uu)
#pragma unroll
            for (int k = 0; k < 4; ++k)
              in[uu][k] = *reinterpret_cast<const float4*>(src + (it + uu) * kLoadStep + k * 1024);
#pragma unroll
          for (int uu = 0; uu < Tile::kUnits; ++uu) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const float4 o = sm90::column_of(in[uu], j);
              unsigned char* at = dst + store0[j] + (it + uu) * kStoreStep;
              if constexpr (kSplit) {
                float4 hi, lo;
                fp32::split_tf32(o, hi, lo);
                *reinterpret_cast<float4*>(at) = hi;
                *reinterpret_cast<float4*>(at + Tile::kTBytes) = tf32_rn(lo);
              } else {
                *reinterpret_cast<float4*>(at) = o;
              }
            }
          }
        }
        sm90::fence_shared_to_async();
        __syncwarp();
        if (lane == 0) {
          t_ring.publish(i);
          v_ring.release(i);
        }
      }
    }
  } else {
    Roles::enter_consumer();
    const int consumer = roles.consumer();
    const int g = lane / 4, t = lane % 4;
    const int xrow = 64 * consumer + 16 * warp + g;  // block row of (g, e < 2); +8 for e >= 2

    float acc[N / 8][4];
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
    uint32_t pa[2][kKSteps][4];
    // Exact mode: P's low TF32 parts, and the accumulator of one tile's products.
    uint32_t pl[kSplit ? 2 : 1][kKSteps][4];
    float tacc[N / 8][4];
    constexpr float kSlack = 8.0f;

    // Softmax of tile i into pa[B]; factor and moved say how the accumulators must shrink.
    auto softmax_tile = [&](auto buf, int i, float (&factor)[2], bool& moved) {
      constexpr int B = decltype(buf)::value;
      x_ring.wait(i);
      const unsigned char* xs = sX + x_ring.slot(i) * Tile::kXBytes;
      float x[2][kVals];  // rows g, g + 8
      if constexpr (kF32) {
        // x[hf][j] is key 8t + j.
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int r = xrow + 8 * hf;
#pragma unroll
          for (int q = 0; q < 2; ++q) {
            const float4 u = *reinterpret_cast<const float4*>(xs + r * 128 + (((2 * t + q) ^ (r % 8)) * 16));
            x[hf][4 * q] = u.x, x[hf][4 * q + 1] = u.y, x[hf][4 * q + 2] = u.z, x[hf][4 * q + 3] = u.w;
          }
        }
      } else {
        // ldmatrix: matrix m of 4 is rows +8 (m % 2), columns +8 (m / 2) of a 16 x 16 k-step, the
        // A-fragment layout. x[hf][4 ks + q] is key 16 ks + 2t + (q % 2) + 8 (q / 2).
        const int lr = 64 * consumer + 16 * warp + (lane % 8) + 8 * ((lane / 8) % 2);
#pragma unroll
        for (int ks = 0; ks < kKSteps; ++ks) {
          const int chunk = 2 * ks + lane / 16;
          uint32_t a[4];
          ldmatrix_x4(a, smem_address(xs + lr * 128 + ((chunk ^ (lr % 8)) * 16)));
#pragma unroll
          for (int m = 0; m < 4; ++m) {
            const float2 f = unpack2<T>(a[m]);
            x[m % 2][4 * ks + 2 * (m / 2)] = f.x, x[m % 2][4 * ks + 2 * (m / 2) + 1] = f.y;
          }
        }
      }
      const int n0 = i * kBlockK;
      if (n0 + kBlockK > p.d2) {
#pragma unroll
        for (int j = 0; j < kVals; ++j) {
          const int key = kF32 ? 8 * t + j : 16 * (j / 4) + 2 * t + (j % 2) + 8 * ((j / 2) % 2);
          if (n0 + key >= p.d2) x[0][j] = x[1][j] = -INFINITY;
        }
      }
      float tile_max[2];
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) tile_max[hf] = tree_reduce(x[hf], [](float a, float b) { return fmaxf(a, b); });
      // The stage is released after the maxima have read every loaded value, behind a proxy fence:
      // the next TMA copy into it (async proxy) must not overtake these generic loads. Released
      // right after the loads were issued, fp32 tests with two X stages saw wrong outputs in 1 to 3
      // of 3 repeats.
      sm90::fence_shared_to_async();
      x_ring.release_warp(i, lane);

      // The reference max moves only when a row grows past it by 2^kSlack (lazy_row_max), so that
      // the accumulators (which wgmma may still be writing) rarely need rescaling, and then by a
      // power of two; p stays <= 2^kSlack. Whether any row of the warp does is one vote on each
      // thread's own maxima; only then are the maxima reduced across the quad (the first tile
      // always, later ones rarely).
      bool over = false;
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) over |= tile_max[hf] * kLog2e > row_max[hf] + kSlack;
      moved = false;
      factor[0] = factor[1] = 1.0f;
      if (__any_sync(0xffffffffu, over)) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          float mx = tile_max[hf];
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          mx = lazy_row_max(row_max[hf], mx * kLog2e, kSlack);  // row_max is in the log2 domain
          factor[hf] = rescale_factor(row_max[hf], mx);
          moved |= mx != row_max[hf];
          row_max[hf] = mx;
        }
      }
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const float base = safe_row_max(row_max[hf]);
#pragma unroll
        for (int j = 0; j < kVals; ++j) {
          const float arg = fmaf(x[hf][j], kLog2e, -base);
          x[hf][j] = kSplit ? exp2f(arg) : exp2_fast(arg);
        }
        row_sum[hf] = row_sum[hf] * factor[hf] + tree_reduce(x[hf], [](float a, float b) { return a + b; });
      }
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
        if constexpr (kF32) {
          // Positions t and t + 4 of k-step ks: keys 8t + 2ks and 8t + 2ks + 1.
          pa[B][ks][0] = tf32_bits(x[0][2 * ks]), pa[B][ks][1] = tf32_bits(x[1][2 * ks]);
          pa[B][ks][2] = tf32_bits(x[0][2 * ks + 1]), pa[B][ks][3] = tf32_bits(x[1][2 * ks + 1]);
          if constexpr (kSplit) {
            pl[B][ks][0] = tf32_bits(x[0][2 * ks] - __uint_as_float(pa[B][ks][0]));
            pl[B][ks][1] = tf32_bits(x[1][2 * ks] - __uint_as_float(pa[B][ks][1]));
            pl[B][ks][2] = tf32_bits(x[0][2 * ks + 1] - __uint_as_float(pa[B][ks][2]));
            pl[B][ks][3] = tf32_bits(x[1][2 * ks + 1] - __uint_as_float(pa[B][ks][3]));
          }
        } else {
          pa[B][ks][0] = pack2<T>(x[0][4 * ks], x[0][4 * ks + 1]);
          pa[B][ks][1] = pack2<T>(x[1][4 * ks], x[1][4 * ks + 1]);
          pa[B][ks][2] = pack2<T>(x[0][4 * ks + 2], x[0][4 * ks + 3]);
          pa[B][ks][3] = pack2<T>(x[1][4 * ks + 2], x[1][4 * ks + 3]);
        }
      }
    };

    auto issue_products = [&](auto buf, int i) {  // out += P(i) V(i) from pa[B]
      constexpr int B = decltype(buf)::value;
      // fp32 reads the transposed buffer, 16-bit types the V stage as loaded.
      const int s = kF32 ? t_ring.slot(i) : v_ring.slot(i);
      if constexpr (kF32) t_ring.wait(i);
      else v_ring.wait(i);
      sm90::wgmma_fence();
      if constexpr (kSplit) {
        // Small parts first: the fresh accumulator's sums then lose the least to truncation.
        const uint32_t hi = smem_address(sT + s * 2 * Tile::kTBytes), lo = hi + Tile::kTBytes;
#pragma unroll
        for (int ks = 0; ks < kKSteps; ++ks)
          sm90::Wgmma<float, N>::rs(tacc, pl[B][ks], sm90::k_major_descriptor(hi + ks * 32), ks > 0);
#pragma unroll
        for (int ks = 0; ks < kKSteps; ++ks)
          sm90::Wgmma<float, N>::rs(tacc, pa[B][ks], sm90::k_major_descriptor(lo + ks * 32), 1);
#pragma unroll
        for (int ks = 0; ks < kKSteps; ++ks)
          sm90::Wgmma<float, N>::rs(tacc, pa[B][ks], sm90::k_major_descriptor(hi + ks * 32), 1);
      } else if constexpr (kF32) {
        const uint32_t base = smem_address(sT + s * Tile::kTBytes);
#pragma unroll
        for (int ks = 0; ks < kKSteps; ++ks)
          sm90::Wgmma<float, N>::rs(acc, pa[B][ks], sm90::k_major_descriptor(base + ks * 32), 1);
      } else {
        const uint32_t base = smem_address(sV + s * Tile::kVBytes);
#pragma unroll
        for (int ks = 0; ks < kKSteps; ++ks)
          sm90::Wgmma<T, N>::template rs<1>(acc, pa[B][ks],
                                            sm90::mn_major_descriptor(base + ks * 16 * 128, Tile::kVPanelBytes), 1);
      }
      sm90::wgmma_commit();
    };
    // After the products of tile i have completed: their A registers may be reused, V released.
    auto retire = [&](auto buf, int i) {
      constexpr int B = decltype(buf)::value;
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          asm volatile("" : "+r"(pa[B][ks][e])::"memory");
          if constexpr (kSplit) asm volatile("" : "+r"(pl[B][ks][e])::"memory");
        }
      if constexpr (kF32) t_ring.release_warp(i, lane);
      else v_ring.release_warp(i, lane);
    };
    auto rescale = [&](const float (&factor)[2]) {
#pragma unroll
      for (int j = 0; j < N / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] *= factor[e / 2];
    };

    // One step: the products of tile i (pa[B]) are issued while those of tile i - 1 are still
    // in flight, so the tensor cores never wait for this warpgroup's softmax, which fills pa[B ^ 1]
    // with tile i + 1 once tile i - 1 has retired. The accumulators are rescaled (after a full
    // wait) only when a row max moved by 2^kSlack: rarely after the first tiles. Measured on the
    // H100 (16 x 2048 x 8192 x 512): fp32 1.573 ms against 1.632 with a full wait every step.
    auto step = [&](auto buf, int i) {
      constexpr int B = decltype(buf)::value;
      using Other = std::integral_constant<int, B ^ 1>;
      if constexpr (kSplit) {
        // Exact mode: tile i's products (into tacc) run during tile i + 1's softmax, then join
        // the output with round-to-nearest adds before the next tile can reuse tacc. (Summing
        // two tiles in tacc measured no faster, and its error grew with every truncating add.)
        issue_products(buf, i);
        float factor[2] = {1.0f, 1.0f};
        bool moved = false;
        if (i + 1 < n_tiles) softmax_tile(Other{}, i + 1, factor, moved);
        sm90::wgmma_wait<0>();
        sm90::fence_registers(tacc);
#pragma unroll
        for (int j = 0; j < N / 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[j][e] += tacc[j][e];
        if (__any_sync(0xffffffffu, moved)) rescale(factor);
        retire(buf, i);
        return;
      }
      issue_products(buf, i);
      sm90::wgmma_wait<1>();
      if (i > 0) retire(Other{}, i - 1);
      float factor[2] = {1.0f, 1.0f};
      bool moved = false;
      if (i + 1 < n_tiles) softmax_tile(Other{}, i + 1, factor, moved);
      if (__any_sync(0xffffffffu, moved)) {
        sm90::wgmma_wait<0>();
        sm90::fence_registers(acc);
        rescale(factor);
      }
    };

    if (n_tiles > 0) {
      float factor[2];
      bool moved;
      softmax_tile(std::integral_constant<int, 0>{}, 0, factor, moved);
      for (int i = 0; i < n_tiles; i += 2) {
        step(std::integral_constant<int, 0>{}, i);
        if (i + 1 < n_tiles) step(std::integral_constant<int, 1>{}, i + 1);
      }
      if constexpr (!kSplit) {  // exact mode retires every tile inside its step
        sm90::wgmma_wait<0>();
        sm90::fence_registers(acc);
        if ((n_tiles - 1) % 2 == 0) retire(std::integral_constant<int, 0>{}, n_tiles - 1);
        else retire(std::integral_constant<int, 1>{}, n_tiles - 1);
      }
    }

    T* out = static_cast<T*>(p.out) + batch * p.out_batch_stride;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float sum = row_sum[hf];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const float inv = inverse_row_sum(sum);
      const int r = r0 + xrow + 8 * hf;
      if (r >= p.d1) continue;
      T* orow = out + int64_t(r) * p.out_row_stride;
#pragma unroll
      for (int j = 0; j < N / 8; ++j) {
        const int c = c0 + 8 * j + 2 * t;
        if (c < p.d3) orow[c] = from_float<T>(acc[j][2 * hf] * inv);
        if (c + 1 < p.d3) orow[c + 1] = from_float<T>(acc[j][2 * hf + 1] * inv);
      }
    }
  }
#endif
}

}  // namespace tileattn::cuda::smm
