#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <stdexcept>
#include <string>

#include "cuda/arch/ptx_sm80.cuh"
#include "memory.hpp"
#include "naive_cublas.hpp"

namespace tileattn::bench {
namespace {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorString(status));
}

void check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw std::runtime_error(std::string(what) + " failed: " + cublasGetStatusName(status) + " (" +
                             cublasGetStatusString(status) + ")");
  }
}

constexpr int kThreads = 256;

using cuda::from_float;
using cuda::to_float;

// Block-wide reduction; every thread gets the result. `scratch` holds one float per warp.
template <bool kMax>
__device__ float block_reduce(float v, float* scratch) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(0xffffffffu, v, offset);
    v = kMax ? fmaxf(v, other) : v + other;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < blockDim.x / 32 ? scratch[lane] : (kMax ? -INFINITY : 0.0f);
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(0xffffffffu, v, offset);
    v = kMax ? fmaxf(v, other) : v + other;
  }
  return v;
}

struct RowMask {
  int seqlen_q, seqlen_k;
  long long left, right;  // -1: unbounded
  __device__ bool visible(int i, int j) const {
    const long long diag = (long long)i + seqlen_k - seqlen_q;  // bottom-right aligned
    return (left < 0 || j >= diag - left) && (right < 0 || j <= diag + right);
  }
};

// One block per score row r = (b * heads_q + h) * seqlen_q + i, which is also L's index.
// Forward (kFromLse = false): P = softmax(cap(scale * S)) in place, L written. Backward:
// P = exp(cap(scale * S) - L) in place from the forward's L.
template <class T, bool kFromLse>
__global__ void softmax_rows(T* s, float* lse, RowMask mask, float scale, float softcap) {
  __shared__ float scratch[kThreads / 32];
  const long long r = blockIdx.x;
  const int i = int(r % mask.seqlen_q);
  T* row = s + r * mask.seqlen_k;
  auto score = [&](int j) {
    float x = scale * to_float(row[j]);
    if (softcap > 0.0f) x = softcap * tanhf(x / softcap);
    return x;
  };
  float m, inv_sum;
  if (kFromLse) {
    m = lse[r];
    inv_sum = 1.0f;
  } else {
    float local = -INFINITY;
    for (int j = threadIdx.x; j < mask.seqlen_k; j += blockDim.x) {
      if (mask.visible(i, j)) local = fmaxf(local, score(j));
    }
    m = block_reduce<true>(local, scratch);
    float sum = 0.0f;
    if (m != -INFINITY) {
      for (int j = threadIdx.x; j < mask.seqlen_k; j += blockDim.x) {
        if (mask.visible(i, j)) sum += expf(score(j) - m);
      }
    }
    sum = block_reduce<false>(sum, scratch);
    inv_sum = sum > 0.0f ? 1.0f / sum : 0.0f;
    if (threadIdx.x == 0) lse[r] = sum > 0.0f ? m + logf(sum) : -INFINITY;
  }
  for (int j = threadIdx.x; j < mask.seqlen_k; j += blockDim.x) {
    const float p = (m != -INFINITY && mask.visible(i, j)) ? expf(score(j) - m) * inv_sum : 0.0f;
    row[j] = from_float<T>(p);
  }
}

struct RowTensor {  // a (batch, seqlen, heads, dim) tensor seen row by row
  const void* data;
  long long batch_stride, seq_stride, head_stride;
};

