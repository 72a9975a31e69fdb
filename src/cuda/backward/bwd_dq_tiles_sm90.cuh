#pragma once
// The fp32 dQ tiles the Hopper backward kernels add into the workspace accumulator: their order
// inside a tile, and how a tile becomes dQ. Each tile counts down the key blocks still to add into
// it (the preprocess sets the counts); the block whose addition lands last hands the tile to a warp
// of its own, which loads it back and stores it, scaled, into dQ while other blocks still compute.
// A kernel of its own after the backward read and wrote every tile again: at N = 1k, D = 128 about
// 7% of the backward's time (docs/perf-log.md).
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/arch/pipeline_sm90.cuh"
#include "cuda/arch/ptx_sm80.cuh"
#include "cuda/arch/ptx_sm90.cuh"
#include "cuda/common/bwd_params.hpp"

namespace tileattn::cuda {

// Where element (r, c) of a (kBlockM x kHeadDim) fp32 dQ tile lives in the tile's run of floats:
// the consumer's part (its 64 rows, or its columns), then 8-column group j, then the
// thread of the warpgroup, then the accumulator register -- thread (warp w, g, t) holds rows
// 16 w + g (+ 8) and columns 8 j + 2 t (+ 1) of its part as one float4 per j.
template <int kHeadDim>
struct DqTileOrder {
  static constexpr int kBlockM = kHeadDim <= 64 ? 128 : 64;
  static constexpr bool kSplitRows = kBlockM == 128;
  // Split by columns: 64-column panels up to D = 128 (96 = 64 + 32), 128 columns above
  // (192 = 128 + 64) -- the consumers' shares of dQ, and of dK and dV in the wide kernel.
  static constexpr int kPartCols = kSplitRows ? kHeadDim : kHeadDim > 128 ? 128 : 64;
  static constexpr int kPartFloats = 64 * kPartCols;
  __host__ __device__ static int offset(int r, int c) {
    const int part = kSplitRows ? r / 64 : c / kPartCols, rr = kSplitRows ? r % 64 : r;
    const int cc = kSplitRows ? c : c % kPartCols;
    const int thread = 32 * (rr / 16) + 4 * (rr % 8) + (cc % 8) / 2;
    return part * kPartFloats + ((cc / 8) * 128 + thread) * 4 + 2 * ((rr % 16) / 8) + cc % 2;
  }
};

// dQ's rows of the tile whose first workspace row is row0 (tiles never straddle (b, h)).
template <class T>
struct DqTileRows {
  T* head;     // row 0 of the tile's (batch, head) in dQ
  int i0, sq;  // the tile's first row in its sequence; the sequence's length
  __device__ __forceinline__ DqTileRows(const bwd::BwdParams& p, int64_t row0) {
    i0 = int(row0 % p.seqlen_q_rounded);
    const int64_t bh = row0 / p.seqlen_q_rounded;
    const int h = int(bh % p.heads_q), b = int(bh / p.heads_q);
    sq = bwd::seq_info(p, b).sq;
    head = static_cast<T*>(p.dq.ptr) + bwd::seq_base(p, p.dq, b, true) + int64_t(h) * p.dq.head;
  }
  __device__ __forceinline__ T* row(const bwd::BwdParams& p, int i) const { return head + int64_t(i) * p.dq.seq; }
};

// Elements c and c + 1 of a dQ row (w: the rounded pair), as one word where pairs store whole.
template <class T>
__device__ __forceinline__ void store_dq_pair(const bwd::BwdParams& p, T* at, int c, uint32_t w) {
  if (p.pair_grads && c + 1 < p.headdim_qk) {
    *reinterpret_cast<uint32_t*>(at) = w;
  } else {
    const T* two = reinterpret_cast<const T*>(&w);
    at[0] = two[0];
    if (c + 1 < p.headdim_qk) at[1] = two[1];
  }
}

#if defined(TILEATTN_SM90_ENABLED)
// The dQ warp's first thread, after it has issued a step's parts: the step before's additions have
// landed once all but the newest kParts bulk groups are complete, and that tile's count goes down.
// The block that takes a count to zero hands the tile (its first workspace row) to the conversion
// warp through a ring of kSlots; -1 ends the stream.
template <int kBlockM, int kParts, int kSlots>
struct DqTileCountdown {
  sm90::StageRing<kSlots> ring;
  int64_t* rows;      // the ring's entries
  int* left;          // the tiles' counts
  int64_t pending = -1;  // the tile of the last step issued
  int handed = 0;

