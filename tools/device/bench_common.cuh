// Shared by the device benchmarks (bench_attention.cu, bench_fp32.cu, read_bandwidth.cu): CUDA
// error checks, deterministic bf16 and fp32 fills and event-timed runs. Each harness keeps its own
// run counts so its figures stay comparable with earlier measurements and with its PyTorch peer
// (peers.py).
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

__device__ __forceinline__ unsigned hash_index(size_t i, unsigned seed) {
  unsigned h = unsigned(i) * 2654435761u ^ seed;
  h ^= h >> 13, h *= 0x5bd1e995u, h ^= h >> 15;
  return h;
}

// Values in [-1, 1) from a hash of the index, so inputs need no host round trip.
__global__ void fill_random(__nv_bfloat16* x, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    x[i] = __float2bfloat16(float(hash_index(i, seed) & 0xffff) / 32768.0f - 1.0f);
}

// The same range with all 24 bits of an fp32 significand used (zero low bits would make the exact
// mode's split parts zero, and the tensor cores draw less power on zeros).
__global__ void fill_random(float* x, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    x[i] = float(hash_index(i, seed) >> 8) / 8388608.0f - 1.0f;
}

// Warm-up calls, then timed calls until at least min_runs and either budget_ms of kernel time or
// max_runs; the median resists the odd slow run (clock ramp, another process).
struct Timing {
  int warmup;
  int min_runs;
  float budget_ms;
  int max_runs;
};

// The timed calls' times in ms, sorted. The calls are queued back to back, each between its own
// events, so the GPU stays busy and a call's host work overlaps the calls before it, as in a
// training loop (synchronised before each start event, the host time of SDPA's cuDNN calls landed
// inside the events: up to 25% of a short backward). How many: the budget over one call's time.
template <class F>
std::vector<float> timed_runs(const Timing& t, F&& run) {
  for (int i = 0; i < t.warmup; ++i) run();
  check(cudaDeviceSynchronize(), "warm-up");
  cudaEvent_t probe_start, probe_stop;
  check(cudaEventCreate(&probe_start), "cudaEventCreate");
  check(cudaEventCreate(&probe_stop), "cudaEventCreate");
  check(cudaEventRecord(probe_start), "cudaEventRecord");
  run();
  check(cudaEventRecord(probe_stop), "cudaEventRecord");
  check(cudaEventSynchronize(probe_stop), "cudaEventSynchronize");
  float probe = 0.0f;
  check(cudaEventElapsedTime(&probe, probe_start, probe_stop), "cudaEventElapsedTime");
  cudaEventDestroy(probe_start), cudaEventDestroy(probe_stop);
  const int n = std::clamp(int(t.budget_ms / std::max(probe, 1e-3f)) + 1, t.min_runs, t.max_runs);

  std::vector<cudaEvent_t> events(2 * size_t(n));
  for (cudaEvent_t& e : events) check(cudaEventCreate(&e), "cudaEventCreate");
  for (int r = 0; r < n; ++r) {
    check(cudaEventRecord(events[2 * r]), "cudaEventRecord");
    run();
    check(cudaEventRecord(events[2 * r + 1]), "cudaEventRecord");
  }
  check(cudaDeviceSynchronize(), "timed runs");
  std::vector<float> times(n);
  for (int r = 0; r < n; ++r) check(cudaEventElapsedTime(&times[r], events[2 * r], events[2 * r + 1]), "cudaEventElapsedTime");
  for (cudaEvent_t e : events) cudaEventDestroy(e);
  std::sort(times.begin(), times.end());
  return times;
}

template <class F>
double median_ms(const Timing& t, F&& run) {
  const std::vector<float> times = timed_runs(t, run);
  return times[times.size() / 2];
}

}  // namespace bench
