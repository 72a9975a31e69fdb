#pragma once
// Attention dropout on one warp's tile of weights P in the mma accumulator layout (m16n8: a
// thread holds, per m-tile, rows g and g+8 and, per 8-key n-tile, keys 2t and 2t+1), which the
// 16-bit forward kernels and the fp32 forward (TF32 and fp64 products alike) share.
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

}  // namespace tileattn::cuda
