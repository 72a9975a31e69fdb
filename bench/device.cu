#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "device.hpp"

namespace tileattn::bench::device {
namespace {

void check(cudaError_t status, const char* call) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(call) + " failed: " + cudaGetErrorName(status) + " (" +
                             cudaGetErrorString(status) + ")");
  }
}

// Events are freed even when the timed call throws; a destructor has no caller to report a
// failed cudaEventDestroy to, and the next checked call surfaces a broken context anyway.
struct Event {
  cudaEvent_t event = nullptr;
  Event() { check(cudaEventCreate(&event), "cudaEventCreate"); }
  ~Event() { cudaEventDestroy(event); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
};

}  // namespace

void* allocate(size_t bytes) {
  void* p = nullptr;
  const cudaError_t status = cudaMalloc(&p, bytes);
  if (status != cudaSuccess) {
    cudaGetLastError();  // an out-of-memory error is not sticky; clear it so later calls proceed
    throw std::runtime_error("cudaMalloc of " + std::to_string(bytes) + " bytes failed: " + cudaGetErrorString(status));
  }
  return p;
}

void release(void* p) { check(cudaFree(p), "cudaFree"); }

void upload(void* dst, const void* src, size_t bytes) {
  check(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy (host to device)");
}

void download(void* dst, const void* src, size_t bytes) {
  check(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy (device to host)");
}

void synchronize() { check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }

size_t total_memory() {
  size_t free = 0, total = 0;
  check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  return total;
}

double time_ms(const std::function<void()>& run) {
  Event start, stop;
  check(cudaEventRecord(start.event, nullptr), "cudaEventRecord");
  run();
  check(cudaGetLastError(), "kernel launch");
  check(cudaEventRecord(stop.event, nullptr), "cudaEventRecord");
  check(cudaEventSynchronize(stop.event), "cudaEventSynchronize");
  float ms = 0.0f;
  check(cudaEventElapsedTime(&ms, start.event, stop.event), "cudaEventElapsedTime");
  return double(ms);
}

std::string describe() {
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
  return std::string(prop.name) + " (sm_" + std::to_string(prop.major) + std::to_string(prop.minor) + ", " +
         std::to_string(prop.multiProcessorCount) + " SMs)";
}

}  // namespace tileattn::bench::device
