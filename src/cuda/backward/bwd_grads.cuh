#pragma once
// From a tile of raw scores S = Q.K^T and of dP = dO.V^T to the probabilities P and the score
// gradients dS = P * (dP - D) (times d capped / d score under soft-capping), written to shared
// memory in the input precision for the products that follow.
//
// fp16/bf16 recompute P from the saved log-sum-exp: P = exp2(s * scale * log2(e) - L * log2(e));
// fp32 forms P = exp(s * scale - max) / sum from per-row statistics recomputed for accuracy
// (bwd_row_stats.cuh; on Hopper the statistics pass of bwd_kernel_exact_sm90.cuh). Rows that see
// no key and padding rows carry +inf in place of L * log2(e) (resp. max), which makes P exactly 0
// there: no mask arithmetic is needed for them, and no NaN can arise.
#include <math.h>

#include <type_traits>

#include "common/mask.hpp"
#include "common/online_softmax.hpp"
#include "common/philox.hpp"
#include "common/score_mod.hpp"
#include "cuda/arch/mma_fp32.cuh"
#include "cuda/arch/warp_mma_sm80.cuh"
#include "cuda/common/bwd_params.hpp"
#include "cuda/common/dropout_weights.cuh"

namespace tileattn::cuda::bwd {

// The scaled (soft-capped) score in the natural domain, as the fp32 path forms P from it. The
// products are rounded on their own (__fmul_rn: never contracted into a later add), so the fp32
// row statistics and prob_of_score round every score identically; the row's largest score then
// gives exp(s - max) = exp(0) = 1 exactly.
template <bool kCapped>
__device__ __forceinline__ float scaled_score(float x, const BwdParams& p) {
  return kCapped ? __fmul_rn(p.softcap, tanhf(x * p.scale_over_cap)) : __fmul_rn(x, p.scale);
}

// The score that fp32's row statistics take for raw score x (q.k) of (query, key): scaled (and
// capped) as scaled_score, ALiBi's bias added after the cap as prob_of_score adds it, -inf where
// the mask hides the key; so that a row's statistics are those of the P formed later.
template <bool kCapped, bool kAlibi>
__device__ __forceinline__ float stats_score(float x, int query, int key, bool hidden, float slope, const Mask& mask,
                                             const BwdParams& p) {
  float sc = scaled_score<kCapped>(x, p);
  if constexpr (kAlibi) sc = __fadd_rn(sc, ScoreMod::alibi_bias(slope, query, key, mask.seqlen_q, mask.seqlen_k));
  return hidden ? -INFINITY : sc;
}

// P of one raw score x (q.k) in the log2 domain, from l = L * log2(e) of its query: the 16-bit
// kernels' form, and the TF32 kernels' (fp32 fast mode), whose products are the accuracy limit.
// `cap` receives the capped score that grad_of_prob needs; with kAlibi, `bias` is ALiBi's bias in
// natural units, added after the cap (constant in x, so dS needs nothing more from it).
template <bool kCapped, bool kAlibi = false>
__device__ __forceinline__ float prob_of_score_log2(float x, float l, const BwdParams& p, float& cap,
                                                    float bias = 0.0f) {
  cap = kCapped ? p.softcap * tanhf(x * p.scale_over_cap) : 0.0f;
  if constexpr (kAlibi) {
    const float sc = (kCapped ? cap : x * p.scale) + bias;
    return exp2_fast(fmaf(sc, kLog2e, -l));
  } else if constexpr (kCapped) {
    return exp2_fast(cap * kLog2e - l);
  } else {
    return exp2_fast(fmaf(x, p.scale_log2, -l));
  }
}

// fp32's numerator of P, exp(x * scale - max) for raw score x (q.k), the score rounded exactly as
// scaled_score and the row statistics round it (the bias added in this order there too,
// bwd_row_stats.cuh): a multiply-add contracted into exp(x * scale - max) left the rounding
// residual of x * scale in the exponent, so a row's only visible key got P = exp(residual) != 1
// and dQ, dK a few ulp where they are exactly 0. cap and bias as for prob_of_score_log2.
template <bool kCapped, bool kAlibi>
__device__ __forceinline__ float exp_of_score(float x, float max, const BwdParams& p, float& cap, float bias) {
  cap = kCapped ? __fmul_rn(p.softcap, tanhf(x * p.scale_over_cap)) : 0.0f;
  float sc = kCapped ? cap : __fmul_rn(x, p.scale);
  if constexpr (kAlibi) sc = __fadd_rn(sc, bias);
  return expf(sc - max);
}

// P of one raw score x (q.k) of a query whose statistics are l (L * log2(e); fp32: the row max)
// and row_sum (fp32 only); cap and bias as for prob_of_score_log2.
template <class T, bool kCapped, bool kAlibi = false>
__device__ __forceinline__ float prob_of_score(float x, float l, float row_sum, const BwdParams& p, float& cap,
                                               float bias = 0.0f) {
  if constexpr (std::is_same_v<T, float>) {
    return exp_of_score<kCapped, kAlibi>(x, l, p, cap, bias) / row_sum;
  } else {
    return prob_of_score_log2<kCapped, kAlibi>(x, l, p, cap, bias);
  }
}

// dS = P * (dP - D), times d capped / d score under soft-capping.
template <bool kCapped>
__device__ __forceinline__ float grad_of_prob(float pe, float dp, float d, float cap, const BwdParams& p) {
  const float ds = pe * (dp - d);
  return kCapped ? ds * softcap_grad(cap, p.softcap) : ds;
}

// s and dp are one warp's accumulator tiles; its first element sits at (row0, col0) of the
// block's tile, whose first query and key are q0 and k0 of the sequence. kRowsAreKeys says which
// side of the tile is the key side (the dK/dV kernel computes S^T). lse2/dsum are per query of
// the tile (fp32: row max and row_sum, see bwd_params.hpp). P goes to sP (when kStoreP) and dS
// to sdS, both at the same (row, column). Soft-capping and masking are template flags so that
// the common tile runs neither test per element; scores_to_grads below picks the variant.
// kAlibi adds ALiBi's bias of slope `slope` (natural units) at the mask's indices. kDropout
// redraws the forward's mask (common/philox.hpp) for sequence b and query head hq: the stored P
// (dV's) and dP take the factor keep / (1 - p), dS = P (dP keep / (1 - p) - D) keeps the undropped P.
template <class T, bool kRowsAreKeys, bool kStoreP, bool kCapped, bool kMasked, bool kAlibi = false,
          bool kDropout = false, int MT, int NT>
__device__ __forceinline__ void scores_to_grads_tile(const float (&s)[MT][NT][4], const float (&dp)[MT][NT][4],
                                                     const float* lse2, const float* row_sum, const float* dsum,
                                                     int row0, int col0, int q0, int k0, const Mask& mask,
                                                     const BwdParams& p, T* sP, T* sdS, int ld, float slope = 0.0f,
                                                     int b = 0, int hq = 0) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int c = col0 + j * 8 + (lane & 3) * 2;
    // A column's query statistics, read once when the columns are queries.
    float col_lse[2] = {0.0f, 0.0f}, col_sum[2] = {1.0f, 1.0f}, col_d[2] = {0.0f, 0.0f};
    if constexpr (kRowsAreKeys) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        col_lse[e] = lse2[c + e];
        col_d[e] = dsum[c + e];
        if constexpr (std::is_same_v<T, float>) col_sum[e] = row_sum[c + e];
      }
    }
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = row0 + i * 16 + (lane >> 2) + h * 8;
        float pv[2], ds[2];
        // Dropout's factor per element: keep / (1 - p). Columns are two queries of one key (two
        // Philox calls) or two neighbouring keys of one query (k0 + c is even: one call).
        float drop[2] = {1.0f, 1.0f};
        if constexpr (kDropout) {
          const Dropout dr = p.dropout.resolved();
          if constexpr (kRowsAreKeys) {
#pragma unroll
            for (int e = 0; e < 2; ++e) drop[e] = dr.keep(b, hq, q0 + c + e, k0 + r) ? dr.scale : 0.0f;
          } else {
            const Philox4 words = dr.draws(b, hq, q0 + r, k0 + c);
#pragma unroll
            for (int e = 0; e < 2; ++e) drop[e] = dropout_word(words, k0 + c + e) >= dr.threshold ? dr.scale : 0.0f;
          }
        }
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float l = kRowsAreKeys ? col_lse[e] : lse2[r];
          const float d = kRowsAreKeys ? col_d[e] : dsum[r];
          // Row sums exist for fp32 only (row_sum is null otherwise).
          float sum = 1.0f;
          if constexpr (std::is_same_v<T, float>) sum = kRowsAreKeys ? col_sum[e] : row_sum[r];
          float cap;
          const int qi = kRowsAreKeys ? c + e : r, kj = kRowsAreKeys ? r : c + e;
          float bias = 0.0f;
          if constexpr (kAlibi) bias = ScoreMod::alibi_bias(slope, q0 + qi, k0 + kj, mask.seqlen_q, mask.seqlen_k);
          float pe = prob_of_score<T, kCapped, kAlibi>(s[i][j][2 * h + e], l, sum, p, cap, bias);
          if constexpr (kMasked) {
            if (!mask.visible(q0 + qi, k0 + kj)) pe = 0.0f;
          }
          if constexpr (kDropout) {
            pv[e] = pe * drop[e];
            ds[e] = grad_of_prob<kCapped>(pe, dp[i][j][2 * h + e] * drop[e], d, cap, p);
          } else {
            pv[e] = pe;
            ds[e] = grad_of_prob<kCapped>(pe, dp[i][j][2 * h + e], d, cap, p);
          }
        }
        if constexpr (kStoreP) store2(sP + r * ld + c, pv[0], pv[1]);
        store2(sdS + r * ld + c, ds[0], ds[1]);
      }
  }
}

