// One thread per element written: a cache row's element (key or value) or an element of q's
// rotated copy. The rows are few (seqlen_new and seqlen_q are a decode step's), so the kernel
// is a flat index space, not a tiled one; the attention kernels after it dominate the call.
#include "cuda/forward/kv_append.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "common/key_rows.hpp"
#include "common/kv_append.hpp"
#include "cuda/arch/ptx_sm80.cuh"
#include "cuda/common/check.cuh"

namespace tileattn::cuda {
namespace {

// q's rotated copy; the other tensors' views come from KvAppendArgs.
template <class T>
struct RotatedRows {
  T* data;
  int64_t batch_stride, row_stride, head_stride;
};

template <class T>
__device__ const T* row_at(const AppendRows& t, int64_t b, int64_t r, int64_t h) {
  return static_cast<const T*>(t.data) + b * t.batch_stride + r * t.row_stride + h * t.head_stride;
}

template <class T>
__device__ float rotated(const T* row, int j, int position, const KvAppendArgs& p) {
  const RotaryLane lane = rotary_lane(j, p.rotary_dim, p.interleaved);
  const int64_t angle = int64_t(clamp_to(position, 0, p.rotary_rows - 1)) * (p.rotary_dim / 2) + lane.freq;
  return rotate(to_float(row[j]), to_float(row[lane.partner]), to_float(static_cast<const T*>(p.cos)[angle]),
                to_float(static_cast<const T*>(p.sin)[angle]), lane.first);
}

template <class T>
__global__ void kv_append_kernel(const KvAppendArgs p, const RotatedRows<T> q_rot) {
  const int64_t total = p.k_elements + p.v_elements + p.q_elements;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    if (e < p.k_elements + p.v_elements) {
      const bool is_k = e < p.k_elements;
      const int dim = is_k ? p.dqk : p.dv;
      const int64_t x = is_k ? e : e - p.k_elements;
      const int j = int(x % dim), h = int(x / dim % p.heads_kv), i = int(x / dim / p.heads_kv % p.seqlen_new);
      const int b = int(x / dim / p.heads_kv / p.seqlen_new);
      const AppendSpan span = append_span(p.keys, b, p.seqlen_new);
      if (i >= span.count) continue;
      const T* src = row_at<T>(is_k ? p.k_new : p.v_new, b, i, h);
      const int64_t row = key_offset(p.keys, span.keys, span.first + i, is_k ? p.k_batch_stride : p.v_batch_stride,
                                     is_k ? p.k_row_stride : p.v_row_stride);
      T* dst = is_k ? static_cast<T*>(p.k) + row + h * p.k_head_stride : static_cast<T*>(p.v) + row + h * p.v_head_stride;
      const bool rotate_it = is_k && p.rotary && j < p.rotary_dim;
      dst[j] = rotate_it ? from_float<T>(rotated(src, j, span.position + i, p)) : src[j];
    } else {
      const int64_t x = e - p.k_elements - p.v_elements;
      const int j = int(x % p.dqk), h = int(x / p.dqk % p.heads_q), i = int(x / p.dqk / p.heads_q % p.seqlen_q);
      const int b = int(x / p.dqk / p.heads_q / p.seqlen_q);
      const T* src = row_at<T>(p.q, b, i, h);
      const AppendSpan span = append_span(p.keys, b, p.seqlen_new);
      q_rot.data[b * q_rot.batch_stride + i * q_rot.row_stride + h * q_rot.head_stride + j] =
          j < p.rotary_dim ? from_float<T>(rotated(src, j, query_position(span, i, p.per_query), p)) : src[j];
    }
  }
}

template <class T>
void launch(const KvAppendArgs& p, void* rotated_q, cudaStream_t stream) {
  const int64_t total = p.k_elements + p.v_elements + p.q_elements;
  if (total == 0) return;
  const RotatedRows<T> q_rot{static_cast<T*>(rotated_q), p.q_rot.batch_stride, p.q_rot.row_stride,
                             p.q_rot.head_stride};
  constexpr int kThreads = 256;
  const unsigned blocks = unsigned(std::min<int64_t>((total + kThreads - 1) / kThreads, 65535));
  kv_append_kernel<T><<<blocks, kThreads, 0, stream>>>(p, q_rot);
  TA_CUDA_CHECK_LAUNCH("kv_append_kernel");
}

}  // namespace

KvAppendArgs kv_append_args(const AttentionProblem& pr) {
  KvAppendArgs p{};
  p.active = pr.appends() || pr.has_rotary();
  if (!p.active) return p;
  p.dtype = pr.dtype;
  p.keys = key_layout(pr);
  auto rows = [](const TensorView& t) { return AppendRows{t.data, t.batch_stride, t.seq_stride, t.head_stride}; };
  p.k_new = rows(pr.k_new), p.v_new = rows(pr.v_new), p.q = rows(pr.q);
  p.k = pr.k.data, p.v = pr.v.data;
  p.k_batch_stride = pr.k.batch_stride, p.k_row_stride = pr.k.seq_stride, p.k_head_stride = pr.k.head_stride;
  p.v_batch_stride = pr.v.batch_stride, p.v_row_stride = pr.v.seq_stride, p.v_head_stride = pr.v.head_stride;
  p.seqlen_new = int(pr.seqlen_new), p.seqlen_q = int(pr.seqlen_q);
  p.heads_kv = int(pr.heads_kv), p.heads_q = int(pr.heads_q);
  p.dqk = int(pr.headdim_qk), p.dv = int(pr.headdim_v);
  p.k_elements = pr.batch * pr.seqlen_new * pr.heads_kv * pr.headdim_qk;
  p.v_elements = pr.batch * pr.seqlen_new * pr.heads_kv * pr.headdim_v;
  p.rotary = pr.has_rotary();
  if (p.rotary) {
    p.cos = pr.rotary_cos, p.sin = pr.rotary_sin;
    p.rotary_dim = int(pr.rotary_dim), p.rotary_rows = int(std::min<int64_t>(pr.rotary_seqlen, INT32_MAX));
    p.interleaved = pr.rotary_interleaved, p.per_query = pr.rotary_per_query.value_or(false);
    p.q_elements = rotated_q_elements(pr);
    p.q_rot = rows(rotated_q_view(pr, nullptr));
  }
  return p;
}

void launch_kv_append(const KvAppendArgs& p, void* rotated_q, cudaStream_t stream) {
  if (!p.active) return;
  if (p.dtype == DType::f32) launch<float>(p, rotated_q, stream);
  else if (p.dtype == DType::f16) launch<__half>(p, rotated_q, stream);
  else launch<__nv_bfloat16>(p, rotated_q, stream);
}

}  // namespace tileattn::cuda
