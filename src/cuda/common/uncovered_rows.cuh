#pragma once
// Rows of a packed variable-length buffer before cu_seqlens[0] or at or past cu_seqlens[batch]
// belong to no sequence, and no attention kernel visits them; they are defined here: 0 in O, dQ,
// dK and dV, -inf in L (the value of a row that sees no key). Where the batch begins and ends is
// read on the device, so the call never synchronises; blocks wholly inside it return at once.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/common/check.cuh"
#include "tileattn/problem.hpp"

namespace tileattn::cuda {

constexpr int kUncoveredRowsPerBlock = 8;

// `Bits` is an unsigned integer as wide as the element: all-zero bits are +0 in fp16, bf16, fp32.
template <class Bits>
__global__ void define_uncovered_rows_kernel(Bits* data, int64_t row_stride, int64_t head_stride, int heads, int dim,
                                             const int32_t* cu, int batch, int64_t total, float* lse) {
  auto clamp = [total](int64_t x) { return x < 0 ? 0 : (x > total ? total : x); };
  const int64_t begin = clamp(cu[0]), end = clamp(cu[batch]);
  const int64_t row0 = int64_t(blockIdx.x) * kUncoveredRowsPerBlock;
  if (row0 >= begin && row0 + kUncoveredRowsPerBlock <= end) return;
  const int64_t per_row = int64_t(heads) * dim;
  for (int64_t i = threadIdx.x; i < kUncoveredRowsPerBlock * per_row; i += blockDim.x) {
    const int64_t row = row0 + i / per_row;
    if ((row >= begin && row < end) || row >= total) continue;
    const int h = int(i % per_row / dim), d = int(i % dim);
    data[row * row_stride + h * head_stride + d] = Bits(0);
    if (lse != nullptr && d == 0) lse[h * total + row] = -INFINITY;
  }
}

// One packed output: (total, heads, dim) with element strides; lse (heads, total) or nullptr.
struct PackedRows {
  void* data = nullptr;
  int element_bytes = 0;
  int64_t row_stride = 0, head_stride = 0;
  int heads = 0, dim = 0;
  const int32_t* cu = nullptr;  // null: not a variable-length problem, nothing to define
  int batch = 0;
  int64_t total = 0;
  float* lse = nullptr;
};

inline PackedRows packed_rows(const AttentionProblem& p, const TensorView& t, bool k_side, int64_t heads, int64_t dim,
                              float* lse = nullptr) {
  if (!p.is_varlen()) return {};
  return {t.data,     p.dtype == DType::f32 ? 4 : 2, t.seq_stride, t.head_stride, int(heads), int(dim),
          k_side ? p.cu_seqlens_k : p.cu_seqlens_q, int(p.batch), k_side ? p.total_k : p.total_q, lse};
}

inline void define_uncovered_rows(const PackedRows& r, cudaStream_t stream) {
  if (r.cu == nullptr || r.total <= 0) return;
  const unsigned blocks = unsigned((r.total + kUncoveredRowsPerBlock - 1) / kUncoveredRowsPerBlock);
  if (r.element_bytes == 2)
    define_uncovered_rows_kernel<<<blocks, 128, 0, stream>>>(static_cast<uint16_t*>(r.data), r.row_stride,
                                                             r.head_stride, r.heads, r.dim, r.cu, r.batch, r.total,
                                                             r.lse);
  else
    define_uncovered_rows_kernel<<<blocks, 128, 0, stream>>>(static_cast<uint32_t*>(r.data), r.row_stride,
                                                             r.head_stride, r.heads, r.dim, r.cu, r.batch, r.total,
                                                             r.lse);
  TA_CUDA_CHECK_LAUNCH("define_uncovered_rows_kernel");
}

}  // namespace tileattn::cuda
