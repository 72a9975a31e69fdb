#pragma once
// dQ in its own pass (the deterministic mode): one block per query tile of one (batch, head),
// looping over the key tiles it can see and summing dQ in registers in a fixed order, so the
// result is bitwise repeatable. It recomputes S and dP, the price of not using atomics.
//
// Per key tile:  dP = dO V^T   S = Q K^T   dS = grads(S, dP) -> shared   dQ += dS K
// The next key tile is fetched into a second buffer while this one computes when shared memory
// holds two (p.dq_stages == 2), else once dQ's product has read the one buffer.
#include <type_traits>

#include "cuda/arch/warp_mma_sm80.cuh"
#include "cuda/backward/bwd_grads.cuh"
#include "cuda/common/bwd_params.hpp"
#include "cuda/backward/bwd_tile_io.cuh"
#include "cuda/backward/bwd_traits.cuh"

namespace tileattn::cuda::bwd {

template <class T, int D, Fp32Math M = Fp32Math::fp64>
__global__ void __launch_bounds__(kThreads, 1) dq_kernel(const BwdParams p) {
  using Tile = DqTile<T, D>;
  constexpr int BM = Tile::kBlockM, BN = Tile::kBlockN, LD = Tile::kLd, LDS = Tile::kLdS;
  constexpr WarpGrid GS = Tile::kGridS, GQ = Tile::kGridQ;

  extern __shared__ __align__(16) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* sdO = sQ + BM * LD;
  T* sdS = sdO + BM * LD;  // [query][key]
  float* sL = reinterpret_cast<float*>(sdS + BM * LDS);
  float* sDsum = sL + BM;
  float* sRowSum = sDsum + BM;  // fp32 only
  T* stages = reinterpret_cast<T*>(sRowSum + BM);
  // K and V of one key tile, in one of p.dq_stages buffers.
  auto stage_k = [&](int it) { return stages + (p.dq_stages == 2 ? (it & 1) : 0) * 2 * BN * LD; };

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
  const T* gdO = static_cast<const T*>(p.dout.ptr) + seq_base(p, p.dout, b, true) + int64_t(h) * p.dout.head +
                 int64_t(q0) * p.dout.seq;
  load_tile<T, BM, D, LD>(sQ, gQ, p.q.seq, q1 - q0, p.headdim_qk, p.vec_io);
  load_tile<T, BM, D, LD>(sdO, gdO, p.dout.seq, q1 - q0, p.headdim_v, p.vec_io);
  load_row_floats<BM>(sL, p.lse2 + ws_row(p, b, h) + q0);
  load_row_floats<BM>(sDsum, p.dsum + ws_row(p, b, h) + q0);
  if constexpr (std::is_same_v<T, float>) load_row_floats<BM>(sRowSum, p.row_sum + ws_row(p, b, h) + q0);

  const T* gK = static_cast<const T*>(p.k.ptr) + seq_base(p, p.k, b, false) + int64_t(hk) * p.k.head;
  const T* gV = static_cast<const T*>(p.v.ptr) + seq_base(p, p.v, b, false) + int64_t(hk) * p.v.head;
  auto load_kv = [&](int it) {
    const int k0 = (t0 + it) * BN;
    T* sk = stage_k(it);
    load_tile<T, BN, D, LD>(sk, gK + int64_t(k0) * p.k.seq, p.k.seq, s.sk - k0, p.headdim_qk, p.vec_io);
    load_tile<T, BN, D, LD>(sk + BN * LD, gV + int64_t(k0) * p.v.seq, p.v.seq, s.sk - k0, p.headdim_v, p.vec_io);
  };
  if (n_tiles > 0) load_kv(0);
  cp_async_commit();  // Q, dO, row statistics and the first key tile

  const int warp = threadIdx.x / 32;
  const int s_row = (warp / GS.wn) * GS.tm, s_col = (warp % GS.wn) * GS.tn;
  const int q_row = (warp / GQ.wn) * GQ.tm, q_col = (warp % GQ.wn) * GQ.tn;
  float dq[GQ.tm / 16][GQ.tn / 8][4];
  zero(dq);

  for (int it = 0; it < n_tiles; ++it) {
    const int k0 = (t0 + it) * BN;
    if (p.dq_stages == 2) {
      __syncthreads();  // the other buffer was last read in iteration it - 1
      if (it + 1 < n_tiles) load_kv(it + 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const T* sK = stage_k(it);
    const T* sV = sK + BN * LD;
    float dp[GS.tm / 16][GS.tn / 8][4];
    zero(dp);
    // S and dP (exact fp32: summed in fp64, rounded once): dS = P (dP - D) cancels, and what P and
    // dP round survives into dS.
    warp_gemm<T, GS.tm / 16, GS.tn / 8, D, true, false, M>(dp, sdO + s_row * LD, LD, sV + s_col * LD, LD);
    float st[GS.tm / 16][GS.tn / 8][4];
    zero(st);
    warp_gemm<T, GS.tm / 16, GS.tn / 8, D, true, false, M>(st, sQ + s_row * LD, LD, sK + s_col * LD, LD);
    const bool masked = !(mask.full_begin_key(q1) <= k0 && mask.full_end_key(q0) >= k0 + BN);
    scores_to_grads<T, false, false>(st, dp, sL, sRowSum, sDsum, s_row, s_col, q0, k0, masked, mask, p, nullptr, sdS,
                                     LDS, b, h);
    __syncthreads();
    warp_gemm<T, GQ.tm / 16, GQ.tn / 8, BN, true, true, M>(dq, sdS + q_row * LDS, LDS, sK + q_col, LD);
    if (p.dq_stages == 1) {
      __syncthreads();  // the single buffer and dS are free once dQ's product is done
      if (it + 1 < n_tiles) load_kv(it + 1);
      cp_async_commit();
    }
  }

  cp_async_wait<0>();  // no copy may outlive the block (tiles loaded for an empty loop)
  T* gdQ = static_cast<T*>(p.dq.ptr) + seq_base(p, p.dq, b, true) + int64_t(h) * p.dq.head +
           int64_t(q0 + q_row) * p.dq.seq + q_col;
  store_frag<T>(dq, p.scale, gdQ, p.dq.seq, q1 - q0 - q_row, p.headdim_qk - q_col);
}

}  // namespace tileattn::cuda::bwd
