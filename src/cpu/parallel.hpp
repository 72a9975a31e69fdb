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
// An embedding layer with a thread pool of its own (PyTorch's intra-op pool) may install an
// Executor instead (set_executor): then one pool serves the process. Two pools on the same cores
// compete: torch's OpenMP workers spin-wait for milliseconds after each of torch's calls, on the
// cores a following tileattn call wants (measured: a 17 ms forward took 20.5-22.5 ms right after
// a torch SDPA call, 17-18 ms with OMP_WAIT_POLICY=passive). The executor only supplies threads;
// the tasks, and which task computes what, stay the same, so results are bitwise identical
// whatever runs them.
#include <algorithm>
#include <cstdint>
#include <thread>
#include <type_traits>

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

// Runs work(job) on up to `threads` threads at once, the caller among them, and returns once every
// call has returned. work claims tasks until none are left, so a call that starts late, or runs
// after another on the same thread, finds nothing to do: an executor may start fewer calls than
// `threads` (at least one, on the caller or not). work never throws. Returns false, having run
// nothing, to leave the job to tileattn's own pool (e.g. more threads asked than it has).
using Executor = bool (*)(int threads, void (*work)(void* job), void* job);

// Installs the executor every later parallel_for of this library uses; nullptr restores tileattn's
// own pool. Safe to call at any time: a call in flight finishes on what it started with.
void set_executor(Executor executor);

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
