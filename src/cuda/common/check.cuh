#pragma once
// Every CUDA runtime call and every launch goes through these: a failure becomes a
// tileattn::Error(device) naming the call, the file:line and CUDA's own message.
#include <cuda_runtime.h>

#include <string>

#include "tileattn/error.hpp"

namespace tileattn::cuda {

[[noreturn]] inline void throw_cuda_error(cudaError_t status, const char* what, const char* file, int line) {
  throw Error(ErrorKind::device, std::string(what) + " failed at " + file + ":" + std::to_string(line) + ": " +
                                     cudaGetErrorName(status) + " (" + cudaGetErrorString(status) + ")");
}

}  // namespace tileattn::cuda

#define TA_CUDA_CHECK(call)                                                            \
  do {                                                                                 \
    cudaError_t ta_status_ = (call);                                                   \
    if (ta_status_ != cudaSuccess)                                                     \
      ::tileattn::cuda::throw_cuda_error(ta_status_, #call, __FILE__, __LINE__);        \
  } while (0)

// After a <<<...>>> launch: catches bad configurations (too much shared memory, ...) at once;
// faults inside the kernel surface at the next synchronising call, which is checked too.
#define TA_CUDA_CHECK_LAUNCH(name)                                                     \
  do {                                                                                 \
    cudaError_t ta_status_ = cudaGetLastError();                                       \
    if (ta_status_ != cudaSuccess)                                                     \
      ::tileattn::cuda::throw_cuda_error(ta_status_, "launch of " name, __FILE__, __LINE__); \
  } while (0)
