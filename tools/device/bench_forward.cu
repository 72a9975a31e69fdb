// Forward timing on the device through the public API, one CSV row per shape:
//   impl,dtype,batch,heads,seqlen_q,seqlen_k,headdim,causal,ms,tflops,gbps
// Shapes come as arguments "B,H,Nq,Nk,D,causal" (bf16, flash-attn layout); tools/device/check.sh
// builds this with nvcc against the library and runs the same shapes through PyTorch SDPA.
// Time is the median of cudaEvent-timed runs after warm-up; gbps counts one read of Q, K, V and
// one write of O (the floor for decoding shapes, which are memory-bound).
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

}  // namespace

int main(int argc, char** argv) {
  std::printf("impl,dtype,batch,heads,seqlen_q,seqlen_k,headdim,causal,ms,tflops,gbps\n");
  for (int a = 1; a < argc; ++a) {
    long long b, h, nq, nk, d;
    int causal;
    if (std::sscanf(argv[a], "%lld,%lld,%lld,%lld,%lld,%d", &b, &h, &nq, &nk, &d, &causal) != 6) {
      std::fprintf(stderr, "bad shape '%s' (want B,H,Nq,Nk,D,causal)\n", argv[a]);
      return 2;
    }
    const size_t nq_el = size_t(b * nq * h * d), nk_el = size_t(b * nk * h * d);
    __nv_bfloat16 *q, *k, *v, *o;
    float* lse;
    check(cudaMalloc(&q, nq_el * 2), "cudaMalloc");
    check(cudaMalloc(&k, nk_el * 2), "cudaMalloc");
    check(cudaMalloc(&v, nk_el * 2), "cudaMalloc");
    check(cudaMalloc(&o, nq_el * 2), "cudaMalloc");
    check(cudaMalloc(&lse, size_t(b * h * nq) * 4), "cudaMalloc");
    fill_random<<<1024, 256>>>(q, nq_el, 1);
    fill_random<<<1024, 256>>>(k, nk_el, 2);
    fill_random<<<1024, 256>>>(v, nk_el, 3);

    tileattn::AttentionProblem p;
    p.batch = b, p.seqlen_q = nq, p.seqlen_k = nk, p.heads_q = h, p.heads_kv = h;
    p.headdim_qk = d, p.headdim_v = d, p.dtype = tileattn::DType::bf16, p.causal = causal != 0;
    auto view = [&](void* data, long long n) {
      return tileattn::TensorView{data, n * h * d, h * d, d};
    };
    p.q = view(q, nq), p.k = view(k, nk), p.v = view(v, nk), p.o = view(o, nq);
    p.lse = lse;
    p.backend = tileattn::Backend::cuda;
    // A caller workspace keeps allocation out of the timed region.
    void* workspace = nullptr;
    p.workspace_bytes = tileattn::forward_workspace_size(p);
    if (p.workspace_bytes) check(cudaMalloc(&workspace, p.workspace_bytes), "cudaMalloc");
    p.workspace = workspace;

    cudaEvent_t start, stop;
    check(cudaEventCreate(&start), "cudaEventCreate");
    check(cudaEventCreate(&stop), "cudaEventCreate");
    for (int i = 0; i < 3; ++i) tileattn::forward(p);
    check(cudaDeviceSynchronize(), "warm-up");
    std::vector<float> times;
    float total = 0.0f;
    while (times.size() < 10 || (total < 500.0f && times.size() < 200)) {
      check(cudaEventRecord(start), "cudaEventRecord");
      tileattn::forward(p);
      check(cudaEventRecord(stop), "cudaEventRecord");
      check(cudaEventSynchronize(stop), "cudaEventSynchronize");
      float ms = 0.0f;
      check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
      times.push_back(ms);
      total += ms;
    }
    std::sort(times.begin(), times.end());
    const double ms = times[times.size() / 2];
    const double flops = tileattn::attention_forward_flops(b, h, nq, nk, d, d, causal != 0);
    const double bytes = 2.0 * double(2 * nq_el + 2 * nk_el);
    std::printf("tileattn,bf16,%lld,%lld,%lld,%lld,%lld,%d,%.4f,%.1f,%.0f\n", b, h, nq, nk, d, causal, ms,
                flops / ms / 1e9, bytes / ms / 1e6);
    std::fflush(stdout);
    cudaFree(q), cudaFree(k), cudaFree(v), cudaFree(o), cudaFree(lse), cudaFree(workspace);
    cudaEventDestroy(start), cudaEventDestroy(stop);
  }
  return 0;
}
