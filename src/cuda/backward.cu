// The CUDA backward entry: the validated problem becomes kernel parameters and a workspace, then
// dispatch on device, dtype and head-dim bucket: the Hopper kernels (src/cuda/backward/*_sm90*) where
// they apply, else the portable ones (src/cuda/backward/bwd_*).
//
// Both families sum dQ into a workspace fp32 accumulator (then scaled and converted) from the
// kernel that computes dK and dV -- by atomics (sm80) or bulk reductions (sm90) -- or, in the
// deterministic mode, give it its own pass over key tiles (on Hopper, where the problem allows,
// the bulk reductions in a fixed order instead); docs/perf.md ("Design decisions") gives the
// measured cost of each.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "common/online_softmax.hpp"
#include "common/score_mod.hpp"
#include "common/backend_plan.hpp"
#include "common/delta_rule.hpp"
#include "cuda/common/check.cuh"
#include "cuda/common/row_alignment.hpp"
#include "cuda/common/runtime_cache.hpp"
#include "cuda/common/uncovered_rows.cuh"
#include "cuda/common/workspace.cuh"
#include "cuda/cuda_backend.hpp"
#include "cuda/head_dims_built.hpp"
#include "cuda/backward/bwd_launch.hpp"
#include "cuda/arch/hopper_available.hpp"
#include "cuda/backward/launch_bwd_sm90.hpp"
#include "tileattn/error.hpp"

