// The CUDA backward entry: the validated problem becomes kernel parameters and a workspace, then
// dispatch on device, dtype and head-dim bucket: the Hopper kernels (src/cuda/sm90/bwd_*) where
// they apply, else the portable ones (src/cuda/sm80/bwd_*).
//
// The sm80 kernels sum dQ either by fp32 atomics from the dK/dV kernel into a workspace
// accumulator (then scaled and converted), or by its own pass over key tiles (the deterministic
// mode). The sm90 kernels always give dQ its own pass, so they are deterministic as they stand;
// docs/perf.md ("CUDA backward") records the measured cost of each.
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
#include "cuda/sm80/bwd_launch.hpp"
#include "cuda/sm90/hopper_available.hpp"
#include "cuda/sm90/launch_bwd_sm90.hpp"
#include "tileattn/error.hpp"

namespace tileattn::cuda {
namespace {

int headdim_bucket(const AttentionProblem& p) {
  const int64_t d = std::max(p.headdim_qk, p.headdim_v);
  for (int b : bwd::kHeadDimBuckets)
    if (d <= b) return b;
  throw Error(ErrorKind::unsupported,
              "headdim " + std::to_string(d) + " exceeds every head-dim bucket this build has (TILEATTN_HEADDIMS)");
}

struct BwdKernelSm90 {
  bool (*make_maps)(const AttentionProblem&, BwdSm90Params&);
  void (*run)(const BwdSm90Params&, cudaStream_t);
};

// The Hopper backward for this bucket, when the build has it and the device runs it.
std::optional<BwdKernelSm90> pick_backward_sm90(const AttentionProblem& p, int bucket) {
  if (p.dtype == DType::f32 || !sm90::hopper_kernels_enabled()) return std::nullopt;
  const bool f16 = p.dtype == DType::f16;
#define TA_BWD90_BUCKET(D)                                                                             \
  if (bucket == D)                                                                                     \
    return f16 ? BwdKernelSm90{&BwdSm90<__half, D>::make_maps, &BwdSm90<__half, D>::run}               \
               : BwdKernelSm90{&BwdSm90<__nv_bfloat16, D>::make_maps, &BwdSm90<__nv_bfloat16, D>::run};
#if TILEATTN_CUDA_SM90_BWD_HEADDIM_32
  TA_BWD90_BUCKET(32)
#endif
#if TILEATTN_CUDA_SM90_BWD_HEADDIM_64
  TA_BWD90_BUCKET(64)
#endif
#if TILEATTN_CUDA_SM90_BWD_HEADDIM_96
  TA_BWD90_BUCKET(96)
#endif
#if TILEATTN_CUDA_SM90_BWD_HEADDIM_128
  TA_BWD90_BUCKET(128)
#endif
#undef TA_BWD90_BUCKET
  (void)f16;
  return std::nullopt;
}

// The Hopper kernels with their tensor maps, or nothing (the sm80 kernels run).
struct BwdPlan {
  std::optional<BwdKernelSm90> sm90;
  BwdSm90Params params{};
};

BwdPlan plan_backward(const AttentionProblem& p) {
  BwdPlan plan;
  plan.sm90 = pick_backward_sm90(p, headdim_bucket(p));
  if (plan.sm90 && !plan.sm90->make_maps(p, plan.params)) plan.sm90.reset();
  return plan;
}

// The sm80 kernels sum dQ by atomics unless asked for determinism (then dQ has its own pass);
// the sm90 kernels always give dQ its own pass.
bool uses_atomic_dq(const AttentionProblem& p, const BwdPlan& plan) { return !plan.sm90 && !p.deterministic; }

// The workspace, carved in this order: lse2, dsum, row_sum (fp32 only), one float per padded
// query row each, then the fp32 dQ accumulator when dQ is summed by atomics.
struct WorkspaceLayout {
  int64_t rows = 0;
  int dim = 0;
  size_t lse2 = 0, dsum = 0, row_sum = 0, accum = 0;
  size_t total() const {
    return Workspace::round_up(lse2) + Workspace::round_up(dsum) + Workspace::round_up(row_sum) +
           Workspace::round_up(accum);
  }
};

WorkspaceLayout workspace_layout(const AttentionProblem& p, const BwdPlan& plan) {
  WorkspaceLayout w;
  const int64_t rows_per_head =
      (p.seqlen_q + bwd::kWorkspaceRowTile - 1) / bwd::kWorkspaceRowTile * bwd::kWorkspaceRowTile;
  w.rows = p.batch * p.heads_q * rows_per_head;
  w.dim = headdim_bucket(p);
  w.lse2 = w.dsum = size_t(w.rows) * sizeof(float);
  w.row_sum = p.dtype == DType::f32 ? size_t(w.rows) * sizeof(float) : 0;
  w.accum = uses_atomic_dq(p, plan) ? size_t(w.rows) * size_t(w.dim) * sizeof(float) : 0;
  return w;
}

bwd::Strided strided(const TensorView& t) { return {t.data, t.batch_stride, t.seq_stride, t.head_stride}; }

// 16-byte copies need every row start 16-byte aligned: bases, strides and head dims in whole chunks.
bool vector_io_ok(const AttentionProblem& p) {
  const int64_t element = p.dtype == DType::f32 ? 4 : 2, chunk = 16 / element;
  if (p.headdim_qk % chunk != 0 || p.headdim_v % chunk != 0) return false;
  for (const TensorView* t : {&p.q, &p.k, &p.v, &p.o, &p.dout})
    if (!rows_aligned(*t, element, 16, p.is_varlen())) return false;
  return true;
}

// 4-byte stores of element pairs into dQ, dK and dV (16-bit types only).
bool pair_stores_ok(const AttentionProblem& p) {
  if (p.dtype == DType::f32) return false;
  for (const TensorView* t : {&p.dq, &p.dk, &p.dv})
    if (!rows_aligned(*t, 2, 4, p.is_varlen())) return false;
  return true;
}

// Window sides were clamped to the sequence lengths by validation, so they fit an int.
int window_side(int64_t w) { return w < 0 ? -1 : int(w); }

template <class T, int D>
void launch_if(int bucket, const bwd::BwdParams& params, cudaStream_t stream) {
  if (bucket == D) bwd::launch_backward<T, D>(params, stream);
}

template <class T>
void dispatch(int bucket, const bwd::BwdParams& params, cudaStream_t stream) {
#if TILEATTN_BWD_HAS_HEADDIM(32)
  launch_if<T, 32>(bucket, params, stream);
#endif
#if TILEATTN_BWD_HAS_HEADDIM(64)
  launch_if<T, 64>(bucket, params, stream);
#endif
#if TILEATTN_BWD_HAS_HEADDIM(96)
  launch_if<T, 96>(bucket, params, stream);
#endif
#if TILEATTN_BWD_HAS_HEADDIM(128)
  launch_if<T, 128>(bucket, params, stream);
#endif
#if TILEATTN_BWD_HAS_HEADDIM(192)
  launch_if<T, 192>(bucket, params, stream);
#endif
#if TILEATTN_BWD_HAS_HEADDIM(256)
  launch_if<T, 256>(bucket, params, stream);
#endif
}

}  // namespace

size_t backward_workspace_size(const AttentionProblem& problem) {
  return workspace_layout(problem, plan_backward(problem)).total();
}

void backward(const AttentionProblem& p) {
  // The kernels read the workspace with 16-byte copies.
  if (p.workspace != nullptr && reinterpret_cast<uintptr_t>(p.workspace) % 16 != 0)
    throw Error(ErrorKind::invalid_argument, "workspace must be 16-byte aligned for the CUDA backward");
  const cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  BwdPlan plan = plan_backward(p);
  const WorkspaceLayout layout = workspace_layout(p, plan);
  Workspace ws(p.workspace, p.workspace_bytes, layout.total(), stream);

  bwd::BwdParams params{};
  params.q = strided(p.q);
  params.k = strided(p.k);
  params.v = strided(p.v);
  params.o = strided(p.o);
  params.dout = strided(p.dout);
  params.dq = strided(p.dq);
  params.dk = strided(p.dk);
  params.dv = strided(p.dv);
  params.lse = p.lse;
  params.cu_seqlens_q = p.cu_seqlens_q;
  params.cu_seqlens_k = p.cu_seqlens_k;
  params.batch = int(p.batch);
  params.seqlen_q = int(p.seqlen_q);
  params.seqlen_k = int(p.seqlen_k);
  params.total_q = p.total_q;
  params.total_k = p.total_k;
  params.heads_q = int(p.heads_q);
  params.heads_kv = int(p.heads_kv);
  params.group = int(p.heads_q / p.heads_kv);
  params.headdim_qk = int(p.headdim_qk);
  params.headdim_v = int(p.headdim_v);
  params.window_left = window_side(p.window_left);
  params.window_right = window_side(p.window_right);
  params.scale = *p.softmax_scale;
  params.scale_log2 = params.scale * kLog2e;
  params.softcap = p.softcap;
  params.scale_over_cap = p.softcap > 0.0f ? params.scale / p.softcap : 0.0f;
  params.vec_io = vector_io_ok(p);
  params.pair_grads = pair_stores_ok(p);
  params.seqlen_q_rounded = int(layout.rows / (p.batch * p.heads_q));
  params.dq_accum_dim = layout.dim;
  params.lse2 = ws.take<float>(layout.lse2);
  params.dsum = ws.take<float>(layout.dsum);
  params.row_sum = layout.row_sum > 0 ? ws.take<float>(layout.row_sum) : nullptr;
  params.dq_accum = layout.accum > 0 ? ws.take<float>(layout.accum) : nullptr;
  if (params.dq_accum != nullptr) TA_CUDA_CHECK(cudaMemsetAsync(params.dq_accum, 0, layout.accum, stream));
  if (plan.sm90) {
    plan.params.bwd = params;
    return plan.sm90->run(plan.params, stream);
  }

  switch (p.dtype) {
    case DType::f16:
      return dispatch<__half>(layout.dim, params, stream);
    case DType::bf16:
      return dispatch<__nv_bfloat16>(layout.dim, params, stream);
    case DType::f32:
      return dispatch<float>(layout.dim, params, stream);
  }
}

}  // namespace tileattn::cuda