// b, h: the tile's sequence and query head (ALiBi's slope). A problem with ALiBi takes its own
// two variants (capped or not, masked per element) behind one uniform branch, so the tiles of a
// problem without it run exactly the code they ran before.
template <class T, bool kRowsAreKeys, bool kStoreP, int MT, int NT>
__device__ __forceinline__ void scores_to_grads(const float (&s)[MT][NT][4], const float (&dp)[MT][NT][4],
                                                const float* lse2, const float* row_sum, const float* dsum, int row0,
                                                int col0, int q0, int k0, bool masked, const Mask& mask,
                                                const BwdParams& p, T* sP, T* sdS, int ld, int b, int h) {
#define TA_BWD_GRADS(capped, msk)                                                                                      \
  scores_to_grads_tile<T, kRowsAreKeys, kStoreP, capped, msk>(s, dp, lse2, row_sum, dsum, row0, col0, q0, k0, mask, p, \
                                                              sP, sdS, ld)
  // Dropout takes its own variants, masked per element, behind one uniform branch like ALiBi.
  if (p.dropout.on) {
    const bool alibi = p.mod.has_alibi();
    const float slope = alibi ? p.mod.slope(b, h) : 0.0f;
#define TA_BWD_DROP(capped, ali)                                                                             \
  scores_to_grads_tile<T, kRowsAreKeys, kStoreP, capped, true, ali, true>(s, dp, lse2, row_sum, dsum, row0, col0, q0, \
                                                                          k0, mask, p, sP, sdS, ld, slope, b, h)
    if (p.softcap > 0.0f) {
      if (alibi) TA_BWD_DROP(true, true);
      else TA_BWD_DROP(true, false);
    } else {
      if (alibi) TA_BWD_DROP(false, true);
      else TA_BWD_DROP(false, false);
    }
#undef TA_BWD_DROP
    return;
  }
  if (p.mod.has_alibi()) {
    const float slope = p.mod.slope(b, h);
    if (p.softcap > 0.0f)
      scores_to_grads_tile<T, kRowsAreKeys, kStoreP, true, true, true>(s, dp, lse2, row_sum, dsum, row0, col0, q0, k0,
                                                                      mask, p, sP, sdS, ld, slope);
    else
      scores_to_grads_tile<T, kRowsAreKeys, kStoreP, false, true, true>(s, dp, lse2, row_sum, dsum, row0, col0, q0, k0,
                                                                       mask, p, sP, sdS, ld, slope);
    return;
  }
  if (p.softcap > 0.0f) {
    if (masked)
      TA_BWD_GRADS(true, true);
    else
      TA_BWD_GRADS(true, false);
  } else {
    if (masked)
      TA_BWD_GRADS(false, true);
    else
      TA_BWD_GRADS(false, false);
  }
#undef TA_BWD_GRADS
}

