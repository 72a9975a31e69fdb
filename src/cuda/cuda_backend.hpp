#pragma once
// The CUDA backend's entry points, declared in plain C++ so that src/host needs no CUDA headers.
// Each plan takes a problem already validated and normalised by src/host/validate.hpp, with
// tensors in device memory, and runs on problem.stream. Only compiled when the build has CUDA
// (TILEATTN_WITH_CUDA); src/host reports a clear error otherwise.
#include <cstddef>
#include <memory>

#include "common/backend_plan.hpp"
#include "tileattn/problem.hpp"

namespace tileattn::cuda {

bool device_available();
// True when p is device (or managed) memory of the current device.
bool is_device_pointer(const void* p);
// Copies `count` int32 values from device memory to host (for validating cu_seqlens).
void copy_to_host(int* dst, const int* src, long long count, void* stream);
// True while `stream` (a cudaStream_t; nullptr = legacy default) is being captured into a graph.
bool stream_is_capturing(void* stream);

// Plans for validated problems (src/host/validate.hpp) whose tensors are device memory.
std::unique_ptr<detail::BackendPlan> plan_forward(const AttentionProblem& problem);
std::unique_ptr<detail::BackendPlan> plan_backward(const AttentionProblem& problem);
std::unique_ptr<detail::BackendPlan> plan_softmax_matmul(const SoftmaxMatmulProblem& problem);

// The forward kernel family that runs this problem on the current device: "sm90" (TMA + wgmma),
// "sm80" (mma.sync), "fp32", or "none" for an empty problem. For tests and benchmark labels.
const char* forward_kernel_name(const AttentionProblem& problem);

}  // namespace tileattn::cuda
