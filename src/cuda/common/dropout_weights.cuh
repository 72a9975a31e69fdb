#pragma once
// Attention dropout on one warp's tile of weights P in the mma accumulator layout (m16n8: a
// thread holds, per m-tile, rows g and g+8 and, per 8-key n-tile, keys 2t and 2t+1), which the
// 16-bit forward kernels and the fp32 forward (TF32 and fp64 products alike) share; and the keep
// factors of the exact fp32 backward's fragments, rows being queries or keys.
#include "common/philox.hpp"

namespace tileattn::cuda {

// Zeroes the elements of s the philox.hpp rule drops; the row statistics stay undropped (the
// caller folds them in before). row0: the query row of (m-tile 0, g); key0: the key of column 0
// of this tile, even. With GQA packing (pack > 1) tile row r is position r / pack of query head
// head * pack + r % pack (the stream is the query head's). A thread's columns 2t, 2t+1 lie in one
// group of four keys: one Philox call for both.
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void dropout_weights(float (&s)[kMTiles][kNTiles][4], const Dropout& dropout, int batch,
                                                int head, int row0, int key0, int pack = 1) {
  const Dropout d = dropout.resolved();
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int packed = row0 + mt * 16 + half * 8;
      const int row = pack > 1 ? packed / pack : packed;
      const int h = pack > 1 ? head * pack + packed % pack : head;
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        const int key = key0 + nt * 8 + 2 * t;
        const Philox4 r = d.draws(batch, h, row, key);
        // key is even: its word is x or z, key + 1's the next one.
        const bool low = (key & 2) == 0;
        if ((low ? r.x : r.z) < d.threshold) s[mt][nt][half * 2] = 0.0f;
        if ((low ? r.y : r.w) < d.threshold) s[mt][nt][half * 2 + 1] = 0.0f;
      }
    }
}

// Keep factors (d.scale where kept, 0 where dropped) of one fragment row's two columns 2t, 2t + 1
// whose rows are queries: row `query`, keys key and key + 1 (key even): one Philox call for both.
__device__ __forceinline__ void dropout_factors_of_query(const Dropout& d, int batch, int head, int query, int key,
                                                         float (&keep)[2]) {
  const Philox4 r = d.draws(batch, head, query, key);
#pragma unroll
  for (int e = 0; e < 2; ++e) keep[e] = dropout_word(r, key + e) >= d.threshold ? d.scale : 0.0f;
}

// The same for a fragment whose rows are keys, keep[half][e]: this thread's rows g and g + 8 are
// keys `key` and key + 8, its columns 2t + e queries query + e; key - (g % 4) must be a multiple
// of four (rows start at multiples of 16). A Philox call covers four keys of one query, and the
// four lanes of equal t whose g share g / 4 hold those keys, one each, for the same four (query,
// half) pairs: so each lane draws for one pair, and in round k lane r (= g % 4) reads from lane
// (r + k) % 4 of its four, which sends the word of key r.
__device__ __forceinline__ void dropout_factors_of_key(const Dropout& d, int batch, int head, int key, int query,
                                                       float (&keep)[2][2]) {
  const int lane = int(threadIdx.x) % 32, r = (lane >> 2) & 3;
  const Philox4 mine = d.draws(batch, head, query + (r & 1), key - r + 8 * (r >> 1));
  auto from = [&](int k) {  // pair (r + k) % 4's word of this lane's key
    return __shfl_sync(0xffffffffu, dropout_word(mine, (r - k) & 3), (lane & ~12) | (((r + k) & 3) << 2));
  };
  const Philox4 got{dropout_word(mine, r), from(1), from(2), from(3)};
#pragma unroll
  for (int half = 0; half < 2; ++half)
#pragma unroll
    for (int e = 0; e < 2; ++e)
      keep[half][e] = dropout_word(got, (2 * half + e - r) & 3) >= d.threshold ? d.scale : 0.0f;
}

}  // namespace tileattn::cuda
