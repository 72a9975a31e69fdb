#pragma once
// Which key blocks a block of the Hopper backward (bwd_kernel_sm90.cuh) works on, and in what
// order.
//
// One block per key block: the grid's own (key block, batch, kv head). kPersistent (one block per
// SM): units of work handed out a grid apart, each one key block, or under the causal mask a
// head's m-th heaviest key block followed by its m-th lightest (cuda/common/tile_pairs.hpp: key
// block j sees the query tiles from its own keys on, so the work falls by the same steps from one
// key block to the next). Units are numbered within a (batch, kv head) first, so that the blocks
// running at once share its Q and dO in L2.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/backward/bwd_stream_sm90.cuh"
#include "cuda/common/bwd_params.hpp"
#include "cuda/common/tile_pairs.hpp"

namespace tileattn::cuda {

// Units of a persistent launch, computed alike by the host (the grid) and the kernel; the launch
// rule admits no varlen and no mask but the causal one, which pairs the key blocks.
struct BwdUnits {
  TilePairs pairs;  // a (batch, kv head)'s key blocks
  int64_t count;    // over every kv head and batch

  __host__ __device__ BwdUnits(const bwd::BwdParams& p, int block_n)
      : pairs((p.seqlen_k + block_n - 1) / block_n, p.window_right == 0 && p.window_left < 0),
        count(int64_t(pairs.per_head) * p.heads_kv * p.batch) {}
};

// Where a block's walk is: unit (also as digits: key block within the head, kv head, batch), and
// key block within it.
struct BwdWalk {
  int unit, half;
  UnitDigits at;
};

template <bool kPersistent, int kBlockN, int kBlockM>
struct BwdSm90Schedule {
  BwdUnits units;
  int heads;
  UnitDigits step;  // gridDim.x

  __device__ __forceinline__ explicit BwdSm90Schedule(const bwd::BwdParams& p)
      : units(p, kBlockN), heads(p.heads_kv), step{0, 0, 0} {
    if constexpr (kPersistent) step = UnitDigits::of(int(gridDim.x), units.pairs.per_head, heads);
  }
  __device__ __forceinline__ BwdWalk begin() const {
    if constexpr (!kPersistent) return {0, 0, {0, 0, 0}};
    return {int(blockIdx.x), 0, UnitDigits::of(int(blockIdx.x), units.pairs.per_head, heads)};
  }
  __device__ __forceinline__ bool more(const BwdWalk& w) const {
    return w.unit < (kPersistent ? int(units.count) : 1);
  }
  __device__ __forceinline__ void next(BwdWalk& w) const {
    if (++w.half < (kPersistent ? units.pairs.count(w.at.i) : 1)) return;
    w.half = 0;
    w.unit += kPersistent ? int(gridDim.x) : 1;
    if constexpr (kPersistent) w.at.add(step, units.pairs.per_head, heads);
  }
  __device__ __forceinline__ BwdKeyBlock<kBlockN, kBlockM> key_block(const bwd::BwdParams& p, const BwdWalk& w) const {
    if constexpr (kPersistent) {
      return BwdKeyBlock<kBlockN, kBlockM>(p, units.pairs.rank(w.at.i, w.half), w.at.batch, w.at.head);
    } else {
      return BwdKeyBlock<kBlockN, kBlockM>(p);
    }
  }
  // Steps of the whole walk (every key block's query tiles), for the dQ warp's last hand-shake.
  __device__ __forceinline__ int steps(const bwd::BwdParams& p) const {
    int n = 0;
    for (BwdWalk w = begin(); more(w); next(w)) n += key_block(p, w).n_iter;
    return n;
  }
};

}  // namespace tileattn::cuda
