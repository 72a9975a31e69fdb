#include "timing.hpp"

#include <algorithm>
#include <chrono>
#include <vector>

#include "memory.hpp"

#ifdef TILEATTN_WITH_CUDA
#include "device.hpp"
#endif

namespace tileattn::bench {

Measurement measure(Backend backend, int warmup, int iters, const std::function<void()>& run, Progress* progress,
                    const std::string& task) {
  Measurement m;
  ProgressTask report(progress, task);
  const bool host = backend != Backend::cuda;
  const bool rss = host && reset_peak_rss();
  const int64_t rss_base = rss ? current_rss_bytes() : -1;

  for (int i = 0; i < warmup; ++i) {
    report.step("warmup run " + std::to_string(i + 1) + " of " + std::to_string(warmup));
    run();
  }
#ifdef TILEATTN_WITH_CUDA
  if (!host) device::synchronize();
#endif
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    report.step("timed run " + std::to_string(i + 1) + " of " + std::to_string(iters));
#ifdef TILEATTN_WITH_CUDA
    if (!host) {
      ms.push_back(device::time_ms(run));
      continue;
    }
#endif
    const auto t0 = std::chrono::steady_clock::now();
    run();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  m.min_ms = ms.front();
  m.median_ms = ms.size() % 2 ? ms[ms.size() / 2] : 0.5 * (ms[ms.size() / 2 - 1] + ms[ms.size() / 2]);
  m.bench_bytes = allocation_stats(backend).peak;
  if (rss && rss_base >= 0) m.rss_growth_bytes = std::max<int64_t>(0, peak_rss_bytes() - rss_base);
  return m;
}

}  // namespace tileattn::bench