// ---- the same per element, for wgmma tiles whose P and dS stay in registers (sm90) -------------

// Where a warpgroup's accumulator tile sits and the query statistics it needs. Rows are keys
// (dK/dV): col_lse2/col_dsum hold the tile's queries' L * log2(e) and D, one per column.
// Rows are queries (dQ): row_lse2/row_dsum hold those of this thread's rows g and g + 8.
struct Fragment {
  const float* col_lse2;
  const float* col_dsum;
  float row_lse2[2], row_dsum[2];
  int col0;  // sequence position (query or key) of column 0
  int row;   // sequence position (key or query) of this thread's row g
  Mask mask;
  // fp32's exact mode: the row sums beside the row maxima that lse2 then holds, and their
  // reciprocals.
  const float* col_sum = nullptr;
  const float* col_inv_sum = nullptr;
  float row_sum[2] = {1.0f, 1.0f}, row_inv_sum[2] = {1.0f, 1.0f};
  int batch = 0, head = 0;  // the tile's sequence and query head: dropout's stream
};

// The columns of this thread's rows g and g + 8 (sequence positions row, row + 8) that the mask
// shows, relative to the thread's first column (col0 + 2t, col0 the tile's first column), so that
// each element is compared with constants: column 8 j + e of row half h is visible iff
// lo[h] <= 8 j + e < hi[h]. Rows are keys: the queries that see the key, none past the keys and
// none past the queries (padding columns, whose P the workspace's +inf already zeroes); rows are
// queries: the keys the query sees. (mask.visible per element compiled to about 25 instructions
// and two branches: its clamps, one of them 64-bit.)
template <bool kRowsAreKeys>
struct VisibleSpan {
  int lo[2], hi[2];
  __device__ __forceinline__ VisibleSpan(const Mask& mask, int row, int col0) {
    const int first = col0 + 2 * (int(threadIdx.x) % 4);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row + 8 * h;
      int begin, end;
      if constexpr (kRowsAreKeys) {
        const bool key = r < mask.seqlen_k;
        begin = key ? mask.tile_begin_query(r) : 0;
        end = key ? mask.tile_end_query(r + 1) : 0;
      } else {
        begin = mask.begin_key(r);
        end = mask.end_key(r);
      }
      lo[h] = begin - first;
      hi[h] = end - first;
    }
  }
  __device__ __forceinline__ bool operator()(int h, int c) const { return c >= lo[h] && c < hi[h]; }
};

