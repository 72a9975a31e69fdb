#pragma once
// The public entry points. Each validates its problem (src/host/validate.cpp is the only place
// rules live), picks a backend and runs. Errors are thrown as tileattn::Error.
#include <cstddef>

#include "tileattn/error.hpp"
#include "tileattn/problem.hpp"

namespace tileattn {

// Writes O and L (log-sum-exp) from Q, K, V.
void forward(const AttentionProblem& problem);

// Writes dQ, dK, dV from Q, K, V, O, dO and L (as written by forward with the same options).
void backward(const AttentionProblem& problem);

// out = softmax(X, dim=-1) @ V, without materialising softmax(X).
void softmax_matmul(const SoftmaxMatmulProblem& problem);

// Scratch each call needs on the chosen backend, in bytes (0 when none). Pass at least this
// much through `workspace` to keep the library from allocating (e.g. under CUDA-graph capture).
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
