#pragma once
// Each query row's softmax statistics and D, recomputed from Q, K, V and dO: the portable exact
// fp32 backward's (both passes below; the Hopper one has its own statistics pass,
// bwd_kernel_exact_sm90.cuh, which forms the same sums online), and the 16-bit backward's D where
// rowsum(O dO) is not accurate enough (consistent_delta: the second pass only, P from the
// forward's L).
//
// Recomputing P as exp(s - L) from the forward's L costs fp32 about |L| units in the last place
// of relative error in every P (L is a sum of a max and a log, each rounded at its magnitude),
// which is several times what a naive fp32 softmax, exp(s - max) / sum, commits. So the exact
// fp32 backward rebuilds max and sum per row in this extra pass over the keys (one product of the
// backward's five) and forms P the naive way.
//
// One block per query tile of one (batch, head); each thread keeps a running (max, sum) for its
// fragment rows over its columns, merged across the quad and the block's column warps at the end.
// Writes lse2 := row max (natural domain) and row_sum; rows that see no key keep the preprocess's
// +inf and 1, so their P is 0.
//
// A second pass over the same keys then forms D = rowsum(P dP) / rowsum(P) from the very P and dP
// that the dK/dV and dQ kernels compute (same products, same prob_of_score), as the CPU backward's
// compute_delta_consistent does. dS = P (dP - D) cancels D against dP, and D = rowsum(O dO) from
// the forward's O agrees with the gradient passes' P and dP only up to O's rounding summed over
// headdim_v: where the exact dQ and dK are ~0 (one visible key, identical keys or values, a row
// one key dominates, headdim_v large) that rounding is the whole result, several times a naive
// implementation's error (whose D comes from its own P and dP). With this D the row's dS sum to 0
// up to D's own rounding, and one visible key gives P = 1, D = dP and dS = 0 exactly. The pass
// costs two more tile products (S and dP) per key tile of the row.
//
// With dropout (z = keep / (1 - p) per element, common/philox.hpp) the gradient passes form
// dS = P (z dP - D), so D = rowsum(P z dP) / rowsum(P): the row's O.dO with the dropped O. The
// statistics, like the forward's, stay undropped.
//
// Not run with partial_keys (problem.hpp): a call over part of a row's keys must form P from the
// given L and D from the given O (bwd_preprocess.cuh writes both), since its own keys' max, sum
// and rowsum(P dP) are not the row's. The backward then has the 16-bit path's accuracy in fp32
// (P carries L's rounding; docs/accuracy.md).
#include <math.h>

#include <type_traits>

#include "common/philox.hpp"
#include "common/score_mod.hpp"
#include "cuda/arch/warp_mma_sm80.cuh"
#include "cuda/backward/bwd_grads.cuh"
#include "cuda/common/bwd_params.hpp"
#include "cuda/backward/bwd_tile_io.cuh"
#include "cuda/backward/bwd_traits.cuh"
#include "cuda/common/check.cuh"
#include "cuda/common/runtime_cache.hpp"

