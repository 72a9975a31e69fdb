#include "cuda/arch/hopper_available.hpp"

#include <cstdlib>
#include <cstring>

#include "cuda/common/runtime_cache.hpp"

namespace tileattn::cuda::sm90 {

bool hopper_kernels_enabled() {
  const char* forced = std::getenv("TILEATTN_CUDA_KERNELS");
  if (forced != nullptr && std::strcmp(forced, "sm80") == 0) return false;
  const DeviceProps& d = device_props();
  return d.major == 9 && d.minor == 0;
}

bool has_sm90a_code(const void* kernel) { return kernel_binary_version(kernel) == 90; }

}  // namespace tileattn::cuda::sm90
