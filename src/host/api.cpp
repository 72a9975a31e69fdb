#include "cpu/cpu_backend.hpp"
#include "host/validate.hpp"
#include "tileattn/attention.hpp"

#ifdef TILEATTN_WITH_CUDA
#include "cuda/cuda_backend.hpp"
#endif

#ifndef TILEATTN_VERSION
#error "TILEATTN_VERSION must be defined by the build"
#endif

namespace tileattn {
namespace {

// `automatic` follows the memory the data lives in; an explicit choice (or an invalid enum value,
// which validation rejects) passes through unchanged.
Backend resolve(Backend requested, const void* data) {
  if (requested != Backend::automatic) return requested;
#ifdef TILEATTN_WITH_CUDA
  if (data != nullptr && cuda::is_device_pointer(data)) return Backend::cuda;
#else
  (void)data;
#endif
  return Backend::cpu;
}

Backend resolve(const SoftmaxMatmulProblem& problem) { return resolve(problem.backend, problem.x); }

}  // namespace

Backend resolve_backend(const AttentionProblem& problem) { return resolve(problem.backend, problem.q.data); }

// Validation rejects backend=cuda in a build without CUDA, so dispatch needs the CUDA branch only
// where it exists.
void forward(const AttentionProblem& problem) {
  const Backend backend = resolve_backend(problem);
  const AttentionProblem p = host::validate_attention(problem, host::Pass::forward, backend);
#ifdef TILEATTN_WITH_CUDA
  if (backend == Backend::cuda) return cuda::forward(p);
#endif
  cpu::forward(p);
}

void backward(const AttentionProblem& problem) {
  const Backend backend = resolve_backend(problem);
  const AttentionProblem p = host::validate_attention(problem, host::Pass::backward, backend);
#ifdef TILEATTN_WITH_CUDA
  if (backend == Backend::cuda) return cuda::backward(p);
#endif
  cpu::backward(p);
}

void softmax_matmul(const SoftmaxMatmulProblem& problem) {
  const Backend backend = resolve(problem);
  const SoftmaxMatmulProblem p = host::validate_softmax_matmul(problem, backend);
#ifdef TILEATTN_WITH_CUDA
  if (backend == Backend::cuda) return cuda::softmax_matmul(p);
#endif
  cpu::softmax_matmul(p);
}

// The CPU backend allocates its own small per-thread scratch, so it asks for no workspace.
// Sizes are computed for the validated problem: a size for an invalid problem would be meaningless.
size_t forward_workspace_size(const AttentionProblem& problem) {
  AttentionProblem unsized = problem;
  unsized.workspace = nullptr;
  const Backend backend = resolve_backend(unsized);
  const AttentionProblem p = host::validate_attention(unsized, host::Pass::forward, backend);
#ifdef TILEATTN_WITH_CUDA
  if (backend == Backend::cuda) return cuda::forward_workspace_size(p);
#else
  (void)p;
#endif
  return 0;
}

size_t backward_workspace_size(const AttentionProblem& problem) {
  AttentionProblem unsized = problem;
  unsized.workspace = nullptr;
  const Backend backend = resolve_backend(unsized);
  const AttentionProblem p = host::validate_attention(unsized, host::Pass::backward, backend);
#ifdef TILEATTN_WITH_CUDA
  if (backend == Backend::cuda) return cuda::backward_workspace_size(p);
#else
  (void)p;
#endif
  return 0;
}

size_t softmax_matmul_workspace_size(const SoftmaxMatmulProblem& problem) {
  SoftmaxMatmulProblem unsized = problem;
  unsized.workspace = nullptr;
  const Backend backend = resolve(unsized);
  const SoftmaxMatmulProblem p = host::validate_softmax_matmul(unsized, backend);
#ifdef TILEATTN_WITH_CUDA
  if (backend == Backend::cuda) return cuda::softmax_matmul_workspace_size(p);
#else
  (void)p;
#endif
  return 0;
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
