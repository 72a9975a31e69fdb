#pragma once
// The CUDA runtime calls the bench makes itself (CUDA builds only). Every call is checked and a
// failure throws std::runtime_error naming the call.
#include <cstddef>
#include <functional>
#include <string>

namespace tileattn::bench::device {

void* allocate(size_t bytes);
void release(void* p);
void upload(void* dst, const void* src, size_t bytes);
void download(void* dst, const void* src, size_t bytes);
void synchronize();
size_t total_memory();  // bytes of the current device's memory

// Milliseconds `run` takes on the legacy default stream, measured with events around it.
double time_ms(const std::function<void()>& run);

// e.g. "NVIDIA H100 80GB HBM3 (sm_90, 132 SMs)".
std::string describe();

}  // namespace tileattn::bench::device
