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

// A (batch, rows, heads, dim) tensor, strides in elements.
template <class P>
struct Rows {
  P data;
  int64_t batch_stride, row_stride, head_stride;
  TA_HOST_DEVICE P at(int64_t b, int64_t r, int64_t h) const {
    return data + b * batch_stride + r * row_stride + h * head_stride;
  }
};

template <class T>
struct AppendParams {
  KeyLayout keys;
  Rows<const T*> k_new, v_new, q;
  T* k;
  T* v;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  Rows<T*> q_rot;  // data null: no rotary
  const T* cos;
  const T* sin;
  int rotary_dim, rotary_rows;
  bool interleaved, per_query;
  int seqlen_new, seqlen_q, heads_kv, heads_q, dqk, dv;
  int64_t k_elements, v_elements, q_elements;  // the three parts of the index space, in order
};

template <class T>
__device__ float rotated(const T* row, int j, int position, const AppendParams<T>& p) {
  const RotaryLane lane = rotary_lane(j, p.rotary_dim, p.interleaved);
  const int64_t angle = int64_t(clamp_to(position, 0, p.rotary_rows - 1)) * (p.rotary_dim / 2) + lane.freq;
  return rotate(to_float(row[j]), to_float(row[lane.partner]), to_float(p.cos[angle]), to_float(p.sin[angle]),
                lane.first);
}

template <class T>
__global__ void kv_append_kernel(const AppendParams<T> p) {
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
      const T* src = (is_k ? p.k_new : p.v_new).at(b, i, h);
      const int64_t row = key_offset(p.keys, span.keys, span.first + i, is_k ? p.k_batch_stride : p.v_batch_stride,
                                     is_k ? p.k_row_stride : p.v_row_stride);
      T* dst = is_k ? p.k + row + h * p.k_head_stride : p.v + row + h * p.v_head_stride;
      const bool rotate_it = is_k && p.q_rot.data != nullptr && j < p.rotary_dim;
      dst[j] = rotate_it ? from_float<T>(rotated(src, j, span.position + i, p)) : src[j];
    } else {
      const int64_t x = e - p.k_elements - p.v_elements;
      const int j = int(x % p.dqk), h = int(x / p.dqk % p.heads_q), i = int(x / p.dqk / p.heads_q % p.seqlen_q);
      const int b = int(x / p.dqk / p.heads_q / p.seqlen_q);
      const T* src = p.q.at(b, i, h);
      const AppendSpan span = append_span(p.keys, b, p.seqlen_new);
      p.q_rot.at(b, i, h)[j] =
          j < p.rotary_dim ? from_float<T>(rotated(src, j, query_position(span, i, p.per_query), p)) : src[j];
    }
  }
}

template <class T>
void launch(const AttentionProblem& pr, void* rotated_q, cudaStream_t stream) {
  AppendParams<T> p{};
  p.keys = key_layout(pr);
  auto rows = [](const TensorView& t) {
    return Rows<const T*>{static_cast<const T*>(t.data), t.batch_stride, t.seq_stride, t.head_stride};
  };
  p.k_new = rows(pr.k_new), p.v_new = rows(pr.v_new), p.q = rows(pr.q);
  p.k = static_cast<T*>(pr.k.data), p.v = static_cast<T*>(pr.v.data);
  p.k_batch_stride = pr.k.batch_stride, p.k_row_stride = pr.k.seq_stride, p.k_head_stride = pr.k.head_stride;
  p.v_batch_stride = pr.v.batch_stride, p.v_row_stride = pr.v.seq_stride, p.v_head_stride = pr.v.head_stride;
  p.seqlen_new = int(pr.seqlen_new), p.seqlen_q = int(pr.seqlen_q);
  p.heads_kv = int(pr.heads_kv), p.heads_q = int(pr.heads_q);
  p.dqk = int(pr.headdim_qk), p.dv = int(pr.headdim_v);
  p.k_elements = pr.batch * pr.seqlen_new * pr.heads_kv * pr.headdim_qk;
  p.v_elements = pr.batch * pr.seqlen_new * pr.heads_kv * pr.headdim_v;
  if (pr.has_rotary()) {
    const TensorView r = rotated_q_view(pr, rotated_q);
    p.q_rot = {static_cast<T*>(r.data), r.batch_stride, r.seq_stride, r.head_stride};
    p.cos = static_cast<const T*>(pr.rotary_cos), p.sin = static_cast<const T*>(pr.rotary_sin);
    p.rotary_dim = int(pr.rotary_dim), p.rotary_rows = int(std::min<int64_t>(pr.rotary_seqlen, INT32_MAX));
    p.interleaved = pr.rotary_interleaved, p.per_query = pr.rotary_per_query.value_or(false);
    p.q_elements = rotated_q_elements(pr);
  }
  const int64_t total = p.k_elements + p.v_elements + p.q_elements;
  if (total == 0) return;
  constexpr int kThreads = 256;
  const unsigned blocks = unsigned(std::min<int64_t>((total + kThreads - 1) / kThreads, 65535));
  kv_append_kernel<T><<<blocks, kThreads, 0, stream>>>(p);
  TA_CUDA_CHECK_LAUNCH("kv_append_kernel");
}

}  // namespace

void launch_kv_append(const AttentionProblem& p, void* rotated_q, cudaStream_t stream) {
  if (p.dtype == DType::f32) launch<float>(p, rotated_q, stream);
  else if (p.dtype == DType::f16) launch<__half>(p, rotated_q, stream);
  else launch<__nv_bfloat16>(p, rotated_q, stream);
}

}  // namespace tileattn::cuda
