#include "cuda/cuda_backend.hpp"
#include "tileattn/error.hpp"

namespace tileattn::cuda {

void softmax_matmul(const SoftmaxMatmulProblem&) {
  throw Error(ErrorKind::unsupported, "softmax_matmul on CUDA is not built yet");
}

size_t softmax_matmul_workspace_size(const SoftmaxMatmulProblem&) { return 0; }

}  // namespace tileattn::cuda
