#pragma once
// The per-tile steps between S = Q K^T and O += P V, on the mma accumulator fragments of one
// warp: score modifiers (soft-cap, mask) and the online-softmax update. Each thread holds, per
// m-tile, two query rows (g and g+8) spread over the 4 lanes of its quad.
#include <math.h>

#include "common/mask.hpp"
#include "common/score_mod.hpp"
#include "common/online_softmax.hpp"
#include "cuda/arch/ptx_sm80.cuh"
#include "cuda/common/dropout_weights.cuh"
#include "cuda/common/tree_reduce.cuh"

namespace tileattn::cuda {

// s -> post * tanh(s * pre): soft-capping in raw score units (see FwdParams).
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void softcap_scores(float (&s)[kMTiles][kNTiles][4], float pre, float post) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][nt][e] = post * tanhf(s[mt][nt][e] * pre);
}

// Sets the scores of keys a row does not see to -inf. row0: the query row of (m-tile 0, g);
// key0: the key of column 0 of this tile. Only tiles on the mask's boundary come here. With GQA
// packing (pack > 1) a tile row is position row / pack. The row's limits are taken relative to
// this thread's first column, so that each element is compared with constants: twice, or once
// without kLeft (a mask with no left window, as a causal one).
template <bool kLeft = true, int kMTiles, int kNTiles>
__device__ __forceinline__ void mask_scores(float (&s)[kMTiles][kNTiles][4], const Mask& mask, int row0, int key0,
                                            int pack = 1) {
  const int col0 = key0 + 2 * (int(threadIdx.x) % 4);
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = pack > 1 ? (row0 + mt * 16 + half * 8) / pack : row0 + mt * 16 + half * 8;
      const int lo = mask.begin_key(row) - col0, hi = mask.end_key(row) - col0;
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = nt * 8 + e;
          if ((kLeft && c < lo) || c >= hi) s[mt][nt][half * 2 + e] = -INFINITY;
        }
    }
}

// ALiBi in raw score units (slope_raw = slope / scale, see ScoreMod), after the cap and before
// the mask, at the row/key indices mask_scores uses; sq, sk: the sequence's lengths.
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void alibi_scores(float (&s)[kMTiles][kNTiles][4], float slope_raw, int row0, int key0,
                                             int sq, int sk) {
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + mt * 16 + half * 8;
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          s[mt][nt][half * 2 + e] += ScoreMod::alibi_bias(slope_raw, row, key0 + nt * 8 + 2 * t + e, sq, sk);
    }
}

// Running statistics of the rows a thread holds: max in the log2 domain and this lane's share
// of the row sum (the quad's shares are added once, at the end). The reference max moves only
// when a row passes it by more than kSlack (slack_row_max): P stays at most 2^kSlack, well inside
// both 16-bit types, and after a row's first tile most tiles move no row of a warp, which then
// skips the quad's max exchange and the output's rescale (a multiply per accumulator element,
// between two products).
template <int kMTiles>
struct RowStats {
  static constexpr float kSlack = 8.0f;
  float max_log2[kMTiles][2];
  float sum[kMTiles][2];

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) max_log2[mt][half] = -INFINITY, sum[mt][half] = 0.0f;
  }

  // Folds one tile of raw scores in: turns s into P = exp2(s * scale_log2 - max) in place and
  // gives, per row, the factor by which the output accumulated so far must shrink (rescale).
  // Returns whether any row of the warp moved its max (warp-uniform); if none did, every alpha
  // is 1. Apart from the rescale, so that a pipelined kernel can fold tile j while the products
  // of tile j - 1 still write the accumulator.
  template <int kNTiles>
  __device__ __forceinline__ bool fold(float (&s)[kMTiles][kNTiles][4], float scale_log2, float (&alpha)[kMTiles][2]) {
    float own_max[kMTiles][2];
    bool over = false;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float v[2 * kNTiles];
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) v[2 * nt] = s[mt][nt][2 * half], v[2 * nt + 1] = s[mt][nt][2 * half + 1];
        own_max[mt][half] = tree_reduce(v, [](float a, float b) { return fmaxf(a, b); }) * scale_log2;
        over |= own_max[mt][half] > max_log2[mt][half] + kSlack;
        alpha[mt][half] = 1.0f;
      }
    // A row's max passes its reference only if one of its quad's own maxima does.
    const bool moved = __any_sync(0xffffffffu, over);
    if (moved) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float m = own_max[mt][half];
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
          const float m_new = slack_row_max(max_log2[mt][half], m, kSlack);
          alpha[mt][half] = rescale_factor(max_log2[mt][half], m_new);
          max_log2[mt][half] = m_new;
        }
    }
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float base = safe_row_max(max_log2[mt][half]);
        float v[2 * kNTiles];
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = s[mt][nt][2 * half + e];
            x = exp2_fast(fmaf(x, scale_log2, -base));
            v[2 * nt + e] = x;
          }
        sum[mt][half] = sum[mt][half] * alpha[mt][half] + tree_reduce(v, [](float a, float b) { return a + b; });
      }
    return moved;
  }

  template <int kOTiles>
  static __device__ __forceinline__ void rescale(float (&o)[kMTiles][kOTiles][4], const float (&alpha)[kMTiles][2]) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int ot = 0; ot < kOTiles; ++ot) {
          o[mt][ot][2 * half] *= alpha[mt][half];
          o[mt][ot][2 * half + 1] *= alpha[mt][half];
        }
  }

  // fold, then rescale at once: for kernels whose products of the previous tile have completed.
  template <int kNTiles, int kOTiles>
  __device__ __forceinline__ void update(float (&s)[kMTiles][kNTiles][4], float (&o)[kMTiles][kOTiles][4],
                                         float scale_log2) {
    float alpha[kMTiles][2];
    if (fold(s, scale_log2, alpha)) rescale(o, alpha);
  }

  // Adds the quad's shares of each row sum; afterwards every lane of the quad holds the total.
  __device__ __forceinline__ void reduce_sums() {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float x = sum[mt][half];
        x += __shfl_xor_sync(0xffffffffu, x, 1);
        x += __shfl_xor_sync(0xffffffffu, x, 2);
        sum[mt][half] = x;
      }
  }
};

}  // namespace tileattn::cuda
