// The card's streaming-read ceiling, the yardstick for decoding (which reads K and V once and
// little else): a kernel that only reads a 2 GiB buffer with 16-byte loads, over a sweep of grid
// shapes, best of 10 event-timed runs each; and a device-to-device copy for reference.
// Prints CSV rows  kernel,blocks,threads,gbps  and last  best,,,gbps.
#include <cuda_runtime.h>

#include <cstdio>

#include "bench_common.cuh"

namespace {

using bench::check;

// Best of 10 after 2 warm-up runs: a ceiling is the fastest a run got.
constexpr bench::Timing kTiming{2, 10, 0.0f, 10};

// Every element is read (the grid-stride loop has no tail to skip); the XOR keeps the loads live.
__global__ void read_all(const int4* __restrict__ data, size_t n, int* sink) {
  int acc = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(data + i));
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x5eed) *sink = acc;  // never true for the memset pattern; the compiler cannot know
}

}  // namespace

int main() {
  const size_t bytes = size_t(2) << 30, n = bytes / sizeof(int4);
  int4 *data = nullptr, *copy = nullptr;
  int* sink = nullptr;
  check(cudaMalloc(&data, bytes), "cudaMalloc");
  check(cudaMalloc(&copy, bytes), "cudaMalloc");
  check(cudaMalloc(&sink, sizeof(int)), "cudaMalloc");
  check(cudaMemset(data, 1, bytes), "cudaMemset");
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "cudaDeviceGetAttribute");
  std::printf("kernel,blocks,threads,gbps\n");
  double best = 0;
  for (int per_sm : {1, 2, 4, 8, 16})
    for (int threads : {256, 512, 1024}) {
      const int blocks = sms * per_sm;
      const float ms = bench::timed_runs(kTiming, [&] { read_all<<<blocks, threads>>>(data, n, sink); }).front();
      check(cudaGetLastError(), "read_all launch");
      const double gbps = double(bytes) / (ms * 1e-3) / 1e9;
      if (gbps > best) best = gbps;
      std::printf("read,%d,%d,%.0f\n", blocks, threads, gbps);
    }
  const float ms = bench::timed_runs(kTiming, [&] {
    check(cudaMemcpyAsync(copy, data, bytes, cudaMemcpyDeviceToDevice), "cudaMemcpyAsync");
  }).front();
  std::printf("copy (read + write),,,%.0f\n", 2.0 * double(bytes) / (ms * 1e-3) / 1e9);
  std::printf("best,,,%.0f\n", best);
  return 0;
}
