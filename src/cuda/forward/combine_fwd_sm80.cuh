#pragma once
// Split-KV combine: for each row, the splits' partial results (O_s normalised by their own sums,
// L_s their log-sum-exps) merge into L = log(sum_s exp(L_s)) and O = sum_s exp(L_s - L) * O_s.
// Splits that saw no key have L_s = -inf and weigh 0; a row no split saw gets O = 0, L = -inf.
#include <cuda_runtime.h>
#include <math.h>

#include <cstdint>

#include "common/varlen.hpp"
#include "cuda/common/check.cuh"
#include "cuda/arch/ptx_sm80.cuh"
#include "cuda/common/fwd_params.hpp"

namespace tileattn::cuda {

constexpr int kCombineWarps = 4;  // one warp per row

template <class T>
__global__ void __launch_bounds__(32 * kCombineWarps) fwd_combine_kernel(const __grid_constant__ FwdParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t r = int64_t(blockIdx.x) * kCombineWarps + threadIdx.x / 32;  // over batch x heads x seqlen_q
  const int64_t rows = int64_t(p.batch) * p.heads_q * p.seqlen_q;
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

  float lse_max = -INFINITY;
  for (int s = lane; s < p.num_splits; s += 32) lse_max = fmaxf(lse_max, p.lse_partial[s * rows + r]);
  for (int off = 16; off > 0; off /= 2) lse_max = fmaxf(lse_max, __shfl_xor_sync(0xffffffffu, lse_max, off));
  float lse = -INFINITY;
  if (lse_max != -INFINITY) {
    float sum = 0.0f;
    for (int s = lane; s < p.num_splits; s += 32) sum += expf(p.lse_partial[s * rows + r] - lse_max);
    for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    lse = lse_max + logf(sum);
  }

  T* out = static_cast<T*>(p.o) + (p.cu_seqlens_q ? 0 : batch * p.o_batch_stride) + (q_row0 + row) * p.o_row_stride +
           head * p.o_head_stride;
  for (int d = lane; d < p.headdim_v; d += 32) {
    float acc = 0.0f;
    if (lse != -INFINITY)
      for (int s = 0; s < p.num_splits; ++s) {
        const float w = expf(p.lse_partial[s * rows + r] - lse);
        if (w > 0.0f) acc += w * p.o_partial[(s * rows + r) * p.headdim_v + d];
      }
    out[d] = from_float<T>(acc);
  }
  if (lane == 0) {
    const int64_t l = p.cu_seqlens_q ? int64_t(head) * p.total_q + q_row0 + row
                                     : (int64_t(batch) * p.heads_q + head) * p.seqlen_q + row;
    p.lse[l] = lse;
  }
}

// The combine after a split run (nothing to do without splits).
template <class T>
void launch_fwd_combine(const FwdParams& p, cudaStream_t stream) {
  if (p.num_splits <= 1) return;
  const int64_t rows = int64_t(p.batch) * p.heads_q * p.seqlen_q;
  const int64_t blocks = (rows + kCombineWarps - 1) / kCombineWarps;
  fwd_combine_kernel<T><<<unsigned(blocks), 32 * kCombineWarps, 0, stream>>>(p);
  TA_CUDA_CHECK_LAUNCH("fwd_combine_kernel");
}

}  // namespace tileattn::cuda
