// The CUDA backend's entry: device queries, and the forward dispatch (dtype x head-dim bucket,
// split-KV workspace). Backward and softmax_matmul live in their own files.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "common/key_rows.hpp"
#include "common/kv_append.hpp"
#include "common/online_softmax.hpp"
#include "common/philox.hpp"
#include "common/score_mod.hpp"
#include "common/backend_plan.hpp"
#include "cuda/common/check.cuh"
#include "cuda/common/row_alignment.hpp"
#include "cuda/common/split_heuristic.hpp"
#include "cuda/common/uncovered_rows.cuh"
#include "cuda/common/workspace.cuh"
#include "cuda/cuda_backend.hpp"
#include "cuda/head_dims_built.hpp"
#include "cuda/fp32/forward_fp32.hpp"
#include "cuda/common/fwd_params.hpp"
#include "cuda/forward/fwd_tile_size.hpp"
#include "cuda/forward/kv_append.hpp"
#include "cuda/forward/launch_fwd_sm80.hpp"
#include "cuda/arch/hopper_available.hpp"
#include "cuda/forward/launch_fwd_sm90.hpp"
#include "tileattn/error.hpp"

namespace tileattn::cuda {

bool device_available() {
  // The visible devices are fixed once the runtime has started: asked once (every call checks).
  static const bool available = [] {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      cudaGetLastError();  // no driver or no device: not an error of later calls
      return false;
    }
    return count > 0;
  }();
  return available;
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

[[noreturn]] void no_bucket(const char* family, int headdim) {
  throw Error(ErrorKind::unsupported, std::string(family) + ": head dim " + std::to_string(headdim) +
                                          " exceeds every head-dim bucket of this build (TILEATTN_HEADDIMS=" +
                                          kBuiltHeadDims + ")");
}

// The kernels of the smallest bucket that holds both head dims (Q/K and V are padded to it).
template <class T>
FwdKernel pick_forward(int headdim) {
  FwdKernel kernel{};
  const bool found = with_bucket(FwdSm80HeadDims{}, headdim, [&](auto bucket) {
    constexpr int d = decltype(bucket)::value;
    kernel = {&FwdSm80<T, d>::num_splits, &FwdSm80<T, d>::run};
  });
  if (!found) no_bucket("CUDA forward", headdim);
  return kernel;
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
  std::optional<FwdKernelSm90> kernel;
  if (bucket_of(FwdSm90HeadDims{}, headdim) != bucket_of(FwdSm80HeadDims{}, headdim)) return kernel;
  with_bucket(FwdSm90HeadDims{}, headdim, [&](auto bucket) {
    constexpr int d = decltype(bucket)::value;
    kernel = FwdKernelSm90{&FwdSm90<T, d>::make_maps, &FwdSm90<T, d>::num_splits, &FwdSm90<T, d>::run};
  });
  return kernel;
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
  f.mod = score_mod(p);
  f.scale_log2 = f.mod.scale_log2;
  f.softcap_pre = f.mod.softcap_pre, f.softcap_post = f.mod.softcap_post;
  f.dropout = make_dropout(p.dropout_p, p.dropout_seed, p.dropout_offset, p.heads_q, p.dropout_rng_state);
  f.vec_q = vectorizable(p.q, p.headdim_qk, varlen);
  f.keys = key_layout(p);
  // A paged or batch-indexed K/V is addressed through its batch (page) stride even when varlen.
  const bool k_packed = varlen && !p.is_paged();
  f.vec_k = vectorizable(p.k, p.headdim_qk, k_packed);
  f.vec_v = vectorizable(p.v, p.headdim_v, k_packed);
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

// Query lengths up to this count as decoding (and speculative decoding): their query tiles are
// mostly empty per head, so packing a GQA group into one tile costs no compute and saves reads.
constexpr int64_t kPackMaxSeqlenQ = 64;

bool empty(const AttentionProblem& p) { return p.batch == 0 || p.heads_q == 0 || p.seqlen_q == 0; }

// The fp16/bf16 forward: the Hopper kernel with its tensor maps where it runs this problem, else
// the portable one; the split count and workspace follow from that choice.
class ForwardPlan final : public detail::BackendPlan {
 public:
  explicit ForwardPlan(const AttentionProblem& problem)
      : stream_(static_cast<cudaStream_t>(problem.stream)),
        empty_(empty(problem)),
        append_(kv_append_args(problem)),
        uncovered_(packed_rows(problem, problem.o, false, problem.heads_q, problem.headdim_v, problem.lse)) {
    if (empty_) return;
    params_.fwd = make_params(problem);  // params_.fwd is what the sm80 kernel reads too
    // GQA packing: the query heads of a group share one tile of the portable kernels, which then
    // read each K/V byte once per group (not with ALiBi, whose slope is per head). Up to 16
    // (packed) rows is decoding: the decode kernel, which keeps more of K and V in flight than the
    // Hopper forward's 128-row tiles. Dropout and key/value caches run on the portable kernels
    // only (the Hopper forward reads keys through one tensor map per problem, and has no dropout
    // yet); ALiBi runs on both (the Hopper forward in instances of its own).
    const int64_t group = problem.heads_q / problem.heads_kv;
    const bool packable = group > 1 && problem.seqlen_q <= kPackMaxSeqlenQ && problem.alibi_slopes == nullptr;
    const bool decode = problem.seqlen_q * (packable ? group : 1) <= kDecodeRows;
    const bool portable_only = problem.dropout_p > 0.0f || problem.has_kv_cache();
    if (!decode && !portable_only) sm90_ = pick_forward_sm90(problem);
    if (sm90_ && !sm90_->make_maps(problem, params_)) sm90_.reset();
    if (sm90_) {
      params_.fwd.num_splits = sm90_->num_splits(params_);
    } else {
      sm80_ = pick_forward(problem);
      // Wherever the portable kernels run, packing only saves reads; beside the Hopper kernel
      // (17..64 packed rows) it was not measured, so that case keeps the Hopper kernel.
      if (packable) params_.fwd.pack = int(group);
      params_.fwd.num_splits = sm80_.num_splits(params_.fwd);
    }
    // A requested split count replaces the heuristic's (empty splits are harmless: they combine as
    // L = -inf); the cap keeps the partials' workspace bounded.
    if (problem.num_splits > 0) params_.fwd.num_splits = std::min(problem.num_splits, kMaxRequestedSplits);
    workspace_ = split_bytes(params_.fwd, params_.fwd.num_splits, &lse_bytes_);
    if (append_.active) {
      // Caches run on the portable kernels, which take q's pointer at launch: its rotated copy
      // comes from the workspace, laid out as rotated_q_view says.
      rotated_bytes_ = Workspace::round_up(size_t(rotated_q_elements(problem)) * 2);
      const TensorView r = rotated_q_view(problem, nullptr);
      if (problem.has_rotary()) {
        params_.fwd.q_batch_stride = r.batch_stride, params_.fwd.q_row_stride = r.seq_stride;
        params_.fwd.q_head_stride = r.head_stride, params_.fwd.vec_q = problem.headdim_qk % 8 == 0;
      }
      workspace_ += rotated_bytes_;
    }
  }

  size_t workspace_size() const override { return workspace_; }
  const char* kernel_name() const override { return empty_ ? "none" : sm90_ ? "sm90" : "sm80"; }

  void run(void* workspace, size_t workspace_bytes) const override {
    if (empty_) return;
    FwdSm90Params params = params_;
    Workspace scratch(workspace, workspace_bytes, workspace_, stream_);
    if (append_.active) {
      void* rotated = scratch.take<void>(rotated_bytes_);
      launch_kv_append(append_, rotated, stream_);
      if (append_.rotary) {
        params.fwd.q = rotated;
        params.fwd.vec_q = params.fwd.vec_q && reinterpret_cast<uintptr_t>(rotated) % 16 == 0;  // a caller's buffer
      }
    }
    if (lse_bytes_) {
      params.fwd.lse_partial = scratch.take<float>(lse_bytes_);
      params.fwd.o_partial = scratch.take<float>(workspace_ - rotated_bytes_ - lse_bytes_);
    }
    if (sm90_) sm90_->run(params, stream_);
    else sm80_.run(params.fwd, stream_);
    define_uncovered_rows(uncovered_, stream_);
  }

 private:
  cudaStream_t stream_;
  bool empty_;
  KvAppendArgs append_;
  PackedRows uncovered_;
  FwdSm90Params params_{};
  FwdKernel sm80_{};
  std::optional<FwdKernelSm90> sm90_;
  size_t workspace_ = 0, lse_bytes_ = 0, rotated_bytes_ = 0;
};

class Fp32ForwardPlan final : public detail::BackendPlan {
 public:
  explicit Fp32ForwardPlan(const AttentionProblem& problem)
      : problem_(problem),
        append_(kv_append_args(problem)),
        uncovered_(packed_rows(problem, problem.o, false, problem.heads_q, problem.headdim_v, problem.lse)),
        workspace_(Workspace::round_up(size_t(rotated_q_elements(problem)) * sizeof(float))) {}
  size_t workspace_size() const override { return workspace_; }
  const char* kernel_name() const override { return "fp32"; }
  void run(void* workspace, size_t workspace_bytes) const override {
    if (empty(problem_)) return;
    const auto stream = static_cast<cudaStream_t>(problem_.stream);
    Workspace scratch(workspace, workspace_bytes, workspace_, stream);
    AttentionProblem p = problem_;
    if (append_.active) {
      void* rotated = scratch.take<void>(workspace_);
      launch_kv_append(append_, rotated, stream);
      if (p.has_rotary()) p.q = rotated_q_view(p, rotated);
    }
    forward_fp32(p);
    define_uncovered_rows(uncovered_, stream);
  }

 private:
  AttentionProblem problem_;
  KvAppendArgs append_;
  PackedRows uncovered_;
  size_t workspace_;
};

}  // namespace

std::unique_ptr<detail::BackendPlan> plan_forward(const AttentionProblem& problem) {
  if (problem.dtype == DType::f32) return std::make_unique<Fp32ForwardPlan>(problem);
  return std::make_unique<ForwardPlan>(problem);
}

const char* forward_kernel_name(const AttentionProblem& problem) { return plan_forward(problem)->kernel_name(); }

}  // namespace tileattn::cuda
