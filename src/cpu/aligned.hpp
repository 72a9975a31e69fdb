#pragma once
// Tile scratch aligned to a cache line. The tile loops load and store rows in 32-byte
// vectors; from malloc's 16-byte alignment (and the 16-byte header of its large, mmap'd blocks)
// every other vector of a 64-float row straddled two cache lines.
#include <cstddef>
#include <new>
#include <vector>

namespace tileattn::cpu {

constexpr std::size_t kCacheLine = 64;

template <class T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <class U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(kCacheLine))); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(kCacheLine)); }
  template <class U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
};

// std::vector whose data starts on a cache line.
template <class T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

}  // namespace tileattn::cpu
