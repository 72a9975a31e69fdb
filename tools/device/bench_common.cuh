// Shared by the device benchmarks (bench_attention.cu, bench_fp32.cu, read_bandwidth.cu): CUDA
// error checks, a deterministic bf16 fill and event-timed runs. Each harness keeps its own run counts so
// its figures stay comparable with earlier measurements and with its PyTorch peer (peers.py).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace bench {

inline void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(status));
    std::exit(1);
  }
}

// Values in [-1, 1) from a hash of the index, so inputs need no host round trip.
__global__ void fill_random(__nv_bfloat16* x, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    unsigned h = unsigned(i) * 2654435761u ^ seed;
    h ^= h >> 13, h *= 0x5bd1e995u, h ^= h >> 15;
    x[i] = __float2bfloat16(float(h & 0xffff) / 32768.0f - 1.0f);
  }
}

// Warm-up calls, then timed calls until at least min_runs and either budget_ms of kernel time or
// max_runs; the median resists the odd slow run (clock ramp, another process).
struct Timing {
  int warmup;
  int min_runs;
  float budget_ms;
  int max_runs;
};

// The timed calls' times in ms, sorted.
template <class F>
std::vector<float> timed_runs(const Timing& t, F&& run) {
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  for (int i = 0; i < t.warmup; ++i) run();
  check(cudaDeviceSynchronize(), "warm-up");
  std::vector<float> times;
  float total = 0.0f;
  while (int(times.size()) < t.min_runs || (total < t.budget_ms && int(times.size()) < t.max_runs)) {
    check(cudaEventRecord(start), "cudaEventRecord");
    run();
    check(cudaEventRecord(stop), "cudaEventRecord");
    check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0.0f;
    check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    times.push_back(ms);
    total += ms;
  }
  cudaEventDestroy(start), cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  return times;
}

template <class F>
double median_ms(const Timing& t, F&& run) {
  const std::vector<float> times = timed_runs(t, run);
  return times[times.size() / 2];
}

}  // namespace bench