  __device__ __forceinline__ void count_down(int64_t row0) {
    sm90::fence_async_global();  // the completed additions before the release below
    if (sm90::atomic_add_acq_rel(left + row0 / kBlockM, -1) == 1) hand_over(row0);
  }
  __device__ __forceinline__ void hand_over(int64_t row0) {
    ring.acquire(handed);
    rows[ring.slot(handed)] = row0;
    ring.publish(handed);
    ++handed;
  }
  // Step's tile row0 issued (every part).
  __device__ __forceinline__ void issued(int64_t row0) {
    sm90::bulk_wait<kParts>();
    if (pending >= 0) count_down(pending);
    pending = row0;
  }
  // After the walk's last step.
  __device__ __forceinline__ void finish() {
    sm90::bulk_wait<0>();
    if (pending >= 0) count_down(pending);
    hand_over(-1);
  }
};

// The conversion warp: each tile handed over, in runs of at most kBufBytes (a part, or a part's
// half at the wide head dims), bulk-loaded from the accumulator into `buf` (`loaded` its barrier)
// and stored into dQ, scaled, pairs straight from the tile order (thread t's float4 j holds rows
// 16 (t / 32) + (t % 32) / 4 (+ 8), columns 8 j + 2 (t % 4) (+ 1) of its part: a warp store
// covers 8 rows, 16 bytes each). The warp runs beside the consumers: what it costs is its own
// time, not theirs.
template <class T, int kHeadDim, int kSlots, int kBufBytes>
__device__ __forceinline__ void convert_handed_dq_tiles(const bwd::BwdParams& p, const sm90::StageRing<kSlots>& ring,
                                                        const int64_t* rows, float* buf, uint64_t* loaded, int lane) {
  using Order = DqTileOrder<kHeadDim>;
  constexpr int kParts = Order::kSplitRows ? 2 : (kHeadDim + Order::kPartCols - 1) / Order::kPartCols;
  constexpr int kRunFloats = kBufBytes / 4;
  int loads = 0;
  for (int n = 0;; ++n) {
    ring.wait(n);
    const int64_t row0 = rows[ring.slot(n)];
    ring.release_warp(n, lane);
    if (row0 < 0) return;
    const DqTileRows<T> dq(p, row0);
#pragma unroll 1
    for (int part = 0; part < kParts; ++part) {
      const int part_cols = Order::kSplitRows ? kHeadDim : min(Order::kPartCols, kHeadDim - Order::kPartCols * part);
      const int r0 = Order::kSplitRows ? 64 * part : 0, c0 = Order::kSplitRows ? 0 : Order::kPartCols * part;
#pragma unroll 1
      for (int f0 = 0; f0 < 64 * part_cols; f0 += kRunFloats) {
        const int floats = min(kRunFloats, 64 * part_cols - f0);
        if (lane == 0) {
          sm90::fence_async_global();  // the acquire that found the tile finished before this read
          sm90::barrier_arrive_expect_bytes(loaded, uint32_t(floats * 4));
          sm90::bulk_load(buf, p.dq_accum + row0 * kHeadDim + part * Order::kPartFloats + f0, uint32_t(floats * 4),
                          loaded);
        }
        sm90::barrier_wait(loaded, uint32_t(loads++) & 1u);
        const float4* src = reinterpret_cast<const float4*>(buf);
#pragma unroll 1
        for (int x = lane; x < floats / 4; x += 32) {
          const int at = f0 / 4 + x, t = at % 128, c = c0 + 8 * (at / 128) + 2 * (t % 4);
          const int i = dq.i0 + r0 + 16 * (t / 32) + (t % 32) / 4;
          const float4 v = src[x];
          if (c >= p.headdim_qk) continue;
          if (i < dq.sq) store_dq_pair<T>(p, dq.row(p, i) + c, c, pack2<T>(v.x * p.scale, v.y * p.scale));
          if (i + 8 < dq.sq) store_dq_pair<T>(p, dq.row(p, i + 8) + c, c, pack2<T>(v.z * p.scale, v.w * p.scale));
        }
        // The buffer's reads before the next run's bulk write into it.
        sm90::fence_shared_to_async();
        __syncwarp();
      }
    }
  }
}
#endif

}  // namespace tileattn::cuda
