#pragma once
// The two light kernels around the main backward pass:
//  - preprocess: D = rowsum(O * dO) (16-bit, and fp32 with given_stats or delta_from_out; otherwise
//    fp32's D comes from bwd_row_stats.cuh) and L * log2(e) (fp32: L) per query row, into the workspace,
//    and the row's fp32 dQ accumulator (when dQ is summed by atomics) and, where its additions
//    land in a fixed order, their counts zeroed;
//  - convert: the fp32 dQ accumulator, scaled, into dQ in the problem's dtype and strides.
// One warp per query row, or for 16-bit O and dO that take 16-byte loads (vec_io) a few lanes per
// row (launch_preprocess); rows past a sequence's end are workspace padding. Both kernels move
// only memory: they are bound by how many bytes each warp has in flight, and a warp per row of 64
// elements read 2-byte loads at a third of the card's bandwidth (docs/perf-log.md).
#include <math.h>

#include <type_traits>

#include "common/online_softmax.hpp"
#include "common/score_mod.hpp"
#include "cuda/arch/warp_mma_sm80.cuh"
#include "cuda/backward/bwd_launch.hpp"
#include "cuda/common/bwd_params.hpp"

namespace tileattn::cuda::bwd {

constexpr int kRowKernelThreads = 256;

// Rows of the workspace: (batch, heads_q, seqlen_q_rounded).
__device__ __forceinline__ bool row_of_warp(const BwdParams& p, int& b, int& h, int& i) {
  const int64_t row = int64_t(blockIdx.x) * (kRowKernelThreads / 32) + threadIdx.x / 32;
  if (row >= int64_t(p.batch) * p.heads_q * p.seqlen_q_rounded) return false;
  i = int(row % p.seqlen_q_rounded);
  const int64_t bh = row / p.seqlen_q_rounded;
  h = int(bh % p.heads_q);
  b = int(bh / p.heads_q);
  return true;
}

// The forward's L of row i of (b, h); any value where i >= s.sq.
__device__ __forceinline__ float forward_lse(const BwdParams& p, const SeqInfo& s, int b, int h, int i) {
  return i < s.sq ? p.lse[lse_index(p, s, b, h, i)] : 0.0f;
}

// Row i of (b, h) at workspace row w, whose D is acc and forward L is l (any values where
// i >= s.sq): its L, D and, for fp32, its row sum (or the forward's max and sum, fwd_stats). One
// lane per row.
template <class T>
__device__ __forceinline__ void store_row_stats(const BwdParams& p, const SeqInfo& s, int b, int h, int i, int64_t w,
                                                float acc, float l) {
  if (p.row_sum != nullptr) p.row_sum[w] = 1.0f;
  if (i >= s.sq) {
    p.lse2[w] = INFINITY;
    p.dsum[w] = 0.0f;
    return;
  }
  // ALiBi's causal form: L carries slope * (i + sk - sq) beyond the LSE of the scores that
  // P is recomputed from (ScoreMod::lse_offset); it comes off here, once per row.
  if (p.mod.alibi_lse_offset && l != -INFINITY) l -= p.mod.lse_offset(p.mod.slope(b, h), i, s.sq, s.sk);
  // fp32 forms P = exp(s - lse2) / row_sum in the natural domain: lse2 is L itself there (the
  // row-statistics kernel replaces it by the row max unless given_stats).
  p.lse2[w] = l == -INFINITY ? INFINITY : std::is_same_v<T, float> ? l : l * kLog2e;
  p.dsum[w] = acc - lse_grad(p, s, b, h, i);
  if constexpr (std::is_same_v<T, float>)
    if (p.fwd_stats != nullptr) {
      // The forward's max and sum, where it wrote them (NaN otherwise: max_sum forms them).
      const float* given = p.fwd_stats + 2 * lse_index(p, s, b, h, i);
      const float m = given[0], sum = given[1];
      if (!isnan(sum) && m != -INFINITY) p.lse2[w] = m, p.row_sum[w] = sum;  // -inf: no key, as L says
    }
}

// Any dtype and layout: one warp per workspace row.
template <class T>
__global__ void __launch_bounds__(kRowKernelThreads) preprocess_kernel(const BwdParams p) {
  int b, h, i;
  if (!row_of_warp(p, b, h, i)) return;
  const int lane = threadIdx.x & 31;
  const SeqInfo s = seq_info(p, b);
  const int64_t w = ws_row(p, b, h) + i;
  // The dQ accumulator's rows (padding included) start at zero here, not in a memset of their own:
  // one stream operation less per call, a few microseconds of a short call's host time.
  if (p.dq_accum != nullptr) {
    float4* a = reinterpret_cast<float4*>(p.dq_accum + w * p.dq_accum_dim);
    for (int c = lane; c < p.dq_accum_dim / 4; c += 32) a[c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  if (p.dq_order != nullptr && lane == 0 && w % 64 == 0) p.dq_order[w / 64] = 0;
  float acc = 0.0f;
  if (i < s.sq) {
    const T* o = query_row<const T>(p, p.o, b, h, i);
    const T* d = query_row<const T>(p, p.dout, b, h, i);
    // fp32 forms D = rowsum(P dP) / rowsum(P) in the row-statistics kernel instead, from the
    // gradient passes' own P and dP (bwd_row_stats.cuh says why); 0 here until it does. With
    // given_stats (partial_keys: the call's P and dP are only part of the row; the fast mode) D is
    // the given O's, here: summed in double and rounded once, as the exact products it cancels
    // against are; so with delta_from_out, for the rows whose statistics pass leaves D alone.
    if constexpr (!std::is_same_v<T, float>) {
      for (int c = lane; c < p.headdim_v; c += 32) acc = fmaf(to_float(o[c]), to_float(d[c]), acc);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    } else if (p.given_stats || p.delta_from_out) {
      double wide = 0.0;
      for (int c = lane; c < p.headdim_v; c += 32) wide = fma(double(o[c]), double(d[c]), wide);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) wide += __shfl_xor_sync(0xffffffffu, wide, off);
      acc = float(wide);
    }
  }
  if (lane == 0) store_row_stats<T>(p, s, b, h, i, w, acc, forward_lse(p, s, b, h, i));
}

// 16-bit O and dO with 16-byte rows (vec_io): kRowLanes lanes a row, each with at most one 16-byte
// load of O and of dO a row (the launch picks the lanes so that one load spans the row), and up
// to four rows a thread, all their loads issued before the first sum: the kernel only moves
// memory, and with one row's two loads in flight per thread it drew 62% of the card's DRAM
// bandwidth, with four rows' 73% (D = 128; docs/perf-log.md). A block's rows lie in one
// (batch, head), and its accumulator rows are one run to zero.
template <int kRowLanes>
struct VecRows {
  static constexpr int kPass = kRowKernelThreads / kRowLanes;  // rows the block covers per row of a thread
  static constexpr int kPerThread = kPass * 4 <= kWorkspaceRowTile ? 4 : kWorkspaceRowTile / kPass;
  static constexpr int kBlock = kPass * kPerThread;
  static_assert(kWorkspaceRowTile % kBlock == 0, "a block's rows never straddle two heads");
};

template <class T, int kRowLanes>
__global__ void __launch_bounds__(kRowKernelThreads) preprocess_vec_kernel(const BwdParams p) {
  static_assert(!std::is_same_v<T, float> && 32 % kRowLanes == 0, "16-bit rows, whole groups a warp");
  using Rows = VecRows<kRowLanes>;
  constexpr int kR = Rows::kPerThread;
  const int64_t first = int64_t(blockIdx.x) * Rows::kBlock;  // the grid covers the rows exactly
  const int64_t bh = first / p.seqlen_q_rounded;
  const int h = int(bh % p.heads_q), b = int(bh / p.heads_q);
  const int i0 = int(first % p.seqlen_q_rounded) + int(threadIdx.x) / kRowLanes;
  const int sub = int(threadIdx.x) % kRowLanes, c = 8 * sub;
  const SeqInfo s = seq_info(p, b);
  const T* o = query_row<const T>(p, p.o, b, h, 0) + c;
  const T* d = query_row<const T>(p, p.dout, b, h, 0) + c;
  uint4 ov[kR], dv[kR];
  float lse[kR];
#pragma unroll
  for (int r = 0; r < kR; ++r) {
    ov[r] = dv[r] = make_uint4(0u, 0u, 0u, 0u);  // unpacks to +0 in either 16-bit type
    const int i = i0 + r * Rows::kPass;
    lse[r] = sub == 0 ? forward_lse(p, s, b, h, i) : 0.0f;
    if (i >= s.sq || c >= p.headdim_v) continue;
    ov[r] = __ldg(reinterpret_cast<const uint4*>(o + int64_t(i) * p.o.seq));
    dv[r] = __ldg(reinterpret_cast<const uint4*>(d + int64_t(i) * p.dout.seq));
  }
  if (p.dq_accum != nullptr) {
    float4* a = reinterpret_cast<float4*>(p.dq_accum + first * p.dq_accum_dim);
    for (int x = threadIdx.x; x < Rows::kBlock * p.dq_accum_dim / 4; x += kRowKernelThreads)
      a[x] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
#pragma unroll
  for (int r = 0; r < kR; ++r) {
    const uint32_t ow[4] = {ov[r].x, ov[r].y, ov[r].z, ov[r].w}, dw[4] = {dv[r].x, dv[r].y, dv[r].z, dv[r].w};
    float acc = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 x = unpack2<T>(ow[k]), y = unpack2<T>(dw[k]);
      acc = fmaf(x.x, y.x, acc);
      acc = fmaf(x.y, y.y, acc);
    }
#pragma unroll
    for (int off = kRowLanes / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    const int i = i0 + r * Rows::kPass;
    if (sub == 0) store_row_stats<T>(p, s, b, h, i, first + (i - i0) + int(threadIdx.x) / kRowLanes, acc, lse[r]);
  }
  // A count per 64 rows (blocks of 32 rows: the one that starts them).
  if (p.dq_order != nullptr && int(threadIdx.x) * 64 < Rows::kBlock && first % 64 == 0)
    p.dq_order[first / 64 + threadIdx.x] = 0;
}

// The preprocess for every backward: the lanes-per-row kernel where it applies, else a warp a row.
template <class T>
void launch_preprocess(const BwdParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.batch) * p.heads_q * p.seqlen_q_rounded;
  auto launch = [&](auto kernel, int rows_per_block) {
    kernel<<<unsigned((rows + rows_per_block - 1) / rows_per_block), kRowKernelThreads, 0, stream>>>(p);
  };
  if constexpr (!std::is_same_v<T, float>) {
    if (p.vec_io) {
      // Lanes enough for the row in one load each (head dims are multiples of 8 here), 4 at least.
      if (p.headdim_v <= 32) launch(preprocess_vec_kernel<T, 4>, VecRows<4>::kBlock);
      else if (p.headdim_v <= 64) launch(preprocess_vec_kernel<T, 8>, VecRows<8>::kBlock);
      else if (p.headdim_v <= 128) launch(preprocess_vec_kernel<T, 16>, VecRows<16>::kBlock);
      else launch(preprocess_vec_kernel<T, 32>, VecRows<32>::kBlock);
      return;
    }
  }
  launch(preprocess_kernel<T>, kRowKernelThreads / 32);
}

template <class T>
__global__ void __launch_bounds__(kRowKernelThreads) convert_dq_kernel(const BwdParams p) {
  int b, h, i;
  if (!row_of_warp(p, b, h, i)) return;
  const SeqInfo s = seq_info(p, b);
  if (i >= s.sq) return;
  const float* a = p.dq_accum + (ws_row(p, b, h) + i) * p.dq_accum_dim;
  T* dq = query_row<T>(p, p.dq, b, h, i);
  for (int c = threadIdx.x & 31; c < p.headdim_qk; c += 32) dq[c] = from_float<T>(a[c] * p.scale);
}

// dQ = scale * the accumulator, a warp a row.
template <class T>
void launch_convert_dq(const BwdParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.batch) * p.heads_q * p.seqlen_q_rounded;
  constexpr int kRowsPerBlock = kRowKernelThreads / 32;
  convert_dq_kernel<T><<<unsigned((rows + kRowsPerBlock - 1) / kRowsPerBlock), kRowKernelThreads, 0, stream>>>(p);
}

}  // namespace tileattn::cuda::bwd
