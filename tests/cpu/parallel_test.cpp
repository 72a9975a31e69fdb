// The CPU backend's persistent pool (src/cpu/parallel.hpp): every task runs exactly once for any
// thread count, a task's exception reaches the caller, several caller threads may call at once,
// and a parallel_for inside a task runs instead of waiting for the pool it is part of.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "cpu/parallel.hpp"

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

}  // namespace
}  // namespace tileattn::cpu
