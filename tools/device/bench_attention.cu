// Attention timing on the device through the public API, flash-attn layout. Shapes come as
// arguments "B,H,Nq,Nk,D,causal[,Hkv]" (H query heads; Hkv key/value heads, default H: GQA);
// tools/device/check.sh builds this with nvcc against the library and times the same shapes
// through PyTorch SDPA (peers.py). --dtype picks the element type: bf16 (default), f32 (exact
// mode) or f32_fast (TF32).
//
//   bench_attention --pass forward [--dtype T] SHAPE...    impl,dtype,batch,heads,seqlen_q,seqlen_k,headdim,causal,ms,tflops,gbps,heads_kv
//     gbps counts one read of Q, K, V and one write of O (the floor for memory-bound decoding).
//   bench_attention --pass backward [--dtype T] SHAPE...   impl,dtype,batch,heads,seqlen_q,seqlen_k,headdim,causal,ms,tflops,heads_kv
//     impl is tileattn (dQ by atomics) or tileattn_det (deterministic: dQ in its own pass). The
//     forward runs once to give O and L (fp32: and its row statistics, softmax_stats, as the
//     Python layer hands them over; tileattn_recompute is the backward without them); only the
//     backward is timed, counted as 2.5x the forward FLOPs (include/tileattn/flops.hpp).
// Every timed call gets a caller workspace, keeping allocation out of the timed region.
#include <cstdio>
#include <cstring>
#include <vector>

#include "bench_common.cuh"
#include "tileattn/tileattn.hpp"