// dS = P * (dP - rowsum(dO * O)), times the soft-cap derivative, written over dP. The capped
// score is recovered as log(P) + L; where P == 0 the gradient is 0 whatever the derivative.
template <class T>
__global__ void softmax_backward_rows(const T* p, T* dp, const float* lse, RowTensor o, RowTensor dout, int heads_q,
                                      int seqlen_q, int seqlen_k, int headdim_v, float softcap) {
  __shared__ float scratch[kThreads / 32];
  const long long r = blockIdx.x;
  const int i = int(r % seqlen_q);
  const long long bh = r / seqlen_q;
  const int h = int(bh % heads_q);
  const long long b = bh / heads_q;
  const T* o_row = static_cast<const T*>(o.data) + b * o.batch_stride + i * o.seq_stride + h * o.head_stride;
  const T* do_row =
      static_cast<const T*>(dout.data) + b * dout.batch_stride + i * dout.seq_stride + h * dout.head_stride;
  float d = 0.0f;
  for (int c = threadIdx.x; c < headdim_v; c += blockDim.x) d += to_float(o_row[c]) * to_float(do_row[c]);
  d = block_reduce<false>(d, scratch);
  const float l = lse[r];
  const T* p_row = p + r * seqlen_k;
  T* dp_row = dp + r * seqlen_k;
  for (int j = threadIdx.x; j < seqlen_k; j += blockDim.x) {
    const float pj = to_float(p_row[j]);
    float ds = pj * (to_float(dp_row[j]) - d);
    if (softcap > 0.0f && pj > 0.0f) {
      const float t = (logf(pj) + l) / softcap;
      ds *= 1.0f - t * t;
    }
    dp_row[j] = from_float<T>(ds);
  }
}

cudaDataType_t cuda_type(DType dtype) {
  switch (dtype) {
    case DType::f32: return CUDA_R_32F;
    case DType::f16: return CUDA_R_16F;
    case DType::bf16: return CUDA_R_16BF;
  }
  throw std::invalid_argument("naive: unknown dtype");
}

size_t dtype_bytes(DType dtype) { return dtype == DType::f32 ? 4 : 2; }

}  // namespace

struct NaiveAttention::State {
  AttentionProblem p;
  cublasHandle_t handle = nullptr;
  cudaDataType_t type;
  cublasComputeType_t compute;
  float scale;
  RowMask mask;
  int group;              // query heads per kv head
  long long score_elems;  // one (batch, head) score matrix: seqlen_q * seqlen_k
  Buffer scores, dscores;

  ~State() {
    if (handle) cublasDestroy(handle);  // unchecked: a destructor cannot report it
  }

  char* at(const void* base, long long elems) const {
    return static_cast<char*>(const_cast<void*>(base)) + elems * (long long)dtype_bytes(p.dtype);
  }

