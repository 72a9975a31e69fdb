#include "cuda/fp32/forward_fp32.hpp"

#include "tileattn/error.hpp"

namespace tileattn::cuda {

void forward_fp32(const AttentionProblem&) {
  throw Error(ErrorKind::unsupported, "fp32 forward on CUDA is not built yet");
}

size_t forward_fp32_workspace_size(const AttentionProblem&) { return 0; }

}  // namespace tileattn::cuda
