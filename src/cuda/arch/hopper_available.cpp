#include "cuda/arch/hopper_available.hpp"

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>

#include "cuda/common/check.cuh"

namespace tileattn::cuda::sm90 {

bool hopper_kernels_enabled() {
  const char* forced = std::getenv("TILEATTN_CUDA_KERNELS");
  if (forced != nullptr && std::strcmp(forced, "sm80") == 0) return false;
  int device = 0, major = 0, minor = 0;
  TA_CUDA_CHECK(cudaGetDevice(&device));
  TA_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  TA_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return major == 9 && minor == 0;
}

bool has_sm90a_code(const void* kernel) {
  cudaFuncAttributes attr{};
  TA_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  return attr.binaryVersion == 90;
}

}  // namespace tileattn::cuda::sm90
