#pragma once
// Timing and peak memory of one pass.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "progress.hpp"
#include "tileattn/problem.hpp"

namespace tileattn::bench {

struct Measurement {
  double median_ms = 0, min_ms = 0;
  size_t bench_bytes = 0;         // peak bytes the bench held on the backend (see memory.hpp)
  int64_t rss_growth_bytes = -1;  // host: peak RSS growth over the runs; -1 on the device
};

// Runs `run` warmup + iters times; times each of the last `iters` (host clock on the CPU, events
// on the CUDA default stream). bench_bytes is the allocation peak since the caller's last
// allocation_stats(backend).reset_peak(). With `progress`, the runs are reported there as `task`.
Measurement measure(Backend backend, int warmup, int iters, const std::function<void()>& run,
                    Progress* progress = nullptr, const std::string& task = "");

}  // namespace tileattn::bench