namespace tileattn::cuda {
namespace {

int headdim_bucket(const AttentionProblem& p) {
  const int d = int(std::max(p.headdim_qk, p.headdim_v));
  const int bucket = bucket_of(BwdSm80HeadDims{}, d);
  if (bucket == 0)
    throw Error(ErrorKind::unsupported, "CUDA backward: head dim " + std::to_string(d) +
                                            " exceeds every head-dim bucket of this build (TILEATTN_HEADDIMS=" +
                                            kBuiltHeadDims + ")");
  return bucket;
}

struct BwdKernelSm90 {
  void (*run)(const BwdSm90Params&, cudaStream_t);
  bool dq_own_pass = false;  // dQ always in a pass of its own (no accumulator), whatever the mode
  int box_rows = kBwdBoxRows;  // of its tensor maps
  int ordered_dq_block_n = 0;  // keys a block where the kernel can add dQ in a fixed order, else 0
};

// The Hopper backward for this bucket, when the build has it and the device runs it.
template <class T>
std::optional<BwdKernelSm90> pick_backward_sm90(int bucket) {
  std::optional<BwdKernelSm90> kernel;
  if (bucket_of(BwdSm90HeadDims{}, bucket) != bucket) return kernel;
  with_bucket(BwdSm90HeadDims{}, bucket, [&](auto d) {
    using K = BwdSm90<T, decltype(d)::value>;
    kernel = BwdKernelSm90{&K::run, false, kBwdBoxRows, K::ordered_dq_block_n()};
  });
  return kernel;
}

// fp32 on Hopper, for the TF32 kernels' buckets: TF32 products in fast mode, split TF32 in exact
// mode (with partial_keys, P from the given L and D from the given O, as the portable kernels:
// the split passes then run without their statistics passes).
std::optional<BwdKernelSm90> pick_backward_tf32_sm90(const AttentionProblem& p, int bucket) {
  std::optional<BwdKernelSm90> kernel;
  if (bucket_of(BwdTf32Sm90HeadDims{}, bucket) != bucket) return kernel;
  const bool fast = p.fp32_mode == Fp32Mode::fast;
  if (fast && p.dropout_p > 0.0f) return kernel;  // the TF32 kernels draw no dropout mask
  with_bucket(BwdTf32Sm90HeadDims{}, bucket, [&](auto d) {
    using K = BwdTf32Sm90<decltype(d)::value>;
    kernel = fast ? BwdKernelSm90{&K::run, true} : BwdKernelSm90{&K::run_exact, !K::kExactSumsDq, kBwdExactBoxRows};
  });
  return kernel;
}

std::optional<BwdKernelSm90> pick_backward_sm90(const AttentionProblem& p, int bucket) {
  if (!sm90::hopper_kernels_enabled()) return std::nullopt;
  if (p.dtype == DType::f32) return pick_backward_tf32_sm90(p, bucket);
  if (p.dropout_p > 0.0f) return std::nullopt;  // the 16-bit Hopper kernels draw no dropout mask
  return p.dtype == DType::f16 ? pick_backward_sm90<__half>(bucket) : pick_backward_sm90<__nv_bfloat16>(bucket);
}

// The Hopper kernels with their tensor maps, or nothing (the sm80 kernels run).
struct BwdPlan {
  std::optional<BwdKernelSm90> sm90;
  BwdSm90Params params{};
};

BwdPlan pick_kernels(const AttentionProblem& p) {
  BwdPlan plan;
  // Dropout runs on the portable kernels, but for fp32's exact Hopper passes (ALiBi and dropout
  // each have kernel instances of their own there).
  const int bucket = headdim_bucket(p);
  plan.sm90 = pick_backward_sm90(p, bucket);
  if (plan.sm90 && !make_bwd_sm90_maps(p, plan.params, plan.sm90->box_rows)) plan.sm90.reset();
  return plan;
}

// The deterministic mode keeps dQ in the Hopper kernel too, each query tile's additions landing in
// a fixed order (BwdKeyBlock, bwd_stream_sm90.cuh), where that order cannot hold the grid up: one
// length, no varlen, no mask but the causal one; unmasked, where a head's key blocks, which wait on
// one another in a cycle, all fit on the device at once. Elsewhere dQ has its own pass, and so on
// short causal problems at head dims up to 64, where a step is about as short as an addition's
// landing (H100, bf16, D = 64, N = 1k causal: the pass 4% faster; 16k: the fixed order 18%).
constexpr int64_t kOrderedDqShortCausalKeys = 1024;
bool ordered_dq(const AttentionProblem& p, const BwdPlan& plan) {
  if (!p.deterministic || !plan.sm90 || plan.sm90->ordered_dq_block_n == 0) return false;
  const bool causal = p.window_left < 0 && p.window_right == 0;
  const bool unmasked = p.window_left < 0 && p.window_right < 0;
  const int64_t key_blocks = (p.seqlen_k + plan.sm90->ordered_dq_block_n - 1) / plan.sm90->ordered_dq_block_n;
  const bool short_steps = headdim_bucket(p) <= 64 && p.seqlen_k <= kOrderedDqShortCausalKeys;
  return !p.is_varlen() && p.seqlen_q == p.seqlen_k && p.seqlen_k > 0 &&
         ((causal && !short_steps) || (unmasked && key_blocks <= device_props().sms));
}

// dQ is summed into the accumulator unless asked for determinism (then in a fixed order, `ordered`,
// or in a pass of its own) or the kernel always gives it its own pass (the TF32 Hopper backward).
bool uses_dq_accum(const AttentionProblem& p, const BwdPlan& plan, bool ordered) {
  if (plan.sm90 && plan.sm90->dq_own_pass) return false;
  return !p.deterministic || ordered;
}

// The workspace, carved in this order: lse2, dsum, row_sum (fp32 only), one float per padded
// query row each, then the fp32 dQ accumulator when dQ is summed in the main kernel and, when in a
// fixed order, one count per 64 padded rows.
struct WorkspaceLayout {
  int64_t rows = 0;
  int dim = 0;
  size_t lse2 = 0, dsum = 0, row_sum = 0, accum = 0, order = 0;
  size_t total() const {
    return Workspace::round_up(lse2) + Workspace::round_up(dsum) + Workspace::round_up(row_sum) +
           Workspace::round_up(accum) + Workspace::round_up(order);
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
  const bool ordered = ordered_dq(p, plan);
  w.accum = uses_dq_accum(p, plan, ordered) ? size_t(w.rows) * size_t(w.dim) * sizeof(float) : 0;
  w.order = ordered ? size_t(w.rows / 64) * sizeof(int) : 0;
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

template <class T>
void dispatch(int bucket, const bwd::BwdParams& params, cudaStream_t stream) {
  with_bucket(BwdSm80HeadDims{}, bucket, [&](auto d) { bwd::launch_backward<T, decltype(d)::value>(params, stream); });
}

// Decided once: Hopper or portable kernels, the workspace layout and every kernel parameter
// but the workspace pointers, which the run carves from the caller's scratch.
class BackwardPlan final : public detail::BackendPlan {
 public:
  explicit BackwardPlan(const AttentionProblem& p)
      : stream_(static_cast<cudaStream_t>(p.stream)),
        dtype_(p.dtype),
        uncovered_{packed_rows(p, p.dq, false, p.heads_q, p.headdim_qk),
                   packed_rows(p, p.dk, true, p.heads_kv, p.headdim_qk),
                   packed_rows(p, p.dv, true, p.heads_kv, p.headdim_v)} {
    plan_ = pick_kernels(p);
    layout_ = workspace_layout(p, plan_);
    bwd::BwdParams& params = params_;
    params.q = strided(p.q);
    params.k = strided(p.k);
    params.v = strided(p.v);
    params.o = strided(p.o);
    params.dout = strided(p.dout);
    params.dq = strided(p.dq);
    params.dk = strided(p.dk);
    params.dv = strided(p.dv);
    params.lse = p.lse;
    params.dlse = p.dlse;
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
    params.mod = score_mod(p);
    params.scale = params.mod.scale;
    params.scale_log2 = params.mod.scale_log2;
    params.softcap = params.mod.softcap;
    params.scale_over_cap = params.mod.softcap_pre;
    params.dropout = make_dropout(p.dropout_p, p.dropout_seed, p.dropout_offset, p.heads_q, p.dropout_rng_state);
    params.vec_io = vector_io_ok(p);
    params.pair_grads = pair_stores_ok(p);
    params.fp32_fast = p.dtype == DType::f32 && p.fp32_mode == Fp32Mode::fast;
    params.given_stats = p.partial_keys || params.fp32_fast;
    params.consistent_delta = p.dtype != DType::f32 && delta_from_p_and_dp(p);
    // Only the Hopper exact passes read it (bwd_kernel_exact_sm90.cuh).
    params.delta_from_out =
        plan_.sm90 && p.dtype == DType::f32 && !params.fp32_fast && !params.given_stats && !delta_from_p_and_dp(p);
    params.fwd_stats = params.delta_from_out && p.alibi_slopes == nullptr ? p.softmax_stats : nullptr;
    params.seqlen_q_rounded = int(layout_.rows / (p.batch * p.heads_q));
    params.dq_accum_dim = layout_.dim;
  }

  size_t workspace_size() const override { return layout_.total(); }
  const char* kernel_name() const override { return plan_.sm90 ? "sm90" : dtype_ == DType::f32 ? "fp32" : "sm80"; }

  void run(void* workspace, size_t workspace_bytes) const override {
    // The kernels read the workspace with 16-byte copies.
    if (workspace != nullptr && reinterpret_cast<uintptr_t>(workspace) % 16 != 0)
      throw Error(ErrorKind::invalid_argument, "workspace must be 16-byte aligned for the CUDA backward");
    Workspace ws(workspace, workspace_bytes, layout_.total(), stream_);
    bwd::BwdParams params = params_;
    params.lse2 = ws.take<float>(layout_.lse2);
    params.dsum = ws.take<float>(layout_.dsum);
    params.row_sum = layout_.row_sum > 0 ? ws.take<float>(layout_.row_sum) : nullptr;
    params.dq_accum = layout_.accum > 0 ? ws.take<float>(layout_.accum) : nullptr;
    params.dq_order = layout_.order > 0 ? ws.take<int>(layout_.order) : nullptr;
    // dq_accum and dq_order start at zero: the preprocess kernel zeroes them (bwd_preprocess.cuh).
    if (plan_.sm90) {
      BwdSm90Params sm90 = plan_.params;
      sm90.bwd = params;
      plan_.sm90->run(sm90, stream_);
    } else if (dtype_ == DType::f16) {
      dispatch<__half>(layout_.dim, params, stream_);
    } else if (dtype_ == DType::bf16) {
      dispatch<__nv_bfloat16>(layout_.dim, params, stream_);
    } else {
      dispatch<float>(layout_.dim, params, stream_);
    }
    for (const PackedRows& rows : uncovered_) define_uncovered_rows(rows, stream_);
  }

 private:
  cudaStream_t stream_;
  DType dtype_;
  PackedRows uncovered_[3];  // dQ, dK, dV
  BwdPlan plan_;
  WorkspaceLayout layout_;
  bwd::BwdParams params_{};
};

}  // namespace

std::unique_ptr<detail::BackendPlan> plan_backward(const AttentionProblem& problem) {
  return std::make_unique<BackwardPlan>(problem);
}

}  // namespace tileattn::cuda
