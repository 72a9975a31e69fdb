// The CUDA backend's entry: device queries, and the forward dispatch (dtype x head-dim bucket,
// split-KV workspace). Backward and softmax_matmul live in their own files.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>

#include "common/online_softmax.hpp"
#include "cuda/common/check.cuh"
#include "cuda/common/row_alignment.hpp"
#include "cuda/common/workspace.cuh"
#include "cuda/cuda_backend.hpp"
#include "cuda/fp32/forward_fp32.hpp"
#include "cuda/sm80/fwd_params.hpp"
#include "cuda/sm80/launch_fwd_sm80.hpp"
#include "cuda/sm90/hopper_available.hpp"
#include "cuda/sm90/launch_fwd_sm90.hpp"
#include "tileattn/error.hpp"

namespace tileattn::cuda {

bool device_available() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: not an error of later calls
    return false;
  }
  return count > 0;
}

bool is_device_pointer(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  if (attr.type == cudaMemoryTypeManaged) return true;
  if (attr.type != cudaMemoryTypeDevice) return false;
  int device = 0;
  TA_CUDA_CHECK(cudaGetDevice(&device));
  return attr.device == device;
}

void copy_to_host(int* dst, const int* src, long long count, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  TA_CUDA_CHECK(cudaMemcpyAsync(dst, src, size_t(count) * sizeof(int), cudaMemcpyDeviceToHost, s));
  TA_CUDA_CHECK(cudaStreamSynchronize(s));
}

bool stream_is_capturing(void* stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  TA_CUDA_CHECK(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status));
  return status != cudaStreamCaptureStatusNone;
}

