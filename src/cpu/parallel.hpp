#pragma once
// Runs body(task) for task in [0, tasks) on up to `num_threads` threads (0 = all hardware
// threads): the caller and the workers of one process-wide pool that lives for the whole process.
// Starting OS threads on every call cost ~65 us, more than a whole seqlen-1 attention call.
//
// Tasks are handed out one at a time from an atomic counter, so uneven tasks (causal tiles)
// balance. Each task must write memory no other task writes; which thread runs a task does not
// change its result, so outputs are bitwise identical for any thread count. The first exception
// a task throws is rethrown on the caller's thread once no thread is inside the call any more.
//
// Calls from several caller threads at once are safe: the pool runs one call at a time, the
// others wait for it. A parallel_for inside a task (on a pool worker, or on the caller during a
// call) runs serially on that thread instead of waiting for the pool it is part of.
//
// A program with a pool of its own may install an executor instead (tileattn/cpu_executor.hpp);
// the tasks, and which task computes what, stay the same.
#include <algorithm>
#include <cstdint>
#include <thread>
#include <type_traits>

#include "tileattn/cpu_executor.hpp"

namespace tileattn::cpu {

inline int resolve_threads(int num_threads) {
  if (num_threads > 0) return num_threads;
  const unsigned hw = std::thread::hardware_concurrency();
  return hw ? int(hw) : 1;
}

// Threads worth using for `flops` of work, at most `num_threads` (0 = all): one per ~0.1 ms of
// single-thread work, so that a tiny call runs on the caller alone instead of paying to hand its
// tasks to the pool (a seqlen-1 call measured 15 us on one thread, 21 us on two). Results do not
// depend on the thread count.
inline int threads_for(int num_threads, double flops) {
  constexpr double kFlopsPerThread = 4e6;
  const double useful = std::max(1.0, flops / kFlopsPerThread);
  return int(std::min<double>(resolve_threads(num_threads), useful));
}

namespace detail {

using TaskFn = void (*)(void* context, int64_t task);

// Runs fn(context, t) for every t on up to `threads` threads, the caller included (the installed
// executor's, or the caller plus threads - 1 pool workers); returns once every task has finished,
// rethrowing the first exception.
void run_parallel(int64_t tasks, int threads, TaskFn fn, void* context);

// True on a thread while it runs tasks of a parallel_for (a pool worker, an executor's thread, a
// caller during its call).
bool inside_parallel_region();

}  // namespace detail

template <class Body>
void parallel_for(int64_t tasks, int num_threads, Body&& body) {
  const int threads = int(std::min<int64_t>(resolve_threads(num_threads), tasks));
  if (threads <= 1 || detail::inside_parallel_region()) {
    for (int64_t t = 0; t < tasks; ++t) body(t);
    return;
  }
  using B = std::remove_reference_t<Body>;
  detail::run_parallel(tasks, threads, [](void* context, int64_t t) { (*static_cast<B*>(context))(t); },
                       const_cast<void*>(static_cast<const void*>(&body)));
}

}  // namespace tileattn::cpu