  // C = alpha op(A) op(B) + beta C (column-major), batched over the kv heads of query-head
  // offset j within each group: entry g of the batch is kv head g and query head g * group + j.
  void gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, float alpha, const void* a, long long lda,
            long long stride_a, const void* b, long long ldb, long long stride_b, float beta, void* c, long long ldc,
            long long stride_c) {
    check(cublasGemmStridedBatchedEx(handle, ta, tb, m, n, k, &alpha, a, type, int(lda), stride_a, b, type, int(ldb),
                                     stride_b, &beta, c, type, int(ldc), stride_c, int(p.heads_kv), compute,
                                     CUBLAS_GEMM_DEFAULT),
          "cublasGemmStridedBatchedEx");
  }

  // Score matrix of (batch b, query head j of each group): row-major (seqlen_q, seqlen_k).
  void* score_at(const Buffer& buf, long long b, int j) const {
    return at(buf.data(), (b * p.heads_q + j) * score_elems);
  }
  long long score_stride() const { return group * score_elems; }

  // S = Q K^T for every (batch, head): row-major S is column-major S^T = K Q^T.
  void compute_scores() {
    const int sq = int(p.seqlen_q), sk = int(p.seqlen_k), d = int(p.headdim_qk);
    for (long long b = 0; b < p.batch; ++b) {
      for (int j = 0; j < group; ++j) {
        gemm(CUBLAS_OP_T, CUBLAS_OP_N, sk, sq, d, 1.0f, at(p.k.data, b * p.k.batch_stride), p.k.seq_stride,
             p.k.head_stride, at(p.q.data, b * p.q.batch_stride + j * p.q.head_stride), p.q.seq_stride,
             group * p.q.head_stride, 0.0f, score_at(scores, b, j), sk, score_stride());
      }
    }
  }

  // One block per score row; B * H * Nq stays far below the 2^31 - 1 grid limit for any problem
  // whose score matrices fit in memory.
  dim3 row_grid() const { return dim3(unsigned(p.batch * p.heads_q * p.seqlen_q)); }

  template <bool kFromLse>
  void softmax() {
    const dim3 grid = row_grid();
    switch (p.dtype) {
      case DType::f32:
        softmax_rows<float, kFromLse>
            <<<grid, kThreads>>>(static_cast<float*>(scores.data()), p.lse, mask, scale, p.softcap);
        break;
      case DType::f16:
        softmax_rows<__half, kFromLse>
            <<<grid, kThreads>>>(static_cast<__half*>(scores.data()), p.lse, mask, scale, p.softcap);
        break;
      case DType::bf16:
        softmax_rows<__nv_bfloat16, kFromLse>
            <<<grid, kThreads>>>(static_cast<__nv_bfloat16*>(scores.data()), p.lse, mask, scale, p.softcap);
        break;
    }
    check(cudaGetLastError(), "softmax_rows launch");
  }

  void softmax_backward() {
    const dim3 grid = row_grid();
    const RowTensor o{p.o.data, p.o.batch_stride, p.o.seq_stride, p.o.head_stride};
    const RowTensor dout{p.dout.data, p.dout.batch_stride, p.dout.seq_stride, p.dout.head_stride};
    const int hq = int(p.heads_q), sq = int(p.seqlen_q), sk = int(p.seqlen_k), dv = int(p.headdim_v);
    switch (p.dtype) {
      case DType::f32:
        softmax_backward_rows<float><<<grid, kThreads>>>(static_cast<const float*>(scores.data()),
                                                         static_cast<float*>(dscores.data()), p.lse, o, dout, hq, sq,
                                                         sk, dv, p.softcap);
        break;
      case DType::f16:
        softmax_backward_rows<__half><<<grid, kThreads>>>(static_cast<const __half*>(scores.data()),
                                                          static_cast<__half*>(dscores.data()), p.lse, o, dout, hq, sq,
                                                          sk, dv, p.softcap);
        break;
      case DType::bf16:
        softmax_backward_rows<__nv_bfloat16><<<grid, kThreads>>>(static_cast<const __nv_bfloat16*>(scores.data()),
                                                                 static_cast<__nv_bfloat16*>(dscores.data()), p.lse, o,
                                                                 dout, hq, sq, sk, dv, p.softcap);
        break;
    }
    check(cudaGetLastError(), "softmax_backward_rows launch");
  }

  Buffer& ensure(Buffer& buf) {
    if (buf.data() == nullptr) {
      buf = Buffer(Backend::cuda, size_t(p.batch * p.heads_q * score_elems) * dtype_bytes(p.dtype));
    }
    return buf;
  }
};

std::string NaiveAttention::unsupported_reason(const AttentionProblem& problem) {
  if (problem.is_varlen()) return "variable-length batches";
  return {};
}

NaiveAttention::NaiveAttention(const AttentionProblem& problem) : state_(std::make_unique<State>()) {
  const std::string reason = unsupported_reason(problem);
  if (!reason.empty()) throw std::invalid_argument("naive peer does not support " + reason);
  State& s = *state_;
  s.p = problem;
  s.type = cuda_type(problem.dtype);
  s.compute = problem.dtype == DType::f32 && problem.fp32_mode == Fp32Mode::fast ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                                                 : CUBLAS_COMPUTE_32F;
  s.scale = problem.softmax_scale.value_or(float(1.0 / std::sqrt(double(problem.headdim_qk))));
  s.mask = RowMask{int(problem.seqlen_q), int(problem.seqlen_k), problem.window_left,
                   problem.causal ? 0 : problem.window_right};
  s.group = int(problem.heads_q / problem.heads_kv);
  s.score_elems = problem.seqlen_q * problem.seqlen_k;
  check(cublasCreate(&s.handle), "cublasCreate");
  check(cublasSetStream(s.handle, static_cast<cudaStream_t>(problem.stream)), "cublasSetStream");
}

