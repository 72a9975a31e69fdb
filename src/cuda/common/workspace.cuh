#pragma once
// Scratch memory for one call: the caller's buffer when it is large enough (the Python layer
// passes memory from PyTorch's caching allocator, which keeps CUDA-graph capture working),
// otherwise stream-ordered memory that is freed on the same stream when the call ends.
#include <cuda_runtime.h>

#include <cstddef>

#include "check.cuh"
#include "tileattn/error.hpp"

namespace tileattn::cuda {

class Workspace {
 public:
  Workspace(void* caller, size_t caller_bytes, size_t needed, cudaStream_t stream) : stream_(stream) {
    if (needed == 0) return;
    if (caller != nullptr) {
      if (caller_bytes < needed)
        throw Error(ErrorKind::invalid_argument, "workspace_bytes=" + std::to_string(caller_bytes) +
                                                     " is smaller than the " + std::to_string(needed) +
                                                     " bytes this call needs (see *_workspace_size)");
      base_ = static_cast<char*>(caller);
      return;
    }
    TA_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&base_), needed, stream_));
    owned_ = true;
  }
  ~Workspace() {
    if (owned_) cudaFreeAsync(base_, stream_);  // a failure here cannot be reported from a destructor
  }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  // Carves `bytes` (rounded up to 256 for alignment) off the front; callers size the whole
  // workspace with the same sequence of take() sizes through workspace_bytes_for().
  template <class T>
  T* take(size_t bytes) {
    T* p = reinterpret_cast<T*>(base_ + offset_);
    offset_ += round_up(bytes);
    return p;
  }
  static size_t round_up(size_t bytes) { return (bytes + 255) / 256 * 256; }

 private:
  cudaStream_t stream_;
  char* base_ = nullptr;
  size_t offset_ = 0;
  bool owned_ = false;
};

}  // namespace tileattn::cuda
