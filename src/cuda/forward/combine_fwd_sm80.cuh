#pragma once
// Split-KV combine: for each row, the splits' partial results (O_s normalised by their own sums,
// L_s their log-sum-exps) merge into L = log(sum_s exp(L_s)) and O = sum_s exp(L_s - L) * O_s.
// Splits that saw no key have L_s = -inf and weigh 0; a row no split saw gets O = 0, L = -inf.
#include <cuda_runtime.h>
#include <math.h>

#include <cstdint>

#include "common/varlen.hpp"
#include "cuda/arch/dependent_launch.cuh"
#include "cuda/arch/ptx_sm80.cuh"
#include "cuda/common/check.cuh"
#include "cuda/common/fwd_params.hpp"
#include "cuda/common/split_heuristic.hpp"

namespace tileattn::cuda {

constexpr int kCombineWarps = 4;  // one warp per row

// Each warp first turns its row's L_s into weights w_s = exp(L_s - L) in shared memory, then sums
// w_s O_s over the splits with each lane on 4 columns, the splits' loads independent of each other:
// a row's reads are a few hundred bytes per split, so latency, not bandwidth, is the cost.
template <class T>
__global__ void __launch_bounds__(32 * kCombineWarps) fwd_combine_kernel(const __grid_constant__ FwdParams p) {
  __shared__ float weights[kCombineWarps][kMaxRequestedSplits];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t r = int64_t(blockIdx.x) * kCombineWarps + warp;  // over batch x heads x seqlen_q
  const int64_t rows = int64_t(p.batch) * p.heads_q * p.seqlen_q;
  wait_for_primary_grid();
  if (r >= rows) return;
  const int row = int(r % p.seqlen_q);
  const int head = int((r / p.seqlen_q) % p.heads_q);
  const int batch = int(r / (int64_t(p.seqlen_q) * p.heads_q));
  int64_t q_row0 = 0;
  if (p.cu_seqlens_q) {
    const SeqRange q = varlen_range(p.cu_seqlens_q, batch, p.total_q, p.seqlen_q);
    q_row0 = q.begin;
    if (row >= q.len) return;
  }
  const int splits = p.num_splits;

  float lse_max = -INFINITY;
  for (int s = lane; s < splits; s += 32) lse_max = fmaxf(lse_max, p.lse_partial[s * rows + r]);
  for (int off = 16; off > 0; off /= 2) lse_max = fmaxf(lse_max, __shfl_xor_sync(0xffffffffu, lse_max, off));
  float lse = -INFINITY;
  if (lse_max != -INFINITY) {
    float sum = 0.0f;
    for (int s = lane; s < splits; s += 32) sum += expf(p.lse_partial[s * rows + r] - lse_max);
    for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    lse = lse_max + logf(sum);
  }
  // A split that saw no key (L_s = -inf), or every split of a row no key reaches, weighs 0.
  float* w = weights[warp];
  for (int s = lane; s < splits; s += 32) w[s] = lse == -INFINITY ? 0.0f : expf(p.lse_partial[s * rows + r] - lse);
  __syncwarp();

  T* out = static_cast<T*>(p.o) + (p.cu_seqlens_q ? 0 : batch * p.o_batch_stride) + (q_row0 + row) * p.o_row_stride +
           head * p.o_head_stride;
  const float* partial = p.o_partial + r * p.headdim_v;
  const int64_t split_stride = rows * p.headdim_v;
  // w_s * O_s only where w_s > 0: a partial of weight 0 is never trusted to be finite.
  if (p.headdim_v % 4 == 0) {  // the partials' rows are then 16-byte aligned (the workspace is)
    for (int d = 4 * lane; d < p.headdim_v; d += 128) {
      float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 8
      for (int s = 0; s < splits; ++s) {
        const float ws = w[s];
        const float4 x = *reinterpret_cast<const float4*>(partial + s * split_stride + d);
        if (ws > 0.0f) acc.x += ws * x.x, acc.y += ws * x.y, acc.z += ws * x.z, acc.w += ws * x.w;
      }
      out[d] = from_float<T>(acc.x), out[d + 1] = from_float<T>(acc.y);
      out[d + 2] = from_float<T>(acc.z), out[d + 3] = from_float<T>(acc.w);
    }
  } else {
    for (int d = lane; d < p.headdim_v; d += 32) {
      float acc = 0.0f;
#pragma unroll 8
      for (int s = 0; s < splits; ++s) {
        const float ws = w[s], x = partial[s * split_stride + d];
        if (ws > 0.0f) acc += ws * x;
      }
      out[d] = from_float<T>(acc);
    }
  }
  if (lane == 0) {
    const int64_t l = p.cu_seqlens_q ? int64_t(head) * p.total_q + q_row0 + row
                                     : (int64_t(batch) * p.heads_q + head) * p.seqlen_q + row;
    p.lse[l] = lse;
  }
}

// The combine after a split run (nothing to do without splits), launched as a dependent of it.
template <class T>
void launch_fwd_combine(const FwdParams& p, cudaStream_t stream) {
  if (p.num_splits <= 1) return;
  const int64_t rows = int64_t(p.batch) * p.heads_q * p.seqlen_q;
  const int64_t blocks = (rows + kCombineWarps - 1) / kCombineWarps;
  launch_dependent("launch of fwd_combine_kernel", fwd_combine_kernel<T>, dim3(unsigned(blocks)),
                   dim3(32 * kCombineWarps), 0, stream, p);
}

}  // namespace tileattn::cuda