NaiveAttention::~NaiveAttention() = default;

void NaiveAttention::forward() {
  State& s = *state_;
  const AttentionProblem& p = s.p;
  s.ensure(s.scores);
  s.compute_scores();
  s.softmax<false>();
  // O = P V: row-major O is column-major O^T = V^T P^T.
  const int sq = int(p.seqlen_q), sk = int(p.seqlen_k), dv = int(p.headdim_v);
  for (long long b = 0; b < p.batch; ++b) {
    for (int j = 0; j < s.group; ++j) {
      s.gemm(CUBLAS_OP_N, CUBLAS_OP_N, dv, sq, sk, 1.0f, s.at(p.v.data, b * p.v.batch_stride), p.v.seq_stride,
             p.v.head_stride, s.score_at(s.scores, b, j), sk, s.score_stride(), 0.0f,
             s.at(p.o.data, b * p.o.batch_stride + j * p.o.head_stride), p.o.seq_stride, s.group * p.o.head_stride);
    }
  }
}

void NaiveAttention::backward() {
  State& s = *state_;
  const AttentionProblem& p = s.p;
  s.ensure(s.scores);
  s.ensure(s.dscores);
  s.compute_scores();
  s.softmax<true>();
  const int sq = int(p.seqlen_q), sk = int(p.seqlen_k), d = int(p.headdim_qk), dv = int(p.headdim_v);
  const long long g = s.group;
  for (long long b = 0; b < p.batch; ++b) {
    for (int j = 0; j < s.group; ++j) {
      const void* dout = s.at(p.dout.data, b * p.dout.batch_stride + j * p.dout.head_stride);
      // dV = P^T dO, summed over the query heads of each group (beta = 1 after the first).
      s.gemm(CUBLAS_OP_N, CUBLAS_OP_T, dv, sk, sq, 1.0f, dout, p.dout.seq_stride, g * p.dout.head_stride,
             s.score_at(s.scores, b, j), sk, s.score_stride(), j == 0 ? 0.0f : 1.0f,
             s.at(p.dv.data, b * p.dv.batch_stride), p.dv.seq_stride, p.dv.head_stride);
      // dP = dO V^T.
      s.gemm(CUBLAS_OP_T, CUBLAS_OP_N, sk, sq, dv, 1.0f, s.at(p.v.data, b * p.v.batch_stride), p.v.seq_stride,
             p.v.head_stride, dout, p.dout.seq_stride, g * p.dout.head_stride, 0.0f, s.score_at(s.dscores, b, j), sk,
             s.score_stride());
    }
  }
  s.softmax_backward();
  for (long long b = 0; b < p.batch; ++b) {
    for (int j = 0; j < s.group; ++j) {
      // dQ = scale dS K.
      s.gemm(CUBLAS_OP_N, CUBLAS_OP_N, d, sq, sk, s.scale, s.at(p.k.data, b * p.k.batch_stride), p.k.seq_stride,
             p.k.head_stride, s.score_at(s.dscores, b, j), sk, s.score_stride(), 0.0f,
             s.at(p.dq.data, b * p.dq.batch_stride + j * p.dq.head_stride), p.dq.seq_stride, g * p.dq.head_stride);
      // dK = scale dS^T Q, summed over the group.
      s.gemm(CUBLAS_OP_N, CUBLAS_OP_T, d, sk, sq, s.scale, s.at(p.q.data, b * p.q.batch_stride + j * p.q.head_stride),
             p.q.seq_stride, g * p.q.head_stride, s.score_at(s.dscores, b, j), sk, s.score_stride(),
             j == 0 ? 0.0f : 1.0f, s.at(p.dk.data, b * p.dk.batch_stride), p.dk.seq_stride, p.dk.head_stride);
    }
  }
}

}  // namespace tileattn::bench
