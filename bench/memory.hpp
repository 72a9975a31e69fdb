#pragma once
// Buffers the bench allocates on the host or the device, with a running count of the bytes it
// holds on each: the device's peak memory is this count (the bench hands the library its
// workspace, so the library allocates nothing itself), the host's adds the RSS growth.
#include <cstddef>
#include <cstdint>

#include "tileattn/problem.hpp"

namespace tileattn::bench {

struct AllocationStats {
  size_t live = 0;
  size_t peak = 0;  // since the last reset_peak()
  void reset_peak() { peak = live; }
};
AllocationStats& allocation_stats(Backend where);

class Buffer {
 public:
  Buffer() = default;
  Buffer(Backend where, size_t bytes);
  ~Buffer();
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  void upload(const void* host);    // bytes() bytes from host memory
  void download(void* host) const;  // bytes() bytes to host memory

 private:
  void release();
  Backend where_ = Backend::cpu;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// Host memory of this process from /proc (Linux); -1 where unavailable.
int64_t current_rss_bytes();
int64_t peak_rss_bytes();
// Restarts the peak at the current RSS; false where the kernel does not support it.
bool reset_peak_rss();

}  // namespace tileattn::bench
