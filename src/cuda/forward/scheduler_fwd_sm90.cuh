#pragma once
// Which query tiles a block of the sm90 forward works on, and in what order.
//
// One block per tile: the grid's own (fwd_block_of_this_cta, heavy causal tiles launched first).
// kPersistent (one block per SM): units of work handed out a grid apart. A unit is one query
// tile, or, under a causal mask, a head's m-th heaviest tile followed by its m-th lightest
// (cuda/common/tile_pairs.hpp; query tiles M-1-m and m see M+1 key tiles together, one more per
// tile where the keys outnumber the queries). Units are numbered within a head first, then head,
// then batch, so that the blocks running at once share their heads' K and V in L2.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/tile_pairs.hpp"
#include "cuda/forward/fwd_block.cuh"

namespace tileattn::cuda {

// Units of a persistent launch, computed alike by the host (the grid) and the kernel from the
// same parameters; the launch rule admits no mask but the causal one, which pairs the tiles.
struct FwdUnits {
  TilePairs pairs;  // a head's query tiles, paired under the causal mask
  int64_t count;    // over every head and batch

  __host__ __device__ FwdUnits(const FwdParams& p, int block_m)
      : pairs((p.seqlen_q + block_m - 1) / block_m, p.window_right == 0),
        count(int64_t(pairs.per_head) * p.heads_q * p.batch) {}
};

// Where a block's walk is: unit (also as digits), tile within it, and tiles begun before.
struct FwdWalk {
  int unit, half, tile;
  UnitDigits at;
};

// A block's walk: units first, first + step, ... below end; without kPersistent one unit, its
// grid tile. A tile's start takes no integer division: the unit's digits are stepped.
template <bool kPersistent>
struct FwdSm90Schedule {
  FwdUnits units;
  int block_m, heads;
  UnitDigits step;  // gridDim.x

  __device__ __forceinline__ FwdSm90Schedule(const FwdParams& p, int block_m_)
      : units(p, block_m_), block_m(block_m_), heads(p.heads_q), step{0, 0, 0} {
    if constexpr (kPersistent) step = UnitDigits::of(int(gridDim.x), units.pairs.per_head, heads);
  }
  __device__ __forceinline__ FwdWalk begin() const {
    if constexpr (!kPersistent) return {0, 0, 0, {0, 0, 0}};
    return {int(blockIdx.x), 0, 0, UnitDigits::of(int(blockIdx.x), units.pairs.per_head, heads)};
  }
  __device__ __forceinline__ bool more(const FwdWalk& w) const {
    return w.unit < (kPersistent ? int(units.count) : 1);
  }
  __device__ __forceinline__ void next(FwdWalk& w) const {
    ++w.tile;
    if (++w.half < (kPersistent ? units.pairs.count(w.at.i) : 1)) return;
    w.half = 0;
    w.unit += kPersistent ? int(gridDim.x) : 1;
    if constexpr (kPersistent) w.at.add(step, units.pairs.per_head, heads);
  }
  // Query tile `half` of the unit: the heavy one (the later rows) first.
  __device__ __forceinline__ FwdBlock tile(const FwdParams& p, const FwdWalk& w) const {
    if constexpr (kPersistent) {
      const TilePairs& pairs = units.pairs;
      const int m_block = pairs.paired ? pairs.tiles - 1 - pairs.rank(w.at.i, w.half) : w.at.i;
      return fwd_block(p, block_m, m_block, 0, w.at.head, w.at.batch);
    } else {
      return fwd_block_of_this_cta(p, block_m);
    }
  }
};

}  // namespace tileattn::cuda
