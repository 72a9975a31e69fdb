// The CUDA backward entry: dispatches a validated problem to the backward kernels.
#include "cuda/cuda_backend.hpp"
#include "tileattn/error.hpp"

namespace tileattn::cuda {

void backward(const AttentionProblem&) {
  throw Error(ErrorKind::unsupported, "backward on CUDA is not built yet");
}

size_t backward_workspace_size(const AttentionProblem&) { return 0; }

}  // namespace tileattn::cuda