// Accumulator column tiles (8 columns) per k-step of the next product: 16-bit k-steps are 16
// columns, TF32 ones 8.
template <class T>
constexpr int kTilesPerStep = sizeof(T) == 2 ? 2 : 1;

// Where accumulator element (row g + 8 half, column 8 j + 2t + e) sits in TF32 A fragments: slot
// half + 2e of fragment j, which the tensor core reads as k position t + 4e (the B operands are
// written in that column order, tf32_operands_sm90.cuh).
__device__ __forceinline__ constexpr int tf32_a_slot(int half, int e) { return half + 2 * e; }

// s, dp: m64nN accumulators (per warp the mma.sync C layout). Writes P and dS as A fragments of
// the next product, rounded to T (16-bit: k-step ks covers columns 16 ks .. 16 ks + 15) or to
// TF32 for fp32 (the fast mode; k-step ks covers columns 8 ks .. 8 ks + 7, fragment position t
// holding column 2t and t + 4 column 2t + 1: the B operand is stored in that order,
// tf32_operands_sm90.cuh). kAlibi adds ALiBi's bias of slope `slope` (natural units, as
// prob_of_score takes it) at the mask's indices; L comes without the causal form's offset (the
// preprocess took it off), so P is the forward's, and the bias is constant in s: dS needs nothing
// more from it. fp32's statistics are in the natural domain (bwd_params.hpp) and are taken to
// log2 here.
template <class T, bool kRowsAreKeys, bool kCapped, bool kMasked, bool kAlibi, int NT>
__device__ __forceinline__ void grads_to_fragments(const float (&s)[1][NT][4], const float (&dp)[1][NT][4],
                                                   const Fragment& f, const BwdParams& p,
                                                   uint32_t (&pa)[NT / kTilesPerStep<T>][4],
                                                   uint32_t (&da)[NT / kTilesPerStep<T>][4],
                                                   [[maybe_unused]] float slope) {
  constexpr float kToLog2 = std::is_same_v<T, float> ? kLog2e : 1.0f;
  const int t = threadIdx.x % 4;
  [[maybe_unused]] const VisibleSpan<kRowsAreKeys> shown(f.mask, f.row, f.col0);
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float pv[2], ds[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = j * 8 + 2 * t + e;
        const float l = (kRowsAreKeys ? f.col_lse2[c] : f.row_lse2[half]) * kToLog2;
        const float d = kRowsAreKeys ? f.col_dsum[c] : f.row_dsum[half];
        float cap, pe;
        if constexpr (kAlibi) {
          const int qi = kRowsAreKeys ? f.col0 + c : f.row + 8 * half;  // the element's query and key
          const int kj = kRowsAreKeys ? f.row + 8 * half : f.col0 + c;
          const float bias = ScoreMod::alibi_bias(slope, qi, kj, f.mask.seqlen_q, f.mask.seqlen_k);
          pe = prob_of_score_log2<kCapped, true>(s[0][j][2 * half + e], l, p, cap, bias);
          // (The span's registers gave the Hopper backward's ALiBi instances a stack.)
          if constexpr (kMasked)
            if (!f.mask.visible(qi, kj)) pe = 0.0f;
        } else {
          pe = prob_of_score_log2<kCapped>(s[0][j][2 * half + e], l, p, cap);
          if constexpr (kMasked)
            if (!shown(half, j * 8 + e)) pe = 0.0f;
        }
        pv[e] = pe;
        ds[e] = grad_of_prob<kCapped>(pe, dp[0][j][2 * half + e], d, cap, p);
      }
      if constexpr (sizeof(T) == 2) {
        pa[j / 2][2 * (j % 2) + half] = pack2<T>(pv[0], pv[1]);
        da[j / 2][2 * (j % 2) + half] = pack2<T>(ds[0], ds[1]);
      } else {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          pa[j][tf32_a_slot(half, e)] = fp32::to_tf32(pv[e]);
          da[j][tf32_a_slot(half, e)] = fp32::to_tf32(ds[e]);
        }
      }
    }
}

