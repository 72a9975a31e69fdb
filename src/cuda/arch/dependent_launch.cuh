#pragma once
// Programmatic dependent launch (Hopper on): a kernel is launched while the kernel before it still
// runs, so its launch latency and block start-up overlap the other's tail -- the split-KV combine
// after the split forward, which reads what that kernel wrote. The dependent waits in
// griddepcontrol.wait until the primary grid has finished and its writes are visible; the
// primary may let the dependent's blocks start early with griddepcontrol.launch_dependents. On
// GPUs before sm_90 the launch is an ordinary one and both instructions compile to nothing.
// Independent work is better given one grid than a dependent launch: a dependent's blocks that
// ran beside a still-running primary ran up to 3.3x slower than alone (docs/perf-log.md).
#include <cuda_runtime.h>

#include <utility>

#include "cuda/common/check.cuh"
#include "cuda/common/runtime_cache.hpp"

namespace tileattn::cuda {

// In the dependent kernel, before its first read of the primary's output.
__device__ __forceinline__ void wait_for_primary_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// In the primary kernel: its dependent may start once every block of this grid has called this or
// exited (a grid of several waves lets it start during its last); the dependent's blocks still
// wait for this grid's end before reading.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Launches `kernel` (with `smem_bytes` of dynamic shared memory) on `stream` as a programmatic
// dependent of the work before it there; `what` names the launch in the error.
template <class... Params, class... Args>
void launch_dependent(const char* what, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                      cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  if (device_props().major >= 9) {
    config.attrs = attribute;
    config.numAttrs = 1;
  }
  const cudaError_t status = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  if (status != cudaSuccess) throw_cuda_error(status, what, __FILE__, __LINE__);
}

}  // namespace tileattn::cuda
