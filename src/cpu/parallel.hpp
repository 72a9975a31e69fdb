#pragma once
// Runs body(task) for task in [0, tasks) on up to `num_threads` std::threads (0 = all hardware
// threads). Tasks are handed out one at a time from an atomic counter, so uneven tasks (causal
// tiles) balance. Each task must write memory no other task writes; which thread runs a task
// does not change its result, so outputs are deterministic. The first exception a task throws
// is rethrown on the caller's thread after all threads have joined.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace tileattn::cpu {

inline int resolve_threads(int num_threads) {
  if (num_threads > 0) return num_threads;
  const unsigned hw = std::thread::hardware_concurrency();
  return hw ? int(hw) : 1;
}

template <class Body>
void parallel_for(int64_t tasks, int num_threads, Body&& body) {
  const int threads = int(std::min<int64_t>(resolve_threads(num_threads), tasks));
  if (threads <= 1) {
    for (int64_t t = 0; t < tasks; ++t) body(t);
    return;
  }
  std::atomic<int64_t> next{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto worker = [&] {
    try {
      for (int64_t t = next++; t < tasks; t = next++) body(t);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
      next = tasks;  // let the other threads run out
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(size_t(threads - 1));
  for (int i = 1; i < threads; ++i) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace tileattn::cpu