namespace {

using bench::check;

constexpr bench::Timing kForwardTiming{3, 10, 500.0f, 200};
constexpr bench::Timing kBackwardTiming{3, 10, 500.0f, 100};

struct Buffers {
  std::vector<void*> owned;
  bool f32 = false;
  void* random(size_t n, unsigned seed) {
    void* x;
    check(cudaMalloc(&x, n * (f32 ? 4 : 2)), "cudaMalloc");
    if (f32) bench::fill_random<<<1024, 256>>>(static_cast<float*>(x), n, seed);
    else bench::fill_random<<<1024, 256>>>(static_cast<__nv_bfloat16*>(x), n, seed);
    owned.push_back(x);
    return x;
  }
  void* bytes(size_t n) {
    void* x = nullptr;
    if (n) check(cudaMalloc(&x, n), "cudaMalloc");
    owned.push_back(x);
    return x;
  }
  ~Buffers() {
    for (void* x : owned) cudaFree(x);
  }
};

struct ElementType {
  const char* name;
  tileattn::DType dtype;
  tileattn::Fp32Mode mode;
};
constexpr ElementType kTypes[] = {{"bf16", tileattn::DType::bf16, tileattn::Fp32Mode::exact},
                                  {"f32", tileattn::DType::f32, tileattn::Fp32Mode::exact},
                                  {"f32_fast", tileattn::DType::f32, tileattn::Fp32Mode::fast}};

void run_shape(const ElementType& t, bool backward, long long b, long long h, long long nq, long long nk, long long d,
               int causal, long long hkv) {
  const size_t nq_el = size_t(b * nq * h * d), nk_el = size_t(b * nk * hkv * d);
  Buffers mem;
  mem.f32 = t.dtype == tileattn::DType::f32;
  tileattn::AttentionProblem p;
  p.batch = b, p.seqlen_q = nq, p.seqlen_k = nk, p.heads_q = h, p.heads_kv = hkv;
  p.headdim_qk = d, p.headdim_v = d, p.dtype = t.dtype, p.causal = causal != 0;
  p.fp32_mode = t.mode;
  auto view = [&](void* data, long long n, long long heads) {
    return tileattn::TensorView{data, n * heads * d, heads * d, d};
  };
  p.q = view(mem.random(nq_el, 1), nq, h), p.k = view(mem.random(nk_el, 2), nk, hkv);
  p.v = view(mem.random(nk_el, 3), nk, hkv), p.o = view(mem.random(nq_el, 4), nq, h);
  p.lse = static_cast<float*>(mem.bytes(size_t(b * h * nq) * 4));
  p.backend = tileattn::Backend::cuda;

  if (!backward) {
    p.workspace_bytes = tileattn::forward_workspace_size(p);
    p.workspace = mem.bytes(p.workspace_bytes);
    const double ms = bench::median_ms(kForwardTiming, [&] { tileattn::forward(p); });
    const double flops = tileattn::attention_forward_flops(b, h, nq, nk, d, d, causal != 0);
    const double bytes = (mem.f32 ? 4.0 : 2.0) * double(2 * nq_el + 2 * nk_el);
    std::printf("tileattn,%s,%lld,%lld,%lld,%lld,%lld,%d,%.4f,%.1f,%.0f,%lld\n", t.name, b, h, nq, nk, d, causal, ms,
                flops / ms / 1e9, bytes / ms / 1e6, hkv);
    std::fflush(stdout);
    return;
  }

  p.dout = view(mem.random(nq_el, 5), nq, h), p.dq = view(mem.random(nq_el, 6), nq, h);
  p.dk = view(mem.random(nk_el, 7), nk, hkv), p.dv = view(mem.random(nk_el, 8), nk, hkv);
  float* stats = mem.f32 ? static_cast<float*>(mem.bytes(size_t(b * h * nq) * 8)) : nullptr;
  p.softmax_stats = stats;
  tileattn::forward(p);
  check(cudaDeviceSynchronize(), "forward");
  const double flops = tileattn::attention_backward_flops(b, h, nq, nk, d, d, causal != 0);
  struct Run {
    const char* name;
    bool det, stats;
  };
  for (const Run& run : {Run{"tileattn", false, true}, Run{"tileattn_recompute", false, false},
                         Run{"tileattn_det", true, true}}) {
    if (!run.stats && !mem.f32) continue;
    const bool det = run.det;
    p.softmax_stats = run.stats ? stats : nullptr;
    p.deterministic = det;
    p.workspace = nullptr;
    p.workspace_bytes = tileattn::backward_workspace_size(p);
    void* workspace = nullptr;
    if (p.workspace_bytes) check(cudaMalloc(&workspace, p.workspace_bytes), "cudaMalloc");
    p.workspace = workspace;
    const double ms = bench::median_ms(kBackwardTiming, [&] { tileattn::backward(p); });
    std::printf("%s,%s,%lld,%lld,%lld,%lld,%lld,%d,%.4f,%.1f,%lld\n", run.name, t.name, b, h, nq, nk, d, causal, ms,
                flops / ms / 1e9, hkv);
    std::fflush(stdout);
    cudaFree(workspace);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3 || std::strcmp(argv[1], "--pass") != 0 ||
      (std::strcmp(argv[2], "forward") != 0 && std::strcmp(argv[2], "backward") != 0)) {
    std::fprintf(stderr, "usage: %s --pass forward|backward [--dtype bf16|f32|f32_fast] B,H,Nq,Nk,D,causal[,Hkv] ...\n",
                 argv[0]);
    return 2;
  }
  const bool backward = std::strcmp(argv[2], "backward") == 0;
  int first = 3;
  const ElementType* type = &kTypes[0];
  if (argc > 4 && std::strcmp(argv[3], "--dtype") == 0) {
    type = nullptr;
    for (const ElementType& t : kTypes)
      if (std::strcmp(argv[4], t.name) == 0) type = &t;
    if (type == nullptr) {
      std::fprintf(stderr, "bad --dtype '%s' (want bf16, f32 or f32_fast)\n", argv[4]);
      return 2;
    }
    first = 5;
  }
  std::printf("impl,dtype,batch,heads,seqlen_q,seqlen_k,headdim,causal,ms,tflops%s,heads_kv\n", backward ? "" : ",gbps");
  for (int a = first; a < argc; ++a) {
    long long b, h, nq, nk, d, hkv = 0;
    int causal;
    const int fields = std::sscanf(argv[a], "%lld,%lld,%lld,%lld,%lld,%d,%lld", &b, &h, &nq, &nk, &d, &causal, &hkv);
    if (fields == 6) hkv = h;
    if ((fields != 6 && fields != 7) || hkv <= 0 || h % hkv != 0) {
      std::fprintf(stderr, "bad shape '%s' (want B,H,Nq,Nk,D,causal[,Hkv], Hkv dividing H)\n", argv[a]);
      return 2;
    }
    run_shape(*type, backward, b, h, nq, nk, d, causal, hkv);
  }
  return 0;
}
