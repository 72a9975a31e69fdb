// Backward timing on the device through the public API, one CSV row per (shape, dQ mode):
//   impl,dtype,batch,heads,seqlen_q,seqlen_k,headdim,causal,ms,tflops
// impl is tileattn (dQ by atomics) or tileattn_det (deterministic = true: dQ in its own pass).
// Shapes come as arguments "B,H,Nq,Nk,D,causal" (bf16, flash-attn layout). The forward runs once
// to give O and L; the backward is timed alone (median of cudaEvent-timed runs after warm-up)
// with a caller workspace, and counted as 2.5x the forward's FLOPs (include/tileattn/flops.hpp).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "tileattn/tileattn.hpp"

namespace {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(status));
    std::exit(1);
  }
}

__global__ void fill_random(__nv_bfloat16* x, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    unsigned h = unsigned(i) * 2654435761u ^ seed;
    h ^= h >> 13, h *= 0x5bd1e995u, h ^= h >> 15;
    x[i] = __float2bfloat16(float(h & 0xffff) / 32768.0f - 1.0f);
  }
}

double median_ms(tileattn::AttentionProblem& p) {
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  for (int i = 0; i < 3; ++i) tileattn::backward(p);
  check(cudaDeviceSynchronize(), "warm-up");
  std::vector<float> times;
  float total = 0.0f;
  while (times.size() < 10 || (total < 500.0f && times.size() < 100)) {
    check(cudaEventRecord(start), "cudaEventRecord");
    tileattn::backward(p);
    check(cudaEventRecord(stop), "cudaEventRecord");
    check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0.0f;
    check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    times.push_back(ms);
    total += ms;
  }
  cudaEventDestroy(start), cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::printf("impl,dtype,batch,heads,seqlen_q,seqlen_k,headdim,causal,ms,tflops\n");
  for (int a = 1; a < argc; ++a) {
    long long b, h, nq, nk, d;
    int causal;
    if (std::sscanf(argv[a], "%lld,%lld,%lld,%lld,%lld,%d", &b, &h, &nq, &nk, &d, &causal) != 6) {
      std::fprintf(stderr, "bad shape '%s' (want B,H,Nq,Nk,D,causal)\n", argv[a]);
      return 2;
    }
    const size_t nq_el = size_t(b * nq * h * d), nk_el = size_t(b * nk * h * d);
    std::vector<__nv_bfloat16*> bufs;
    auto alloc = [&](size_t n, unsigned seed) {
      __nv_bfloat16* x;
      check(cudaMalloc(&x, n * 2), "cudaMalloc");
      fill_random<<<1024, 256>>>(x, n, seed);
      bufs.push_back(x);
      return x;
    };
    __nv_bfloat16 *q = alloc(nq_el, 1), *k = alloc(nk_el, 2), *v = alloc(nk_el, 3), *o = alloc(nq_el, 4);
    __nv_bfloat16 *dout = alloc(nq_el, 5), *dq = alloc(nq_el, 6), *dk = alloc(nk_el, 7), *dv = alloc(nk_el, 8);
    float* lse;
    check(cudaMalloc(&lse, size_t(b * h * nq) * 4), "cudaMalloc");

    tileattn::AttentionProblem p;
    p.batch = b, p.seqlen_q = nq, p.seqlen_k = nk, p.heads_q = h, p.heads_kv = h;
    p.headdim_qk = d, p.headdim_v = d, p.dtype = tileattn::DType::bf16, p.causal = causal != 0;
    auto view = [&](void* data, long long n) { return tileattn::TensorView{data, n * h * d, h * d, d}; };
    p.q = view(q, nq), p.k = view(k, nk), p.v = view(v, nk), p.o = view(o, nq);
    p.dout = view(dout, nq), p.dq = view(dq, nq), p.dk = view(dk, nk), p.dv = view(dv, nk);
    p.lse = lse;
    p.backend = tileattn::Backend::cuda;
    tileattn::forward(p);
    check(cudaDeviceSynchronize(), "forward");

    const double flops = tileattn::attention_backward_flops(b, h, nq, nk, d, d, causal != 0);
    for (bool det : {false, true}) {
      p.deterministic = det;
      void* workspace = nullptr;
      p.workspace = nullptr;
      p.workspace_bytes = tileattn::backward_workspace_size(p);
      if (p.workspace_bytes) check(cudaMalloc(&workspace, p.workspace_bytes), "cudaMalloc");
      p.workspace = workspace;
      const double ms = median_ms(p);
      std::printf("%s,bf16,%lld,%lld,%lld,%lld,%lld,%d,%.4f,%.1f\n", det ? "tileattn_det" : "tileattn", b, h, nq, nk, d,
                  causal, ms, flops / ms / 1e9);
      std::fflush(stdout);
      cudaFree(workspace);
    }
    for (auto* x : bufs) cudaFree(x);
    cudaFree(lse);
  }
  return 0;
}