namespace tileattn::cuda::bwd {

// (m, l) <- the statistics of the union of two column sets.
__device__ __forceinline__ void merge_stats(float& m, float& l, float m2, float l2) {
  const float mn = fmaxf(m, m2);
  if (mn == -INFINITY) return;
  l = l * expf(m - mn) + l2 * expf(m2 - mn);
  m = mn;
}

// Q, dO, K, V tiles; per (column warp, row): the D pass's double sums, then max and sum; per row:
// the merged max and sum the D pass forms P from.
template <class T, int D>
struct RowStatsTile {
  using Tile = DqTile<T, D>;
  static constexpr int kSmemBytes =
      int(sizeof(T)) * (2 * Tile::kBlockM * Tile::kLd + 2 * Tile::kBlockN * Tile::kLd) +
      int(sizeof(double)) * 2 * Tile::kGridS.wn * Tile::kBlockM +
      int(sizeof(float)) * (2 * Tile::kGridS.wn * Tile::kBlockM + 2 * Tile::kBlockM);
};

// T = float: both passes (not with given_stats). 16-bit: the D pass alone, over P = exp2(s log2 e
// - L log2 e) as the gradient passes form it from the preprocess's lse2 (row_sum 1), so that D
// cancels against their dP: with headdim_qk <= 8 the scores are few-term sums and rows peaky, and
// D = rowsum(O dO) from the 16-bit O missed by O's rounding (bf16, headdim 1/55: dK 0.257 against
// a naive backward's 0.065; docs/accuracy.md).
template <class T, int D, Fp32Math M = Fp32Math::fp64>
__global__ void __launch_bounds__(kThreads, 1) row_stats_kernel(const BwdParams p) {
  using Tile = DqTile<T, D>;
  constexpr int BM = Tile::kBlockM, BN = Tile::kBlockN, LD = Tile::kLd;
  constexpr WarpGrid GS = Tile::kGridS;
  constexpr int MT = GS.tm / 16, NT = GS.tn / 8;
  constexpr bool kStats = std::is_same_v<T, float>;

  extern __shared__ __align__(16) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* sdO = sQ + BM * LD;
  T* sK = sdO + BM * LD;
  T* sV = sK + BN * LD;
  double* sPdP = reinterpret_cast<double*>(sV + BN * LD);  // [column warp][row]: sum of P dP
  double* sP = sPdP + GS.wn * BM;                           // [column warp][row]: sum of P
  float* sM = reinterpret_cast<float*>(sP + GS.wn * BM);    // [column warp][row]
  float* sSum = sM + GS.wn * BM;
  float* sRowM = sSum + GS.wn * BM;  // [row]: the statistics P is formed from (prob_of_score)
  float* sRowSum = sRowM + BM;

  const int b = blockIdx.y, h = blockIdx.z, hk = h / p.group;
  const SeqInfo s = seq_info(p, b);
  const int q0 = blockIdx.x * BM;
  if (q0 >= s.sq) return;
  const int q1 = min(q0 + BM, s.sq);
  const Mask mask = seq_mask(p, s);
  const TileSpan keys = tile_span(mask.tile_begin_key(q0), mask.tile_end_key(q1), BN);
  const int t0 = keys.first, n_tiles = keys.count;

  const T* gQ =
      static_cast<const T*>(p.q.ptr) + seq_base(p, p.q, b, true) + int64_t(h) * p.q.head + int64_t(q0) * p.q.seq;
  const T* gK = static_cast<const T*>(p.k.ptr) + seq_base(p, p.k, b, false) + int64_t(hk) * p.k.head;
  const T* gV = static_cast<const T*>(p.v.ptr) + seq_base(p, p.v, b, false) + int64_t(hk) * p.v.head;
  const T* gdO = static_cast<const T*>(p.dout.ptr) + seq_base(p, p.dout, b, true) + int64_t(h) * p.dout.head +
                 int64_t(q0) * p.dout.seq;
  load_tile<T, BM, D, LD>(sQ, gQ, p.q.seq, q1 - q0, p.headdim_qk, p.vec_io);
  load_tile<T, BM, D, LD>(sdO, gdO, p.dout.seq, q1 - q0, p.headdim_v, p.vec_io);
  cp_async_commit();  // committed even when no key tile follows, so the final wait covers it

  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int s_row = (warp / GS.wn) * GS.tm, s_col = (warp % GS.wn) * GS.tn;
  const bool alibi = p.mod.has_alibi();
  const float slope = p.mod.slope(b, h);

  // The statistics pass (fp32): max and sum of the scaled scores over the row's keys.
  if constexpr (kStats) {
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int i = 0; i < MT; ++i) m[i][0] = m[i][1] = -INFINITY, l[i][0] = l[i][1] = 0.0f;
    for (int it = 0; it < n_tiles; ++it) {
      const int k0 = (t0 + it) * BN;
      load_tile<T, BN, D, LD>(sK, gK + int64_t(k0) * p.k.seq, p.k.seq, s.sk - k0, p.headdim_qk, p.vec_io);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
      float st[MT][NT][4];
      zero(st);
      // In fp64, as the passes that form P from these statistics sum S.
      warp_gemm<T, MT, NT, D, true, false, M>(st, sQ + s_row * LD, LD, sK + s_col * LD, LD);
      const bool masked = !(mask.full_begin_key(q1) <= k0 && mask.full_end_key(q0) >= k0 + BN);
      // kAlibi: ALiBi's bias after the cap, added as prob_of_score adds it, so that P's statistics
      // are those of the scores it forms. One uniform branch per tile picks the variant (a test
      // of the cap per score would make each score a jump over the inlined tanh).
      auto tile_stats = [&](auto capped_c, auto alibi_c) {
        constexpr bool kCapped = decltype(capped_c)::value, kAlibi = decltype(alibi_c)::value;
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int r = s_row + i * 16 + (lane >> 2) + hh * 8;
            float v[NT][2];
            float tile_max = -INFINITY;
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const int c = s_col + j * 8 + (lane & 3) * 2 + e;
                v[j][e] = stats_score<kCapped, kAlibi>(st[i][j][2 * hh + e], q0 + r, k0 + c,
                                                       masked && !mask.visible(q0 + r, k0 + c), slope, mask, p);
                tile_max = fmaxf(tile_max, v[j][e]);
              }
            float tile_sum = 0.0f;
            if (tile_max != -INFINITY)
#pragma unroll
              for (int j = 0; j < NT; ++j) tile_sum += expf(v[j][0] - tile_max) + expf(v[j][1] - tile_max);
            merge_stats(m[i][hh], l[i][hh], tile_max, tile_sum);
          }
      };
      if (p.softcap > 0.0f) {
        if (alibi) tile_stats(std::true_type{}, std::true_type{});
        else tile_stats(std::true_type{}, std::false_type{});
      } else {
        if (alibi) tile_stats(std::false_type{}, std::true_type{});
        else tile_stats(std::false_type{}, std::false_type{});
      }
      __syncthreads();  // sK is refilled next
    }

    // Quad lanes share rows; then the column warps of each row band.
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
#pragma unroll
        for (int off = 1; off < 4; off <<= 1)
          merge_stats(m[i][hh], l[i][hh], __shfl_xor_sync(0xffffffffu, m[i][hh], off),
                      __shfl_xor_sync(0xffffffffu, l[i][hh], off));
        if ((lane & 3) == 0) {
          const int r = s_row + i * 16 + (lane >> 2) + hh * 8;
          sM[(warp % GS.wn) * BM + r] = m[i][hh];
          sSum[(warp % GS.wn) * BM + r] = l[i][hh];
        }
      }
  }
  cp_async_wait<0>();
  __syncthreads();
  for (int r = threadIdx.x; r < BM; r += kThreads) {
    // What the gradient passes read for the row: (max, sum), or (+inf, 1) where P is 0; 16-bit:
    // (L log2 e, 1) as the preprocess wrote them.
    float mr = INFINITY, lr = 1.0f;
    if (!kStats) {
      if (r < q1 - q0) mr = p.lse2[ws_row(p, b, h) + q0 + r];
    } else if (r < q1 - q0) {
      float m_all = sM[r], l_all = sSum[r];
      for (int w = 1; w < GS.wn; ++w) merge_stats(m_all, l_all, sM[w * BM + r], sSum[w * BM + r]);
      if (l_all > 0.0f) {
        const int64_t w = ws_row(p, b, h) + q0 + r;
        p.lse2[w] = mr = m_all;
        p.row_sum[w] = lr = l_all;
      }
    }
    sRowM[r] = mr;
    sRowSum[r] = lr;
  }
  __syncthreads();

  // D = rowsum(P dP) / rowsum(P), P and dP summed in double over the row's keys (see the file
  // comment). The products are the dQ kernel's (same tiles, warp grid and fp64 sums), whose
  // elements equal the dK/dV kernel's transposed ones.
  double pdp[MT][2], psum[MT][2];
