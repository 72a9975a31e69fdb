#pragma once
// Whether the Hopper kernels may run: the device (compute capability 9.0), the caller
// (TILEATTN_CUDA_KERNELS=sm80 asks for the portable kernels, for tests and comparisons), and the
// build (a kernel compiled without sm_90a code has an empty body on this device).
namespace tileattn::cuda::sm90 {

// Device and environment. The forward and backward dispatchers know about the build from their
// instantiation macros (TILEATTN_CUDA_SM90_*); other kernels ask has_sm90a_code.
bool hopper_kernels_enabled();

// True when the current device runs sm_90a code of `kernel` (a __global__ function's address).
bool has_sm90a_code(const void* kernel);

}  // namespace tileattn::cuda::sm90