// The variant for this tile: soft-capping per problem, masking per tile; ALiBi per kernel
// instance (slope: the tile's sequence and query head).
template <class T, bool kRowsAreKeys, bool kAlibi = false, int NT>
__device__ __forceinline__ void grads_to_fragments(bool masked, const float (&s)[1][NT][4],
                                                   const float (&dp)[1][NT][4], const Fragment& f,
                                                   const BwdParams& p, uint32_t (&pa)[NT / kTilesPerStep<T>][4],
                                                   uint32_t (&da)[NT / kTilesPerStep<T>][4], float slope = 0.0f) {
  if (p.softcap > 0.0f) {
    if (masked) grads_to_fragments<T, kRowsAreKeys, true, true, kAlibi>(s, dp, f, p, pa, da, slope);
    else grads_to_fragments<T, kRowsAreKeys, true, false, kAlibi>(s, dp, f, p, pa, da, slope);
  } else {
    if (masked) grads_to_fragments<T, kRowsAreKeys, false, true, kAlibi>(s, dp, f, p, pa, da, slope);
    else grads_to_fragments<T, kRowsAreKeys, false, false, kAlibi>(s, dp, f, p, pa, da, slope);
  }
}

// The exact mode's (split TF32) form of grads_to_fragments: P (kWantP) or dS of the tile as the
// A fragments of the next product in two parts, x = hi + lo (fp32::split_tf32, both rounded to
// nearest). P is the portable exact kernels' exp(s * scale - max) / sum (prob_of_score<float>),
// from the statistics the exact statistics pass wrote, so that a row's largest score gives
// exp(0) = 1 exactly and one visible key gives P = 1, dS = 0. The quotient comes from the row's
// reciprocal (fp32::divide_by), not a divide per element: that is some twenty instructions and a
// branch to its slow path, which keeps the compiler from interleaving elements (docs/perf-log.md).
// kDropout: P z for dV and dS = P (z dP - D), z = keep / (1 - p), as scores_to_grads_tile.
template <bool kRowsAreKeys, bool kWantP, bool kCapped, bool kMasked, bool kAlibi, bool kDropout, int NT>
__device__ __forceinline__ void exact_grad_fragments(const float (&s)[NT][4], const float (&dp)[NT][4],
                                                     const Fragment& f, const BwdParams& p, uint32_t (&hi)[NT][4],
                                                     uint32_t (&lo)[NT][4], [[maybe_unused]] float slope) {
  const int t = threadIdx.x % 4;
  [[maybe_unused]] const VisibleSpan<kRowsAreKeys> shown(f.mask, f.row, f.col0);
  [[maybe_unused]] Dropout dr;
  if constexpr (kDropout) dr = p.dropout.resolved();
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    [[maybe_unused]] float keep[2][2];
    if constexpr (kDropout && kRowsAreKeys) {
      dropout_factors_of_key(dr, f.batch, f.head, f.row, f.col0 + j * 8 + 2 * t, keep);
    } else if constexpr (kDropout) {
#pragma unroll
      for (int half = 0; half < 2; ++half)
        dropout_factors_of_query(dr, f.batch, f.head, f.row + 8 * half, f.col0 + j * 8 + 2 * t, keep[half]);
    }
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = j * 8 + 2 * t + e;
        const int query = kRowsAreKeys ? f.col0 + c : f.row + 8 * half;
        const int key = kRowsAreKeys ? f.row + 8 * half : f.col0 + c;
        const float m = kRowsAreKeys ? f.col_lse2[c] : f.row_lse2[half];
        const float sum = kRowsAreKeys ? f.col_sum[c] : f.row_sum[half];
        const float inv_sum = kRowsAreKeys ? f.col_inv_sum[c] : f.row_inv_sum[half];
        float cap, bias = 0.0f;
        if constexpr (kAlibi) bias = ScoreMod::alibi_bias(slope, query, key, f.mask.seqlen_q, f.mask.seqlen_k);
        float x = fp32::divide_by(exp_of_score<kCapped, kAlibi>(s[j][2 * half + e], m, p, cap, bias), sum, inv_sum);
        if constexpr (kMasked)
          if (!shown(half, j * 8 + e)) x = 0.0f;
        if constexpr (kWantP && kDropout) {
          x *= keep[half][e];
        } else if constexpr (!kWantP) {
          const float d = kRowsAreKeys ? f.col_dsum[c] : f.row_dsum[half];
          const float dpe = kDropout ? dp[j][2 * half + e] * keep[half][e] : dp[j][2 * half + e];
          x = grad_of_prob<kCapped>(x, dpe, d, cap, p);
        }
        float h, r;
        fp32::split_tf32(x, h, r);
        hi[j][tf32_a_slot(half, e)] = __float_as_uint(h);
        lo[j][tf32_a_slot(half, e)] = fp32::tf32_bits(r);
      }
  }
}

// The variant for this tile, as grads_to_fragments picks it (ALiBi and dropout: per kernel instance).
template <bool kRowsAreKeys, bool kWantP, bool kAlibi, bool kDropout, int NT>
__device__ __forceinline__ void exact_grad_fragments(bool masked, const float (&s)[NT][4], const float (&dp)[NT][4],
                                                     const Fragment& f, const BwdParams& p, uint32_t (&hi)[NT][4],
                                                     uint32_t (&lo)[NT][4], float slope) {
#define TA_EXACT_GRADS(capped, msk) \
  exact_grad_fragments<kRowsAreKeys, kWantP, capped, msk, kAlibi, kDropout>(s, dp, f, p, hi, lo, slope)
  if (p.softcap > 0.0f) {
    if (masked) TA_EXACT_GRADS(true, true);
    else TA_EXACT_GRADS(true, false);
  } else {
    if (masked) TA_EXACT_GRADS(false, true);
    else TA_EXACT_GRADS(false, false);
  }
#undef TA_EXACT_GRADS
}

}  // namespace tileattn::cuda::bwd
