// The CPU backend's persistent pool (src/cpu/parallel.hpp): every task runs exactly once for any
// thread count, a task's exception reaches the caller, several caller threads may call at once,
// and a parallel_for inside a task runs instead of waiting for the pool it is part of. The same
// holds with an installed executor (as PyTorch's intra-op pool is installed), whose attention
// results equal the pool's bit for bit.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "cpu/parallel.hpp"
#include "support/host_problem.hpp"
#include "tileattn/attention.hpp"

namespace tileattn::cpu {
namespace {

TEST(ParallelFor, EveryTaskOnceForAnyThreadCount) {
  for (int threads : {0, 1, 2, 3, 8}) {
    for (int64_t tasks : {int64_t(0), int64_t(1), int64_t(2), int64_t(7), int64_t(1000)}) {
      std::vector<std::atomic<int>> runs(static_cast<size_t>(tasks));
      parallel_for(tasks, threads, [&](int64_t t) { runs[size_t(t)].fetch_add(1); });
      for (int64_t t = 0; t < tasks; ++t) ASSERT_EQ(runs[size_t(t)].load(), 1) << "threads " << threads << " task " << t;
    }
  }
}

TEST(ParallelFor, UsesSeveralThreadsWhenTasksWait) {
  // Each task waits until two distinct threads have arrived, so one thread alone cannot finish;
  // the pool's second thread must join (bounded wait, so a failure does not hang).
  std::atomic<int> arrived{0};
  std::mutex m;
  std::set<std::thread::id> ids;
  parallel_for(2, 2, [&](int64_t) {
    {
      std::lock_guard<std::mutex> lock(m);
      ids.insert(std::this_thread::get_id());
    }
    arrived.fetch_add(1);
    for (int i = 0; i < 2000 && arrived.load() < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  EXPECT_EQ(ids.size(), 2u);
}

TEST(ParallelFor, RethrowsATaskExceptionOnTheCaller) {
  for (int round = 0; round < 20; ++round) {
    std::atomic<int> ran{0};
    EXPECT_THROW(parallel_for(64, 2,
                              [&](int64_t t) {
                                ran.fetch_add(1);
                                if (t == 5) throw std::runtime_error("task 5");
                              }),
                 std::runtime_error);
    EXPECT_GE(ran.load(), 1);
  }
  // The pool still works afterwards.
  std::atomic<int64_t> sum{0};
  parallel_for(100, 2, [&](int64_t t) { sum.fetch_add(t); });
  EXPECT_EQ(sum.load(), 4950);
}

TEST(ParallelFor, ConcurrentCallersEachGetTheirResults) {
  constexpr int kCallers = 4, kRounds = 200;
  std::vector<int64_t> sums(kCallers, 0);
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c)
    callers.emplace_back([&, c] {
      for (int r = 0; r < kRounds; ++r) {
        std::vector<int64_t> out(size_t(50 + c), 0);
        parallel_for(int64_t(out.size()), 2 + c % 2, [&](int64_t t) { out[size_t(t)] = t * (c + 1); });
        for (int64_t v : out) sums[size_t(c)] += v;
      }
    });
  for (auto& t : callers) t.join();
  for (int c = 0; c < kCallers; ++c) {
    const int64_t n = 50 + c;
    EXPECT_EQ(sums[size_t(c)], int64_t(kRounds) * (c + 1) * n * (n - 1) / 2) << "caller " << c;
  }
}

TEST(ParallelFor, NestedCallRunsInsideATask) {
  std::vector<std::atomic<int>> runs(8 * 16);
  parallel_for(8, 2, [&](int64_t outer) {
    parallel_for(16, 2, [&](int64_t inner) { runs[size_t(outer * 16 + inner)].fetch_add(1); });
  });
  for (auto& r : runs) EXPECT_EQ(r.load(), 1);
}

// An executor of fresh threads, one per thread asked (the caller is one), recording its calls.
std::atomic<int> g_executor_calls{0}, g_executor_threads{0};

bool thread_executor(int threads, void (*work)(void*), void* job) {
  g_executor_calls.fetch_add(1);
  g_executor_threads.store(threads);
  std::vector<std::thread> helpers;
  for (int i = 1; i < threads; ++i) helpers.emplace_back([&] { work(job); });
  work(job);
  for (auto& t : helpers) t.join();
  return true;
}

// Declines every job: tileattn's own pool must run it.
bool declining_executor(int, void (*)(void*), void*) {
  g_executor_calls.fetch_add(1);
  return false;
}

// Runs nothing and says it ran: the caller must still finish every task.
bool idle_executor(int, void (*)(void*), void*) {
  g_executor_calls.fetch_add(1);
  return true;
}

// Installs an executor for one test and restores tileattn's own pool after it, also on failure.
struct ExecutorScope {
  explicit ExecutorScope(CpuExecutor e) {
    g_executor_calls.store(0);
    g_executor_threads.store(0);
    set_cpu_executor(e);
  }
  ~ExecutorScope() { set_cpu_executor(nullptr); }
};

TEST(ParallelForExecutor, EveryTaskOnceOnTheExecutor) {
  for (CpuExecutor e : {&thread_executor, &declining_executor, &idle_executor}) {
    ExecutorScope scope(e);
    for (int threads : {1, 2, 3, 8}) {
      for (int64_t tasks : {int64_t(0), int64_t(1), int64_t(2), int64_t(7), int64_t(1000)}) {
        std::vector<std::atomic<int>> runs(static_cast<size_t>(tasks));
        parallel_for(tasks, threads, [&](int64_t t) { runs[size_t(t)].fetch_add(1); });
        for (int64_t t = 0; t < tasks; ++t)
          ASSERT_EQ(runs[size_t(t)].load(), 1) << "threads " << threads << " task " << t;
      }
    }
    // Serial calls (one thread or one task) never reach it; the others all do.
    EXPECT_EQ(g_executor_calls.load(), 3 * 3) << "every call with 2+ threads and 2+ tasks";
  }
}

TEST(ParallelForExecutor, GetsTheThreadCountAndItsThreadsRunTasks) {
  ExecutorScope scope(&thread_executor);
  std::atomic<int> arrived{0};
  std::mutex m;
  std::set<std::thread::id> ids;
  parallel_for(3, 3, [&](int64_t) {
    {
      std::lock_guard<std::mutex> lock(m);
      ids.insert(std::this_thread::get_id());
    }
    arrived.fetch_add(1);
    for (int i = 0; i < 2000 && arrived.load() < 3; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  EXPECT_EQ(g_executor_calls.load(), 1);
  EXPECT_EQ(g_executor_threads.load(), 3);
  EXPECT_EQ(ids.size(), 3u);
}

TEST(ParallelForExecutor, RethrowsATaskExceptionAndNestsSerially) {
  ExecutorScope scope(&thread_executor);
  EXPECT_THROW(parallel_for(64, 2, [&](int64_t t) { if (t == 5) throw std::runtime_error("task 5"); }),
               std::runtime_error);
  std::vector<std::atomic<int>> runs(8 * 16);
  parallel_for(8, 2, [&](int64_t outer) {
    parallel_for(16, 2, [&](int64_t inner) { runs[size_t(outer * 16 + inner)].fetch_add(1); });
  });
  for (auto& r : runs) EXPECT_EQ(r.load(), 1);
  EXPECT_EQ(g_executor_calls.load(), 2) << "a nested parallel_for must not reach the executor";
}

TEST(ParallelForExecutor, ConcurrentCallers) {
  ExecutorScope scope(&thread_executor);
  constexpr int kCallers = 3, kRounds = 50;
  std::vector<int64_t> sums(kCallers, 0);
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c)
    callers.emplace_back([&, c] {
      for (int r = 0; r < kRounds; ++r) {
        std::vector<int64_t> out(size_t(40 + c), 0);
        parallel_for(int64_t(out.size()), 2, [&](int64_t t) { out[size_t(t)] = t * (c + 1); });
        for (int64_t v : out) sums[size_t(c)] += v;
      }
    });
  for (auto& t : callers) t.join();
  for (int c = 0; c < kCallers; ++c) {
    const int64_t n = 40 + c;
    EXPECT_EQ(sums[size_t(c)], int64_t(kRounds) * (c + 1) * n * (n - 1) / 2) << "caller " << c;
  }
}

// Whatever runs the tasks, attention's outputs are the pool's bit for bit (fp32, causal GQA with a
// window, both backward schedules: fused at 2 threads with 3 sequences, split at 5).
TEST(ParallelForExecutor, AttentionBitwiseAsOnThePool) {
  test::ProblemShape s;
  s.batch = 3;
  s.seqlen_q = 100;
  s.seqlen_k = 257;
  s.heads_q = 8;
  s.heads_kv = 2;
  s.headdim_qk = 48;
  s.headdim_v = 24;
  s.causal = true;
  s.window_left = 100;
  s.dtype = DType::f32;
  test::HostProblem hp(s);
  auto run = [&](int threads) {
    hp.poison_outputs();
    hp.problem.backend = Backend::cpu;
    hp.problem.num_threads = threads;
    tileattn::forward(hp.problem);
    tileattn::backward(hp.problem);
    return std::vector<std::vector<double>>{hp.o.gather(), hp.gather_lse(), hp.dq.gather(), hp.dk.gather(),
                                            hp.dv.gather()};
  };
  for (int threads : {2, 5}) {
    const auto on_pool = run(threads);
    ExecutorScope scope(&thread_executor);
    EXPECT_TRUE(on_pool == run(threads)) << "threads " << threads;
    EXPECT_GT(g_executor_calls.load(), 0);
  }
}

}  // namespace
}  // namespace tileattn::cpu
