#pragma once
// dK and dV: the outer loop runs over key tiles (one block per key tile of one batch and kv
// head), the inner loop over the query tiles that can see it, for every query head of the kv
// head's group. dK and dV therefore sum over the group in registers and are written once.
//
// Per query tile (S^T is keys x queries, so the key-side operands stay in shared memory):
//   dP^T = V dO^T        S^T = K Q^T         P^T, dS^T = grads(S^T, dP^T)  -> shared memory
//   dV  += P^T dO        dK  += dS^T Q       dQ  += dS K  (fp32 atomics, when dQ has no pass)
// The next tile's Q and dO are fetched into a second buffer while this tile computes when shared
// memory holds two (p.dkdv_stages == 2), else into the one buffer once dK's product has read it,
// overlapping the dQ product.
#include <type_traits>

#include "cuda/arch/warp_mma_sm80.cuh"
#include "cuda/backward/bwd_grads.cuh"
#include "cuda/common/bwd_params.hpp"
#include "cuda/backward/bwd_tile_io.cuh"
#include "cuda/backward/bwd_traits.cuh"

namespace tileattn::cuda::bwd {

// fp32 dQ partial sums into the accumulator: two adjacent columns per vector atomic where the
// hardware has one (sm_90), halving the atomic transactions.
__device__ __forceinline__ void atomic_add2(float* g, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(g), make_float2(a, b));
#else
  atomicAdd(g, a);
  atomicAdd(g + 1, b);
#endif
}

