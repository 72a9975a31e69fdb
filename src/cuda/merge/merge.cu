// CUDA merge of partial attention results: one warp per (batch, row, head), its lanes striding
// over headdim. A memory-bound elementwise pass; the weights come from the same function as the
// CPU path's (src/common/merge_weights.hpp).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/merge_weights.hpp"
#include "cuda/common/check.cuh"
#include "cuda/merge/merge.hpp"

namespace tileattn::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerBlock = kThreads / 32;

__device__ __forceinline__ float load(const float* p) { return *p; }
__device__ __forceinline__ float load(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ float load(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void store(float* p, float x) { *p = x; }
__device__ __forceinline__ void store(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void store(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }

template <class TA, class TB>
__global__ void __launch_bounds__(kThreads) merge_kernel(const MergeProblem p) {
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= p.batch * p.seqlen * p.heads) return;
  const int64_t h = row % p.heads, bi = row / p.heads, i = bi % p.seqlen, b = bi / p.seqlen;
  float* lse = p.lse + b * p.lse_batch_stride + h * p.lse_head_stride + i;
  const MergeWeights w = merge_weights(*lse, p.lse_b[b * p.lse_b_batch_stride + h * p.lse_b_head_stride + i]);
  TA* oa = static_cast<TA*>(p.out.data) + b * p.out.batch_stride + i * p.out.seq_stride + h * p.out.head_stride;
  const TB* ob =
      static_cast<const TB*>(p.out_b.data) + b * p.out_b.batch_stride + i * p.out_b.seq_stride + h * p.out_b.head_stride;
  for (int64_t d = lane; d < p.headdim; d += 32) {
    // A zero weight selects 0 rather than multiplying: the side's O may be anything there.
    const float xa = w.a > 0.0f ? w.a * load(oa + d) : 0.0f;
    const float xb = w.b > 0.0f ? w.b * load(ob + d) : 0.0f;
    store(oa + d, xa + xb);
  }
  // Every lane has read L before lane 0 overwrites it.
  __syncwarp();
  if (lane == 0) *lse = w.lse;
}

template <class TA, class TB>
void launch(const MergeProblem& p) {
  const int64_t rows = p.batch * p.seqlen * p.heads;
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  if (blocks > int64_t(0x7fffffff))
    throw Error(ErrorKind::unsupported, "merge_attention: batch * seqlen * heads=" + std::to_string(rows) +
                                            " needs more than 2^31 - 1 blocks of " + std::to_string(kRowsPerBlock) +
                                            " rows");
  merge_kernel<TA, TB><<<unsigned(blocks), kThreads, 0, static_cast<cudaStream_t>(p.stream)>>>(p);
  TA_CUDA_CHECK_LAUNCH("merge_attention");
}

}  // namespace

void merge_attention(const MergeProblem& p) {
  // Validation allows f32 accumulators over any dtype and 16-bit ones over their own dtype only.
  switch (p.out_dtype) {
    case DType::f32:
      if (p.out_b_dtype == DType::f32) return launch<float, float>(p);
      if (p.out_b_dtype == DType::f16) return launch<float, __half>(p);
      return launch<float, __nv_bfloat16>(p);
    case DType::f16: return launch<__half, __half>(p);
    case DType::bf16: return launch<__nv_bfloat16, __nv_bfloat16>(p);
  }
}

}  // namespace tileattn::cuda
