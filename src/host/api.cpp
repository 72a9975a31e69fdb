// Dispatch: resolve the backend, check that the memory each pointer names is the backend's, read
// the offsets validation needs, validate (src/host/validate.cpp), then hand the normalised
// problem to the backend's planner (the merge, which has no plan, to the backend's pass).
// Everything that asks the CUDA runtime happens here, not in validation.
#include <climits>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/backend_plan.hpp"
#include "cpu/cpu_backend.hpp"
#include "cpu/merge.hpp"
#include "host/dispatch.hpp"
#include "host/validate.hpp"
#include "tileattn/attention.hpp"

#ifdef TILEATTN_WITH_CUDA
#include "cuda/cuda_backend.hpp"
#include "cuda/merge/merge.hpp"
#endif

#ifndef TILEATTN_VERSION
#error "TILEATTN_VERSION must be defined by the build"
#endif

namespace tileattn {
namespace {

[[noreturn]] void invalid(const std::string& message) { throw Error(ErrorKind::invalid_argument, message); }

using host::check_backend_present;
using host::check_memory_space;
using host::resolve;

void check_memory(const AttentionProblem& p, host::Pass pass, Backend backend) {
  if (!p.check_memory_spaces) return;
  check_memory_space(p.q.data, "q.data", backend);
  check_memory_space(p.k.data, "k.data", backend);
  check_memory_space(p.v.data, "v.data", backend);
  check_memory_space(p.o.data, "o.data", backend);
  check_memory_space(p.lse, "lse", backend);
  check_memory_space(p.softmax_stats, "softmax_stats", backend);
  if (pass == host::Pass::backward) {
    check_memory_space(p.dout.data, "dout.data", backend);
    check_memory_space(p.dlse, "dlse", backend);
    check_memory_space(p.dq.data, "dq.data", backend);
    check_memory_space(p.dk.data, "dk.data", backend);
    check_memory_space(p.dv.data, "dv.data", backend);
  }
  check_memory_space(p.cu_seqlens_q, "cu_seqlens_q", backend);
  check_memory_space(p.cu_seqlens_k, "cu_seqlens_k", backend);
  check_memory_space(p.workspace, "workspace", backend);
  check_memory_space(p.alibi_slopes, "alibi_slopes", backend);
  check_memory_space(p.seqused_k, "seqused_k", backend);
  check_memory_space(p.leftpad_k, "leftpad_k", backend);
  check_memory_space(p.kv_batch_idx, "kv_batch_idx", backend);
  check_memory_space(p.block_table, "block_table", backend);
  if (p.appends()) {
    check_memory_space(p.k_new.data, "k_new.data", backend);
    check_memory_space(p.v_new.data, "v_new.data", backend);
  }
  check_memory_space(p.rotary_cos, "rotary_cos", backend);
  check_memory_space(p.rotary_sin, "rotary_sin", backend);
}

void check_memory(const MergeProblem& p, Backend backend) {
  check_memory_space(p.out.data, "out.data", backend);
  check_memory_space(p.out_b.data, "out_b.data", backend);
  check_memory_space(p.lse, "lse", backend);
  check_memory_space(p.lse_b, "lse_b", backend);
}

void check_memory(const SoftmaxMatmulProblem& p, Backend backend) {
  if (!p.check_memory_spaces) return;
  check_memory_space(p.x, "x", backend);
  check_memory_space(p.v, "v", backend);
  check_memory_space(p.out, "out", backend);
  check_memory_space(p.workspace, "workspace", backend);
}

// Device offsets and cache tables copied for validation, on request only: the copy synchronises
// the stream.
struct DeviceOffsets {
  std::vector<int32_t> q, k, seqused_k, leftpad_k, kv_batch_idx, block_table;
  host::HostOffsets view;
};

void read_device_offsets(const AttentionProblem& p, Backend backend, DeviceOffsets& out) {
  // Validation rejects sizes outside [1, INT32_MAX] (and a table row narrower than its pages)
  // whatever the tables say.
  if (backend != Backend::cuda || !p.check_cu_seqlens || p.batch < 1 || p.batch > INT32_MAX) return;
#ifdef TILEATTN_WITH_CUDA
  if (cuda::stream_is_capturing(p.stream)) return;
  auto copy = [&](const int32_t* src, int64_t count, std::vector<int32_t>& dst) -> const int32_t* {
    if (src == nullptr || count <= 0) return nullptr;
    dst.resize(size_t(count));
    cuda::copy_to_host(dst.data(), src, static_cast<long long>(count), p.stream);
    return dst.data();
  };
  if (p.cu_seqlens_q != nullptr && p.cu_seqlens_k != nullptr) {
    out.view.q = copy(p.cu_seqlens_q, p.batch + 1, out.q);
    out.view.k = copy(p.cu_seqlens_k, p.batch + 1, out.k);
  }
  out.view.seqused_k = copy(p.seqused_k, p.batch, out.seqused_k);
  out.view.leftpad_k = copy(p.leftpad_k, p.batch, out.leftpad_k);
  out.view.kv_batch_idx = copy(p.kv_batch_idx, p.batch, out.kv_batch_idx);
  if (p.block_table && p.pages_per_seq >= 1 && p.block_table_stride >= p.pages_per_seq &&
      p.block_table_stride <= INT32_MAX)
    out.view.block_table = copy(p.block_table, (p.batch - 1) * p.block_table_stride + p.pages_per_seq, out.block_table);
#else
  (void)out;
#endif
}

Plan make_plan(std::unique_ptr<detail::BackendPlan> impl, Backend backend, const char* size_call) {
  return Plan(std::shared_ptr<const detail::BackendPlan>(std::move(impl)), backend, size_call);
}

// The CPU backend allocates its own small per-thread scratch, so its plans need no workspace.
class CpuAttentionPlan final : public detail::BackendPlan {
 public:
  CpuAttentionPlan(const AttentionProblem& problem, host::Pass pass) : problem_(problem), pass_(pass) {}
  size_t workspace_size() const override { return 0; }
  const char* kernel_name() const override { return "cpu"; }
  void run(void*, size_t) const override {
    if (pass_ == host::Pass::forward) return cpu::forward(problem_);
    cpu::backward(problem_);
  }

