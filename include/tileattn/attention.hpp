#pragma once
// The public entry points. Each validates its problem (src/host/validate.cpp is the only place
// rules live), picks a backend, plans and runs. Errors are thrown as tileattn::Error.
#include <cstddef>
#include <memory>
#include <utility>

#include "tileattn/error.hpp"
#include "tileattn/problem.hpp"

namespace tileattn {

namespace detail {
class BackendPlan;
}

// One call, decided once: the problem validated, then the backend's plan (kernel, grid, split
// count, workspace size, Hopper tensor maps). The workspace query and the run share it, so
// nothing is validated or planned twice. A plan keeps the problem's pointers and stream: it is
// for the tensors it was made with, and may be run more than once while they stay valid.
class Plan {
 public:
  // Scratch bytes run() needs, in the problem's memory space (0 when none).
  size_t workspace_size() const;
  Backend backend() const { return backend_; }
  // The kernel family that runs: "sm90", "sm80", "fp32", "softmax_matmul" (CUDA), "cpu", or
  // "none" for a problem with nothing to compute.
  const char* kernel_name() const;
  // Runs on the problem's stream. `workspace` holds at least workspace_size() bytes, or is
  // nullptr and the library allocates (stream-ordered on CUDA); a smaller buffer is an Error.
  void run(void* workspace = nullptr, size_t workspace_bytes = 0) const;

  // Made by plan_forward, plan_backward and plan_softmax_matmul.
  Plan(std::shared_ptr<const detail::BackendPlan> impl, Backend backend, const char* size_call)
      : impl_(std::move(impl)), backend_(backend), size_call_(size_call) {}

 private:
  std::shared_ptr<const detail::BackendPlan> impl_;
  Backend backend_;
  const char* size_call_;  // names the size query in the message for a short workspace
};

Plan plan_forward(const AttentionProblem& problem);
Plan plan_backward(const AttentionProblem& problem);
Plan plan_softmax_matmul(const SoftmaxMatmulProblem& problem);

// Plan and run in one step, with the problem's own workspace and workspace_bytes.

// Writes O and L (log-sum-exp) from Q, K, V.
void forward(const AttentionProblem& problem);

// Writes dQ, dK, dV from Q, K, V, O, dO and L (as written by forward with the same options).
void backward(const AttentionProblem& problem);

// out = softmax(X, dim=-1) @ V, without materialising softmax(X).
void softmax_matmul(const SoftmaxMatmulProblem& problem);

// Scratch each call needs on the chosen backend, in bytes (0 when none): plan_*(p).workspace_size().
// Pass at least this much through `workspace` to keep the library from allocating (e.g. under
// CUDA-graph capture); a caller that queries and then runs should hold the Plan instead.
size_t forward_workspace_size(const AttentionProblem& problem);
size_t backward_workspace_size(const AttentionProblem& problem);
size_t softmax_matmul_workspace_size(const SoftmaxMatmulProblem& problem);

// The backend `automatic` resolves to for this problem: cuda when the tensors live in device
// memory (and the build has CUDA), cpu for host memory.
Backend resolve_backend(const AttentionProblem& problem);

// True when this build includes the CUDA backend and a CUDA device is visible.
bool cuda_available();

const char* version();

}  // namespace tileattn
