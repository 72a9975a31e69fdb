#include "cuda/common/runtime_cache.hpp"

#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <utility>

#include "cuda/common/check.cuh"

namespace tileattn::cuda {
namespace {

std::mutex g_mutex;

int current_device() {
  int device = 0;
  TA_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

}  // namespace

const DeviceProps& device_props() {
  static std::map<int, DeviceProps> cache;  // node-based: references stay valid as it grows
  const int device = current_device();
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  DeviceProps d;
  TA_CUDA_CHECK(cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, device));
  TA_CUDA_CHECK(cudaDeviceGetAttribute(&d.minor, cudaDevAttrComputeCapabilityMinor, device));
  TA_CUDA_CHECK(cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, device));
  TA_CUDA_CHECK(cudaDeviceGetAttribute(&d.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return cache.emplace(device, d).first->second;
}

int kernel_binary_version(const void* kernel) {
  static std::map<std::pair<const void*, int>, int> versions;  // (kernel, device) -> binaryVersion
  const int device = current_device();
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = versions.find({kernel, device});
  if (it != versions.end()) return it->second;
  cudaFuncAttributes attr{};
  TA_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  return versions.emplace(std::make_pair(kernel, device), attr.binaryVersion).first->second;
}

void allow_dynamic_smem(const void* kernel, int bytes) {
  static std::map<std::pair<const void*, int>, int> allowed;  // (kernel, device) -> bytes
  const int device = current_device();
  std::lock_guard<std::mutex> lock(g_mutex);
  int& done = allowed[{kernel, device}];
  if (bytes <= done) return;
  TA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  done = bytes;
}

}  // namespace tileattn::cuda