template <class T, int D, Fp32Math M = Fp32Math::fp64>
__global__ void __launch_bounds__(kThreads, 1) dkdv_kernel(const BwdParams p) {
  using Tile = DkdvTile<T, D>;
  constexpr int BN = Tile::kBlockN, BM = Tile::kBlockM, LD = Tile::kLd, LDP = Tile::kLdP;
  constexpr WarpGrid GS = Tile::kGridS, GKV = Tile::kGridKV, GQ = Tile::kGridQ;

  extern __shared__ __align__(16) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem);
  T* sV = sK + BN * LD;
  T* sP = sV + BN * LD;    // P^T: [key][query]
  T* sdS = sP + BN * LDP;  // dS^T: [key][query]
  unsigned char* stages = reinterpret_cast<unsigned char*>(sdS + BN * LDP);
  // One query tile's operands (Q, dO, L, D, fp32 row sums), in one of p.dkdv_stages buffers.
  struct Stage {
    T *q, *dout;
    float *lse2, *dsum, *row_sum;
  };
  auto stage = [&](int it) {
    unsigned char* base = stages + (p.dkdv_stages == 2 ? (it & 1) : 0) * Tile::kStageBytes;
    Stage st;
    st.q = reinterpret_cast<T*>(base);
    st.dout = st.q + BM * LD;
    st.lse2 = reinterpret_cast<float*>(st.dout + BM * LD);
    st.dsum = st.lse2 + BM;
    st.row_sum = st.dsum + BM;
    return st;
  };

  const int b = blockIdx.y, hk = blockIdx.z;
  const SeqInfo s = seq_info(p, b);
  const int k0 = blockIdx.x * BN;
  if (k0 >= s.sk) return;
  const int k1 = min(k0 + BN, s.sk);
  const Mask mask = seq_mask(p, s);

  // Query tiles that see any key of [k0, k1); only boundary tiles pay for masking.
  const TileSpan queries = tile_span(mask.tile_begin_query(k0), mask.tile_end_query(k1), BM);
  const int t0 = queries.first, n_tiles = queries.count;
  const int n_iter = n_tiles * p.group;

  const T* gK =
      static_cast<const T*>(p.k.ptr) + seq_base(p, p.k, b, false) + int64_t(hk) * p.k.head + int64_t(k0) * p.k.seq;
  const T* gV =
      static_cast<const T*>(p.v.ptr) + seq_base(p, p.v, b, false) + int64_t(hk) * p.v.head + int64_t(k0) * p.v.seq;
  load_tile<T, BN, D, LD>(sK, gK, p.k.seq, k1 - k0, p.headdim_qk, p.vec_io);
  load_tile<T, BN, D, LD>(sV, gV, p.v.seq, k1 - k0, p.headdim_v, p.vec_io);

  auto head_of = [&](int it) { return hk * p.group + it / n_tiles; };
  auto q0_of = [&](int it) { return (t0 + it % n_tiles) * BM; };
  auto load_stage = [&](int it) {
    const int h = head_of(it), q0 = q0_of(it);
    const Stage st = stage(it);
    const T* gq =
        static_cast<const T*>(p.q.ptr) + seq_base(p, p.q, b, true) + int64_t(h) * p.q.head + int64_t(q0) * p.q.seq;
    const T* gd = static_cast<const T*>(p.dout.ptr) + seq_base(p, p.dout, b, true) + int64_t(h) * p.dout.head +
                  int64_t(q0) * p.dout.seq;
    load_tile<T, BM, D, LD>(st.q, gq, p.q.seq, s.sq - q0, p.headdim_qk, p.vec_io);
    load_tile<T, BM, D, LD>(st.dout, gd, p.dout.seq, s.sq - q0, p.headdim_v, p.vec_io);
    const int64_t w = ws_row(p, b, h) + q0;
    load_row_floats<BM>(st.lse2, p.lse2 + w);
    load_row_floats<BM>(st.dsum, p.dsum + w);
    if constexpr (std::is_same_v<T, float>) load_row_floats<BM>(st.row_sum, p.row_sum + w);
  };
  if (n_iter > 0) load_stage(0);
  cp_async_commit();  // K, V and the first query tile

  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int s_row = (warp / GS.wn) * GS.tm, s_col = (warp % GS.wn) * GS.tn;
  const int kv_row = (warp / GKV.wn) * GKV.tm, kv_col = (warp % GKV.wn) * GKV.tn;
  const int q_row = (warp / GQ.wn) * GQ.tm, q_col = (warp % GQ.wn) * GQ.tn;

  float dk[GKV.tm / 16][GKV.tn / 8][4], dv[GKV.tm / 16][GKV.tn / 8][4];
  zero(dk);
  zero(dv);

  for (int it = 0; it < n_iter; ++it) {
    const int h = head_of(it), q0 = q0_of(it);
    if (p.dkdv_stages == 2) {
      // The other buffer was last read in iteration it - 1: refill it while this tile computes.
      __syncthreads();
      if (it + 1 < n_iter) load_stage(it + 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const Stage cur = stage(it);

    float dp[GS.tm / 16][GS.tn / 8][4];
    zero(dp);
    // S^T and dP^T: in exact fp32 mode summed in fp64 over the same k order as the dQ pass's S and
    // dP, so that the two passes form the same dS.
    warp_gemm<T, GS.tm / 16, GS.tn / 8, D, true, false, M>(dp, sV + s_row * LD, LD, cur.dout + s_col * LD, LD);
    float st[GS.tm / 16][GS.tn / 8][4];
    zero(st);
    warp_gemm<T, GS.tm / 16, GS.tn / 8, D, true, false, M>(st, sK + s_row * LD, LD, cur.q + s_col * LD, LD);
    const int q1 = min(q0 + BM, s.sq);
    const bool masked = !(mask.full_begin_key(q1) <= k0 && mask.full_end_key(q0) >= k0 + BN);
    scores_to_grads<T, true, true>(st, dp, cur.lse2, cur.row_sum, cur.dsum, s_row, s_col, q0, k0, masked, mask, p, sP,
                                   sdS, LDP, b, h);
    __syncthreads();

    warp_gemm<T, GKV.tm / 16, GKV.tn / 8, BM, true, true, M>(dv, sP + kv_row * LDP, LDP, cur.dout + kv_col, LD);
    warp_gemm<T, GKV.tm / 16, GKV.tn / 8, BM, true, true, M>(dk, sdS + kv_row * LDP, LDP, cur.q + kv_col, LD);
    if (p.dkdv_stages == 1) {
      __syncthreads();  // the single buffer is free once dK's product is done
      if (it + 1 < n_iter) load_stage(it + 1);
      cp_async_commit();
    }

    if (p.dq_accum != nullptr) {
      // dS is dS^T read column-major; rows past the sequence land in workspace padding.
      float dq[GQ.tm / 16][GQ.tn / 8][4];
      zero(dq);
      warp_gemm<T, GQ.tm / 16, GQ.tn / 8, BN, false, true, M>(dq, sdS + q_row, LDP, sK + q_col, LD);
      float* g = p.dq_accum + (ws_row(p, b, h) + q0 + q_row) * p.dq_accum_dim + q_col;
#pragma unroll
      for (int i = 0; i < GQ.tm / 16; ++i)
#pragma unroll
        for (int j = 0; j < GQ.tn / 8; ++j)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int r = i * 16 + (lane >> 2) + hh * 8, c = j * 8 + (lane & 3) * 2;
            atomic_add2(g + int64_t(r) * p.dq_accum_dim + c, dq[i][j][2 * hh], dq[i][j][2 * hh + 1]);
          }
    }
  }

  cp_async_wait<0>();  // no copy may outlive the block (tiles loaded for an empty loop)
  T* gdK = static_cast<T*>(p.dk.ptr) + seq_base(p, p.dk, b, false) + int64_t(hk) * p.dk.head +
           int64_t(k0 + kv_row) * p.dk.seq + kv_col;
  T* gdV = static_cast<T*>(p.dv.ptr) + seq_base(p, p.dv, b, false) + int64_t(hk) * p.dv.head +
           int64_t(k0 + kv_row) * p.dv.seq + kv_col;
  store_frag<T>(dk, p.scale, gdK, p.dk.seq, k1 - k0 - kv_row, p.headdim_qk - kv_col);
  store_frag<T>(dv, 1.0f, gdV, p.dv.seq, k1 - k0 - kv_row, p.headdim_v - kv_col);
}

}  // namespace tileattn::cuda::bwd