namespace {

struct FwdKernel {
  int (*num_splits)(const FwdParams&);
  void (*run)(const FwdParams&, cudaStream_t);
};

// The smallest head-dim bucket of this build that holds both head dims (Q/K and V are padded
// to it with zeros).
template <class T>
FwdKernel pick_forward(int headdim) {
#define TA_FWD_BUCKET(D) \
  if (headdim <= D) return {&FwdSm80<T, D>::num_splits, &FwdSm80<T, D>::run};
#if TILEATTN_CUDA_HEADDIM_32
  TA_FWD_BUCKET(32)
#endif
#if TILEATTN_CUDA_HEADDIM_64
  TA_FWD_BUCKET(64)
#endif
#if TILEATTN_CUDA_HEADDIM_96
  TA_FWD_BUCKET(96)
#endif
#if TILEATTN_CUDA_HEADDIM_128
  TA_FWD_BUCKET(128)
#endif
#if TILEATTN_CUDA_HEADDIM_192
  TA_FWD_BUCKET(192)
#endif
#if TILEATTN_CUDA_HEADDIM_256
  TA_FWD_BUCKET(256)
#endif
#undef TA_FWD_BUCKET
  throw Error(ErrorKind::unsupported, "CUDA forward: head dim " + std::to_string(headdim) +
                                          " exceeds every head-dim bucket of this build (TILEATTN_HEADDIMS=" +
                                          TILEATTN_CUDA_HEADDIMS + ")");
}

FwdKernel pick_forward(const AttentionProblem& p) {
  const int headdim = int(std::max(p.headdim_qk, p.headdim_v));
  if (p.dtype == DType::f16) return pick_forward<__half>(headdim);
  return pick_forward<__nv_bfloat16>(headdim);
}

struct FwdKernelSm90 {
  bool (*make_maps)(const AttentionProblem&, FwdSm90Params&);
  int (*num_splits)(const FwdSm90Params&);
  void (*run)(const FwdSm90Params&, cudaStream_t);
};

// The Hopper kernel for the same bucket the sm80 dispatch would pick, when this build has it.
template <class T>
std::optional<FwdKernelSm90> pick_forward_sm90(int headdim) {
#define TA_FWD90_BUCKET(D) \
  if (headdim <= D) return FwdKernelSm90{&FwdSm90<T, D>::make_maps, &FwdSm90<T, D>::num_splits, &FwdSm90<T, D>::run};
#if TILEATTN_CUDA_SM90_FWD_HEADDIM_32
  TA_FWD90_BUCKET(32)
#endif
#if TILEATTN_CUDA_SM90_FWD_HEADDIM_64
  TA_FWD90_BUCKET(64)
#endif
#if TILEATTN_CUDA_SM90_FWD_HEADDIM_96
  TA_FWD90_BUCKET(96)
#endif
#if TILEATTN_CUDA_SM90_FWD_HEADDIM_128
  TA_FWD90_BUCKET(128)
#endif
#if TILEATTN_CUDA_SM90_FWD_HEADDIM_192
  TA_FWD90_BUCKET(192)
#endif
#if TILEATTN_CUDA_SM90_FWD_HEADDIM_256
  TA_FWD90_BUCKET(256)
#endif
#undef TA_FWD90_BUCKET
  (void)headdim;
  return std::nullopt;
}

std::optional<FwdKernelSm90> pick_forward_sm90(const AttentionProblem& p) {
  if (!sm90::hopper_kernels_enabled()) return std::nullopt;
  const int headdim = int(std::max(p.headdim_qk, p.headdim_v));
  if (p.dtype == DType::f16) return pick_forward_sm90<__half>(headdim);
  return pick_forward_sm90<__nv_bfloat16>(headdim);
}

bool vectorizable(const TensorView& t, int64_t headdim, bool varlen) {
  return headdim % 8 == 0 && rows_aligned(t, 2, 16, varlen);
}

FwdParams make_params(const AttentionProblem& p) {
  const bool varlen = p.is_varlen();
  FwdParams f;
  f.q = p.q.data, f.k = p.k.data, f.v = p.v.data, f.o = p.o.data, f.lse = p.lse;
  f.q_batch_stride = p.q.batch_stride, f.q_row_stride = p.q.seq_stride, f.q_head_stride = p.q.head_stride;
  f.k_batch_stride = p.k.batch_stride, f.k_row_stride = p.k.seq_stride, f.k_head_stride = p.k.head_stride;
  f.v_batch_stride = p.v.batch_stride, f.v_row_stride = p.v.seq_stride, f.v_head_stride = p.v.head_stride;
  f.o_batch_stride = p.o.batch_stride, f.o_row_stride = p.o.seq_stride, f.o_head_stride = p.o.head_stride;
  f.cu_seqlens_q = p.cu_seqlens_q, f.cu_seqlens_k = p.cu_seqlens_k, f.total_q = p.total_q;
  f.total_k = p.total_k;
  f.batch = int(p.batch), f.heads_q = int(p.heads_q), f.heads_kv = int(p.heads_kv);
  f.seqlen_q = int(p.seqlen_q), f.seqlen_k = int(p.seqlen_k);
  f.headdim_qk = int(p.headdim_qk), f.headdim_v = int(p.headdim_v);
  f.window_left = int(p.window_left), f.window_right = int(p.window_right);
  const float scale = *p.softmax_scale;
  f.scale_log2 = scale * kLog2e;
  if (p.softcap > 0.0f) f.softcap_pre = scale / p.softcap, f.softcap_post = p.softcap / scale;
  f.vec_q = vectorizable(p.q, p.headdim_qk, varlen);
  f.vec_k = vectorizable(p.k, p.headdim_qk, varlen);
  f.vec_v = vectorizable(p.v, p.headdim_v, varlen);
  f.pair_o = rows_aligned(p.o, 2, 4, varlen);
  return f;
}

// Workspace of split-KV: partial LSEs, then partial O, both fp32.
size_t split_bytes(const FwdParams& f, int splits, size_t* lse_bytes) {
  if (splits <= 1) return *lse_bytes = 0;
  const size_t rows = size_t(splits) * size_t(f.batch) * size_t(f.heads_q) * size_t(f.seqlen_q);
  *lse_bytes = Workspace::round_up(rows * sizeof(float));
  return *lse_bytes + Workspace::round_up(rows * size_t(f.headdim_v) * sizeof(float));
}

bool empty(const AttentionProblem& p) { return p.batch == 0 || p.heads_q == 0 || p.seqlen_q == 0; }

// The kernel that runs a problem and its split count, decided once for both the workspace query
// and the run.
struct ForwardPlan {
  FwdSm90Params params;  // params.fwd is what the sm80 kernel reads too
  FwdKernel sm80{};
  std::optional<FwdKernelSm90> sm90;
};

ForwardPlan plan_forward(const AttentionProblem& problem) {
  ForwardPlan plan;
  plan.params.fwd = make_params(problem);
  plan.sm90 = pick_forward_sm90(problem);
  if (plan.sm90 && !plan.sm90->make_maps(problem, plan.params)) plan.sm90.reset();
  if (plan.sm90) {
    plan.params.fwd.num_splits = plan.sm90->num_splits(plan.params);
  } else {
    plan.sm80 = pick_forward(problem);
    plan.params.fwd.num_splits = plan.sm80.num_splits(plan.params.fwd);
  }
  return plan;
}

}  // namespace

size_t forward_workspace_size(const AttentionProblem& problem) {
  if (problem.dtype == DType::f32) return forward_fp32_workspace_size(problem);
  if (empty(problem)) return 0;
  const ForwardPlan plan = plan_forward(problem);
  size_t lse_bytes = 0;
  return split_bytes(plan.params.fwd, plan.params.fwd.num_splits, &lse_bytes);
}

const char* forward_kernel_name(const AttentionProblem& problem) {
  if (problem.dtype == DType::f32) return "fp32";
  if (empty(problem)) return "none";
  return plan_forward(problem).sm90 ? "sm90" : "sm80";
}

void forward(const AttentionProblem& problem) {
  if (problem.dtype == DType::f32) return forward_fp32(problem);
  if (empty(problem)) return;
  ForwardPlan plan = plan_forward(problem);
  FwdParams& f = plan.params.fwd;
  size_t lse_bytes = 0;
  const size_t needed = split_bytes(f, f.num_splits, &lse_bytes);
  const auto stream = static_cast<cudaStream_t>(problem.stream);
  Workspace workspace(problem.workspace, problem.workspace_bytes, needed, stream);
  if (needed) {
    f.lse_partial = workspace.take<float>(lse_bytes);
    f.o_partial = workspace.take<float>(needed - lse_bytes);
  }
  if (plan.sm90) plan.sm90->run(plan.params, stream);
  else plan.sm80.run(f, stream);
}

}  // namespace tileattn::cuda
