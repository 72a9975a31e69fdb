// The process-wide worker pool behind parallel_for, and the hand-over to an installed executor
// (see parallel.hpp).
//
// A call posts a job (a new generation) and works on it itself; workers that wake in time join.
// When the tasks run out the caller closes the job and waits only for the workers that joined,
// never for one that has not woken yet: a tiny job costs the caller its own work and two
// uncontended locks, not a thread wake-up. A worker that wakes after the close sees a closed job
// and goes back to waiting.
#include "cpu/parallel.hpp"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <vector>

#include <pthread.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace tileattn::cpu::detail {
namespace {

thread_local bool t_in_region = false;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// How long an idle worker polls for the next job before it sleeps. Back-to-back calls (forward,
// then the backward's passes) then find it awake, where a sleeping one costs a futex wake-up
// (~5-50 us on a VM) per call.
constexpr auto kSpin = std::chrono::microseconds(100);

// One parallel_for: whichever threads run it (the pool's, an executor's, the caller) claim its
// tasks from `next` until none are left.
struct Job {
  Job(int64_t tasks_, TaskFn fn_, void* context_) : tasks(tasks_), fn(fn_), context(context_) {}
  int64_t tasks;
  TaskFn fn;
  void* context;
  std::atomic<int64_t> next{0};
  std::mutex m;  // guards error
  std::exception_ptr error;
};

// Claims and runs tasks until none are left; the first exception is kept and ends the others' claims.
void run_tasks(Job& job) {
  for (int64_t t = job.next.fetch_add(1, std::memory_order_relaxed); t < job.tasks;
       t = job.next.fetch_add(1, std::memory_order_relaxed)) {
    try {
      job.fn(job.context, t);
    } catch (...) {
      std::lock_guard<std::mutex> lock(job.m);
      if (!job.error) job.error = std::current_exception();
      job.next.store(job.tasks, std::memory_order_relaxed);  // the others run out
    }
  }
}

class Pool {
 public:
  void run(int64_t tasks, int helpers, TaskFn fn, void* context) {
    std::lock_guard<std::mutex> call(call_mutex_);
    grow(helpers);
    Job job{tasks, fn, context};
    {
      std::lock_guard<std::mutex> lock(m_);
      job_ = &job;
      helpers_ = helpers;
      open_ = true;
      generation_.store(generation_.load(std::memory_order_relaxed) + 1, std::memory_order_release);
      if (sleepers_ > 0) wake_.notify_all();
    }
    t_in_region = true;
    run_tasks(job);
    t_in_region = false;
    {
      // The job lives on this frame: every worker that joined it is out before it goes.
      std::unique_lock<std::mutex> lock(m_);
      open_ = false;
      done_.wait(lock, [&] { return entered_ == 0; });
      job_ = nullptr;
    }
    if (job.error) std::rethrow_exception(job.error);
  }

 private:
  // Under call_mutex_: at least `helpers` workers exist.
  void grow(int helpers) {
    while (int(workers_.size()) < helpers) {
      // The worker starts from the current generation, whenever its thread gets going: the job
      // about to be posted is new to it.
      const int index = int(workers_.size());
      const uint64_t seen = generation_.load(std::memory_order_relaxed);
      workers_.emplace_back([this, index, seen] { worker(index, seen); });
      workers_.back().detach();  // the pool lives as long as the process
    }
  }

  void worker(int index, uint64_t seen) {
    t_in_region = true;
    for (;;) {
      const auto spin_end = std::chrono::steady_clock::now() + kSpin;
      while (generation_.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < spin_end)
        for (int i = 0; i < 64; ++i) cpu_relax();
      std::unique_lock<std::mutex> lock(m_);
      if (generation_.load(std::memory_order_relaxed) == seen) {
        ++sleepers_;
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_relaxed) != seen; });
        --sleepers_;
      }
      seen = generation_.load(std::memory_order_relaxed);
      if (!open_ || index >= helpers_) continue;
      ++entered_;
      Job& job = *job_;
      lock.unlock();
      run_tasks(job);
      lock.lock();
      if (--entered_ == 0 && !open_) done_.notify_one();
    }
  }

  std::mutex call_mutex_;  // one call at a time
  std::vector<std::thread> workers_;

  std::mutex m_;  // guards the fields below
  std::condition_variable wake_, done_;
  std::atomic<uint64_t> generation_{0};
  bool open_ = false;
  int entered_ = 0, sleepers_ = 0, helpers_ = 0;
  Job* job_ = nullptr;  // the open call's job (on its caller's stack)
};

std::atomic<Pool*> g_pool{nullptr};

std::atomic<CpuExecutor> g_executor{nullptr};

// The work an executor runs on each of its threads: the job's tasks, inside a parallel region.
void drain(void* raw) {
  const bool outer = t_in_region;  // a caller's own flag comes back when it returns
  t_in_region = true;
  run_tasks(*static_cast<Job*>(raw));
  t_in_region = outer;
}

// A forked child has none of the parent's workers and may have inherited locked mutexes: it
// starts a pool of its own (the parent's is left behind, unused).
void forget_pool_in_child() { g_pool.store(nullptr, std::memory_order_relaxed); }

Pool& pool() {
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p) return *p;
  static const bool registered = (pthread_atfork(nullptr, nullptr, forget_pool_in_child), true);
  (void)registered;
  Pool* fresh = new Pool;  // never deleted: workers may outlive static destructors at exit
  if (g_pool.compare_exchange_strong(p, fresh, std::memory_order_acq_rel)) return *fresh;
  delete fresh;
  return *p;
}

}  // namespace

void run_parallel(int64_t tasks, int threads, TaskFn fn, void* context) {
  if (const CpuExecutor executor = g_executor.load(std::memory_order_acquire)) {
    Job job{tasks, fn, context};
    if (executor(threads, drain, &job)) {
      drain(&job);  // whatever the executor's threads left (none, when it ran work at least once)
      if (job.error) std::rethrow_exception(job.error);
      return;
    }
  }
  pool().run(tasks, threads - 1, fn, context);
}

bool inside_parallel_region() { return t_in_region; }

}  // namespace tileattn::cpu::detail

namespace tileattn {

void set_cpu_executor(CpuExecutor executor) { cpu::detail::g_executor.store(executor, std::memory_order_release); }

}  // namespace tileattn