#pragma unroll
  for (int i = 0; i < MT; ++i) pdp[i][0] = pdp[i][1] = psum[i][0] = psum[i][1] = 0.0;
  for (int it = 0; it < n_tiles; ++it) {
    const int k0 = (t0 + it) * BN;
    load_tile<T, BN, D, LD>(sK, gK + int64_t(k0) * p.k.seq, p.k.seq, s.sk - k0, p.headdim_qk, p.vec_io);
    load_tile<T, BN, D, LD>(sV, gV + int64_t(k0) * p.v.seq, p.v.seq, s.sk - k0, p.headdim_v, p.vec_io);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    float dp[MT][NT][4], st[MT][NT][4];
    zero(dp);
    zero(st);
    warp_gemm<T, MT, NT, D, true, false, M>(dp, sdO + s_row * LD, LD, sV + s_col * LD, LD);
    warp_gemm<T, MT, NT, D, true, false, M>(st, sQ + s_row * LD, LD, sK + s_col * LD, LD);
    const bool masked = !(mask.full_begin_key(q1) <= k0 && mask.full_end_key(q0) >= k0 + BN);
    // kDropout: dP takes the element's z, as scores_to_grads_tile gives it (one Philox call per
    // pair of columns: k0 is a whole tile of keys, so the pair's first key is even).
    auto tile_sums = [&](auto capped_c, auto alibi_c, auto dropout_c) {
      constexpr bool kCapped = decltype(capped_c)::value, kAlibi = decltype(alibi_c)::value;
      constexpr bool kDropout = decltype(dropout_c)::value;
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int r = s_row + i * 16 + (lane >> 2) + hh * 8;
          const float mr = sRowM[r], lr = sRowSum[r];
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            const int c0 = s_col + j * 8 + (lane & 3) * 2;
            float z[2] = {1.0f, 1.0f};
            if constexpr (kDropout) {
              const Dropout dr = p.dropout.resolved();
              const Philox4 words = dr.draws(b, h, q0 + r, k0 + c0);
#pragma unroll
              for (int e = 0; e < 2; ++e) z[e] = dropout_word(words, k0 + c0 + e) >= dr.threshold ? dr.scale : 0.0f;
            }
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int c = c0 + e;
              float bias = 0.0f, cap;
              if constexpr (kAlibi) bias = ScoreMod::alibi_bias(slope, q0 + r, k0 + c, s.sq, s.sk);
              float pe = prob_of_score<T, kCapped, kAlibi>(st[i][j][2 * hh + e], mr, lr, p, cap, bias);
              if (masked && !mask.visible(q0 + r, k0 + c)) pe = 0.0f;
              const float dpe = kDropout ? dp[i][j][2 * hh + e] * z[e] : dp[i][j][2 * hh + e];
              pdp[i][hh] += double(pe) * double(dpe);
              psum[i][hh] += double(pe);
            }
          }
        }
    };
    auto sums_for = [&](auto dropout_c) {
      if (p.softcap > 0.0f) {
        if (alibi) tile_sums(std::true_type{}, std::true_type{}, dropout_c);
        else tile_sums(std::true_type{}, std::false_type{}, dropout_c);
      } else {
        if (alibi) tile_sums(std::false_type{}, std::true_type{}, dropout_c);
        else tile_sums(std::false_type{}, std::false_type{}, dropout_c);
      }
    };
    if (p.dropout.on)
      sums_for(std::true_type{});
    else
      sums_for(std::false_type{});
    __syncthreads();  // sK and sV are refilled next
  }
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
#pragma unroll
      for (int off = 1; off < 4; off <<= 1) {
        pdp[i][hh] += __shfl_xor_sync(0xffffffffu, pdp[i][hh], off);
        psum[i][hh] += __shfl_xor_sync(0xffffffffu, psum[i][hh], off);
      }
      if ((lane & 3) == 0) {
        const int r = s_row + i * 16 + (lane >> 2) + hh * 8;
        sPdP[(warp % GS.wn) * BM + r] = pdp[i][hh];
        sP[(warp % GS.wn) * BM + r] = psum[i][hh];
      }
    }
  cp_async_wait<0>();  // no copy may outlive the block (tiles loaded for an empty loop)
  __syncthreads();
  for (int r = threadIdx.x; r < q1 - q0; r += kThreads) {
    double num = sPdP[r], den = sP[r];
    for (int w = 1; w < GS.wn; ++w) num += sPdP[w * BM + r], den += sP[w * BM + r];
    p.dsum[ws_row(p, b, h) + q0 + r] = den > 0.0 ? float(num / den - lse_grad(p, s, b, h, q0 + r)) : 0.0f;
  }
}

// After the preprocess, before the gradient passes: fp32's statistics and D unless given_stats,
// 16-bit's D where consistent_delta asks for it; nothing otherwise.
template <class T, int D, Fp32Math M = Fp32Math::fp64>
void launch_row_stats(const BwdParams& p, cudaStream_t stream) {
  if constexpr (!(std::is_same_v<T, float> && M == Fp32Math::tf32)) {  // the fast mode takes L and O as given
    if (std::is_same_v<T, float> ? p.given_stats : !p.consistent_delta) return;
    constexpr int smem = RowStatsTile<T, D>::kSmemBytes;
    allow_dynamic_smem(row_stats_kernel<T, D, M>, smem);
    const dim3 grid((p.seqlen_q + DqTile<T, D>::kBlockM - 1) / DqTile<T, D>::kBlockM, p.batch, p.heads_q);
    row_stats_kernel<T, D, M><<<grid, kThreads, smem, stream>>>(p);
    if constexpr (std::is_same_v<T, float>) TA_CUDA_CHECK_LAUNCH("backward fp32 row statistics");
    else TA_CUDA_CHECK_LAUNCH("backward D from P and dP");
  }
}

}  // namespace tileattn::cuda::bwd
