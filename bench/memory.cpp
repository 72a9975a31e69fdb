#include "memory.hpp"

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <utility>

#ifdef TILEATTN_WITH_CUDA
#include "device.hpp"
#endif

namespace tileattn::bench {
namespace {

// Host buffers are aligned like device allocations so the CPU backend sees vector-friendly data.
constexpr size_t kHostAlignment = 256;

int64_t status_field_bytes(const char* field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  const size_t n = std::strlen(field);
  while (std::getline(status, line)) {
    if (line.compare(0, n, field) == 0) return std::stoll(line.substr(n + 1)) * 1024;  // "VmRSS:  123 kB"
  }
  return -1;
}

}  // namespace

AllocationStats& allocation_stats(Backend where) {
  static AllocationStats host, device;
  return where == Backend::cuda ? device : host;
}

Buffer::Buffer(Backend where, size_t bytes) : where_(where), bytes_(bytes) {
  if (bytes == 0) return;
  if (where == Backend::cuda) {
#ifdef TILEATTN_WITH_CUDA
    data_ = device::allocate(bytes);
#else
    throw std::runtime_error("this build has no CUDA");
#endif
  } else {
    data_ = std::aligned_alloc(kHostAlignment, (bytes + kHostAlignment - 1) / kHostAlignment * kHostAlignment);
    if (data_ == nullptr) {
      throw std::runtime_error("allocating " + std::to_string(bytes) + " bytes of host memory failed (out of memory)");
    }
  }
  AllocationStats& s = allocation_stats(where);
  s.live += bytes;
  if (s.live > s.peak) s.peak = s.live;
}

Buffer::~Buffer() { release(); }

Buffer::Buffer(Buffer&& other) noexcept
    : where_(other.where_), data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    release();
    where_ = other.where_;
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void Buffer::release() {
  if (data_ == nullptr) return;
  if (where_ == Backend::cuda) {
#ifdef TILEATTN_WITH_CUDA
    device::release(data_);
#endif
  } else {
    std::free(data_);
  }
  allocation_stats(where_).live -= bytes_;
  data_ = nullptr;
  bytes_ = 0;
}

void Buffer::upload(const void* host) {
  if (where_ == Backend::cuda) {
#ifdef TILEATTN_WITH_CUDA
    device::upload(data_, host, bytes_);
#endif
  } else if (bytes_ > 0) {
    std::memcpy(data_, host, bytes_);
  }
}

void Buffer::download(void* host) const {
  if (where_ == Backend::cuda) {
#ifdef TILEATTN_WITH_CUDA
    device::download(host, data_, bytes_);
#endif
  } else if (bytes_ > 0) {
    std::memcpy(host, data_, bytes_);
  }
}

int64_t current_rss_bytes() { return status_field_bytes("VmRSS:"); }
int64_t peak_rss_bytes() { return status_field_bytes("VmHWM:"); }

bool reset_peak_rss() {
  // Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
  std::ofstream clear("/proc/self/clear_refs");
  if (!clear) return false;
  clear << "5";
  clear.flush();
  return bool(clear);
}

}  // namespace tileattn::bench