 private:
  AttentionProblem problem_;
  host::Pass pass_;
};

class CpuSoftmaxMatmulPlan final : public detail::BackendPlan {
 public:
  explicit CpuSoftmaxMatmulPlan(const SoftmaxMatmulProblem& problem) : problem_(problem) {}
  size_t workspace_size() const override { return 0; }
  const char* kernel_name() const override { return "cpu"; }
  void run(void*, size_t) const override { cpu::softmax_matmul(problem_); }

 private:
  SoftmaxMatmulProblem problem_;
};

Plan plan_attention(const AttentionProblem& problem, host::Pass pass) {
  const Backend backend = resolve(problem.backend, problem.q.data);
  check_backend_present(backend);
  check_memory(problem, pass, backend);
  DeviceOffsets offsets;
  read_device_offsets(problem, backend, offsets);
  const AttentionProblem p = host::validate_attention(problem, pass, backend, offsets.view);
  const char* size_call = pass == host::Pass::forward ? "forward_workspace_size" : "backward_workspace_size";
#ifdef TILEATTN_WITH_CUDA
  if (backend == Backend::cuda) {
    auto impl = pass == host::Pass::forward ? cuda::plan_forward(p) : cuda::plan_backward(p);
    return make_plan(std::move(impl), backend, size_call);
  }
#endif
  return make_plan(std::make_unique<CpuAttentionPlan>(p, pass), backend, size_call);
}

}  // namespace

size_t Plan::workspace_size() const { return impl_->workspace_size(); }

const char* Plan::kernel_name() const { return impl_->kernel_name(); }

void Plan::run(void* workspace, size_t workspace_bytes) const {
  const size_t needed = impl_->workspace_size();
  if (workspace != nullptr && workspace_bytes < needed) {
    invalid("workspace_bytes=" + std::to_string(workspace_bytes) + " is less than " + size_call_ + "=" +
            std::to_string(needed));
  }
  impl_->run(workspace, workspace_bytes);
}

Backend resolve_backend(const AttentionProblem& problem) { return resolve(problem.backend, problem.q.data); }

Plan plan_forward(const AttentionProblem& problem) { return plan_attention(problem, host::Pass::forward); }

Plan plan_backward(const AttentionProblem& problem) { return plan_attention(problem, host::Pass::backward); }

Plan plan_softmax_matmul(const SoftmaxMatmulProblem& problem) {
  const Backend backend = resolve(problem.backend, problem.x);
  check_backend_present(backend);
  check_memory(problem, backend);
  const SoftmaxMatmulProblem p = host::validate_softmax_matmul(problem, backend);
#ifdef TILEATTN_WITH_CUDA
  if (backend == Backend::cuda)
    return make_plan(cuda::plan_softmax_matmul(p), backend, "softmax_matmul_workspace_size");
#endif
  return make_plan(std::make_unique<CpuSoftmaxMatmulPlan>(p), backend, "softmax_matmul_workspace_size");
}

void forward(const AttentionProblem& problem) { plan_forward(problem).run(problem.workspace, problem.workspace_bytes); }

void backward(const AttentionProblem& problem) {
  plan_backward(problem).run(problem.workspace, problem.workspace_bytes);
}

void softmax_matmul(const SoftmaxMatmulProblem& problem) {
  plan_softmax_matmul(problem).run(problem.workspace, problem.workspace_bytes);
}

void merge_attention(const MergeProblem& problem) {
  if (host::merge_is_empty(problem)) return;
  const Backend backend = resolve(problem.backend, problem.out.data);
  check_backend_present(backend);
  check_memory(problem, backend);
  host::validate_merge(problem, backend);
#ifdef TILEATTN_WITH_CUDA
  if (backend == Backend::cuda) return cuda::merge_attention(problem);
#endif
  cpu::merge_attention(problem);
}

// Sizes are those of the validated problem's plan; the caller's workspace plays no part in them.
size_t forward_workspace_size(const AttentionProblem& problem) {
  AttentionProblem unsized = problem;
  unsized.workspace = nullptr;
  return plan_forward(unsized).workspace_size();
}

size_t backward_workspace_size(const AttentionProblem& problem) {
  AttentionProblem unsized = problem;
  unsized.workspace = nullptr;
  return plan_backward(unsized).workspace_size();
}

size_t softmax_matmul_workspace_size(const SoftmaxMatmulProblem& problem) {
  SoftmaxMatmulProblem unsized = problem;
  unsized.workspace = nullptr;
  return plan_softmax_matmul(unsized).workspace_size();
}

bool cuda_available() {
#ifdef TILEATTN_WITH_CUDA
  return cuda::device_available();
#else
  return false;
#endif
}

const char* version() { return TILEATTN_VERSION; }

}  // namespace tileattn
