// fp32 attention forward and softmax(X) @ V on the device through the public API.
// Prints CSV rows  impl,case,ms,tflops,extra_mib  (timing: median of cudaEvent-timed runs after
// warm-up) and, first, accuracy rows  accuracy,case,max_abs,rel_l2  against the float64 oracle on
// small problems. `peers.py fp32` prints PyTorch's figures for the same cases.
#include <cuda_fp16.h>

#include <cmath>
#include <cstring>
#include <string>

#include "bench_common.cuh"
#include "cpu/reference.hpp"
#include "host/validate.hpp"
#include "tileattn/tileattn.hpp"

namespace {

using bench::check;

constexpr bench::Timing kTiming{2, 5, 300.0f, 50};

// N(0, 1)-like values from a hash (Box-Muller), written as fp32, fp16 or bf16 bits.
__global__ void fill_normal(void* out, size_t n, tileattn::DType t, unsigned seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    unsigned h1 = unsigned(i) * 2654435761u ^ seed, h2 = unsigned(i >> 32) * 40503u + unsigned(i) * 97u + seed * 7u;
    h1 ^= h1 >> 13, h1 *= 0x5bd1e995u, h1 ^= h1 >> 15;
    h2 ^= h2 >> 16, h2 *= 0x7feb352du, h2 ^= h2 >> 15, h2 *= 0x846ca68bu, h2 ^= h2 >> 16;
    const float u1 = (float(h1 >> 8) + 0.5f) / 16777216.0f, u2 = float(h2 >> 8) / 16777216.0f;
    const float x = scale * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    if (t == tileattn::DType::f32) static_cast<float*>(out)[i] = x;
    else if (t == tileattn::DType::f16) static_cast<__half*>(out)[i] = __float2half(x);
    else static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16(x);
  }
}

size_t elem_bytes(tileattn::DType t) { return t == tileattn::DType::f32 ? 4 : 2; }

void* device_normal(size_t n, tileattn::DType t, unsigned seed, float scale = 1.0f) {
  void* p = nullptr;
  check(cudaMalloc(&p, n * elem_bytes(t)), "cudaMalloc");
  fill_normal<<<1024, 256>>>(p, n, t, seed, scale);
  check(cudaGetLastError(), "fill_normal");
  return p;
}

std::vector<double> to_host_double(const void* d, size_t n, tileattn::DType t) {
  std::vector<double> out(n);
  if (t == tileattn::DType::f32) {
    std::vector<float> h(n);
    check(cudaMemcpy(h.data(), d, n * 4, cudaMemcpyDeviceToHost), "cudaMemcpy");
    std::copy(h.begin(), h.end(), out.begin());
  } else {
    std::vector<uint16_t> h(n);
    check(cudaMemcpy(h.data(), d, n * 2, cudaMemcpyDeviceToHost), "cudaMemcpy");
    for (size_t i = 0; i < n; ++i) {
      if (t == tileattn::DType::bf16) {
        const uint32_t bits = uint32_t(h[i]) << 16;
        float f;
        std::memcpy(&f, &bits, 4);
        out[i] = f;
      } else {
        __half_raw raw;
        raw.x = h[i];
        out[i] = __half2float(__half(raw));
      }
    }
  }
  return out;
}

void print_accuracy(const char* name, const std::vector<double>& got, const std::vector<double>& want) {
  double max_abs = 0, num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isinf(want[i]) && got[i] == want[i]) continue;
    const double d = std::fabs(got[i] - want[i]);
    max_abs = std::isnan(d) ? INFINITY : std::max(max_abs, d);
    num += d * d, den += want[i] * want[i];
  }
  std::printf("accuracy,%s,%.3e,%.3e\n", name, max_abs, std::sqrt(num / std::max(den, 1e-300)));
}

tileattn::AttentionProblem attention(int64_t b, int64_t h, int64_t n, int64_t d, bool causal, void* q, void* k,
                                     void* v, void* o, float* lse) {
  tileattn::AttentionProblem p;
  p.batch = b, p.seqlen_q = n, p.seqlen_k = n, p.heads_q = h, p.heads_kv = h;
  p.headdim_qk = d, p.headdim_v = d, p.dtype = tileattn::DType::f32, p.causal = causal;
  auto view = [&](void* data) { return tileattn::TensorView{data, n * h * d, h * d, d}; };
  p.q = view(q), p.k = view(k), p.v = view(v), p.o = view(o);
  p.lse = lse;
  p.backend = tileattn::Backend::cuda;
  return p;
}

tileattn::SoftmaxMatmulProblem softmax_matmul(int64_t b, int64_t d1, int64_t d2, int64_t d3, tileattn::DType t,
                                              const void* x, const void* v, void* out) {
  tileattn::SoftmaxMatmulProblem p;
  p.batch = b, p.d1 = d1, p.d2 = d2, p.d3 = d3, p.dtype = t;
  p.x = x, p.x_batch_stride = d1 * d2, p.x_row_stride = d2;
  p.v = v, p.v_batch_stride = d2 * d3, p.v_row_stride = d3;
  p.out = out, p.out_batch_stride = d1 * d3, p.out_row_stride = d3;
  p.backend = tileattn::Backend::cuda;
  return p;
}

const char* mode_name(tileattn::Fp32Mode m) { return m == tileattn::Fp32Mode::exact ? "exact" : "fast"; }
const char* dtype_name(tileattn::DType t) {
  return t == tileattn::DType::f32 ? "f32" : t == tileattn::DType::f16 ? "f16" : "bf16";
}

// fp32 Q, K, V (N(0, 1), seeds first_seed, +1, +2), O and L on the device for one problem.
struct AttentionBuffers {
  size_t el;
  void *q, *k, *v, *o, *lse;
  AttentionBuffers(int64_t b, int64_t h, int64_t n, int64_t d, unsigned first_seed) : el(size_t(b * n * h * d)) {
    q = device_normal(el, tileattn::DType::f32, first_seed);
    k = device_normal(el, tileattn::DType::f32, first_seed + 1);
    v = device_normal(el, tileattn::DType::f32, first_seed + 2);
    check(cudaMalloc(&o, el * 4), "cudaMalloc");
    check(cudaMalloc(&lse, size_t(b * h * n) * 4), "cudaMalloc");
  }
  AttentionBuffers(const AttentionBuffers&) = delete;
  AttentionBuffers& operator=(const AttentionBuffers&) = delete;
  ~AttentionBuffers() { cudaFree(q), cudaFree(k), cudaFree(v), cudaFree(o), cudaFree(lse); }
};

// Copies device inputs to host, points a copy of the problem there and runs the oracle.
void accuracy_attention(int64_t b, int64_t h, int64_t n, int64_t d, bool causal) {
  const AttentionBuffers dev(b, h, n, d, 11);
  const size_t el = dev.el;
  void *q = dev.q, *k = dev.k, *v = dev.v, *o = dev.o, *lse = dev.lse;
  std::vector<float> hq(el), hk(el), hv(el), ho(el), hl(size_t(b * h * n));
  check(cudaMemcpy(hq.data(), q, el * 4, cudaMemcpyDeviceToHost), "cudaMemcpy");
  check(cudaMemcpy(hk.data(), k, el * 4, cudaMemcpyDeviceToHost), "cudaMemcpy");
  check(cudaMemcpy(hv.data(), v, el * 4, cudaMemcpyDeviceToHost), "cudaMemcpy");
  auto hp = attention(b, h, n, d, causal, hq.data(), hk.data(), hv.data(), ho.data(), hl.data());
  hp.backend = tileattn::Backend::cpu;
  const auto ref = tileattn::cpu::reference_forward(
      tileattn::host::validate_attention(hp, tileattn::host::Pass::forward, tileattn::Backend::cpu));
  for (auto mode : {tileattn::Fp32Mode::exact, tileattn::Fp32Mode::fast}) {
    auto p = attention(b, h, n, d, causal, q, k, v, o, static_cast<float*>(lse));
    p.fp32_mode = mode;
    tileattn::forward(p);
    check(cudaDeviceSynchronize(), "forward");
    const std::string name = "attention_" + std::string(mode_name(mode)) + "_b" + std::to_string(b) + "_h" +
                             std::to_string(h) + "_n" + std::to_string(n) + "_d" + std::to_string(d) +
                             (causal ? "_causal" : "");
    print_accuracy((name + "_O").c_str(), to_host_double(o, el, tileattn::DType::f32), ref.o);
    print_accuracy((name + "_L").c_str(), to_host_double(lse, hl.size(), tileattn::DType::f32), ref.lse);
  }
}

void accuracy_softmax_matmul(int64_t b, int64_t d1, int64_t d2, int64_t d3, tileattn::DType t,
                             tileattn::Fp32Mode mode, float x_scale) {
  const size_t nx = size_t(b * d1 * d2), nv = size_t(b * d2 * d3), no = size_t(b * d1 * d3), eb = elem_bytes(t);
  void* x = device_normal(nx, t, 21, x_scale);
  void* v = device_normal(nv, t, 22);
  void* out;
  check(cudaMalloc(&out, no * eb), "cudaMalloc");
  std::vector<unsigned char> hx(nx * eb), hv(nv * eb), ho(no * eb);
  check(cudaMemcpy(hx.data(), x, nx * eb, cudaMemcpyDeviceToHost), "cudaMemcpy");
  check(cudaMemcpy(hv.data(), v, nv * eb, cudaMemcpyDeviceToHost), "cudaMemcpy");
  auto hp = softmax_matmul(b, d1, d2, d3, t, hx.data(), hv.data(), ho.data());
  hp.backend = tileattn::Backend::cpu;
  const auto ref =
      tileattn::cpu::reference_softmax_matmul(tileattn::host::validate_softmax_matmul(hp, tileattn::Backend::cpu));
  auto p = softmax_matmul(b, d1, d2, d3, t, x, v, out);
  p.fp32_mode = mode;
  tileattn::softmax_matmul(p);
  check(cudaDeviceSynchronize(), "softmax_matmul");
  const std::string name = "softmax_matmul_" + std::string(dtype_name(t)) +
                           (t == tileattn::DType::f32 ? std::string("_") + mode_name(mode) : "") + "_b" +
                           std::to_string(b) + "_" + std::to_string(d1) + "x" + std::to_string(d2) + "x" +
                           std::to_string(d3) + "_xscale" + std::to_string(int(x_scale));
  print_accuracy(name.c_str(), to_host_double(out, no, t), ref);
  cudaFree(x), cudaFree(v), cudaFree(out);
}

void time_attention(int64_t b, int64_t h, int64_t n, int64_t d, bool causal, const char* only = nullptr) {
  const AttentionBuffers dev(b, h, n, d, 1);
  void *q = dev.q, *k = dev.k, *v = dev.v, *o = dev.o, *lse = dev.lse;
  for (auto mode : {tileattn::Fp32Mode::exact, tileattn::Fp32Mode::fast}) {
    if (only && std::string(only) != mode_name(mode)) continue;
    auto p = attention(b, h, n, d, causal, q, k, v, o, static_cast<float*>(lse));
    p.fp32_mode = mode;
    const double ms = bench::median_ms(kTiming, [&] { tileattn::forward(p); });
    const double flops = tileattn::attention_forward_flops(b, h, n, n, d, d, causal);
    std::printf("tileattn_%s,attention_f32_b%lld_h%lld_n%lld_d%lld%s,%.3f,%.1f,0\n", mode_name(mode), (long long)b,
                (long long)h, (long long)n, (long long)d, causal ? "_causal" : "", ms, flops / ms / 1e9);
    std::fflush(stdout);
  }
}

void time_softmax_matmul(int64_t b, int64_t d1, int64_t d2, int64_t d3, tileattn::DType t, const char* only = nullptr) {
  const size_t eb = elem_bytes(t);
  void* x = device_normal(size_t(b * d1 * d2), t, 5);
  void* v = device_normal(size_t(b * d2 * d3), t, 6);
  void* out;
  check(cudaMalloc(&out, size_t(b * d1 * d3) * eb), "cudaMalloc");
  const auto modes = t == tileattn::DType::f32
                         ? std::vector<tileattn::Fp32Mode>{tileattn::Fp32Mode::exact, tileattn::Fp32Mode::fast}
                         : std::vector<tileattn::Fp32Mode>{tileattn::Fp32Mode::exact};
  for (auto mode : modes) {
    if (only && std::string(only) != mode_name(mode)) continue;
    auto p = softmax_matmul(b, d1, d2, d3, t, x, v, out);
    p.fp32_mode = mode;
    size_t free0, free1, total;
    check(cudaMemGetInfo(&free0, &total), "cudaMemGetInfo");
    const double ms = bench::median_ms(kTiming, [&] { tileattn::softmax_matmul(p); });
    check(cudaMemGetInfo(&free1, &total), "cudaMemGetInfo");
    const std::string impl = t == tileattn::DType::f32 ? std::string("tileattn_") + mode_name(mode) : "tileattn";
    std::printf("%s,softmax_matmul_%s_b%lld_%lldx%lldx%lld,%.3f,%.1f,%.0f\n", impl.c_str(), dtype_name(t),
                (long long)b, (long long)d1, (long long)d2, (long long)d3, ms,
                tileattn::softmax_matmul_flops(b, d1, d2, d3) / ms / 1e9,
                (double(free0) - double(free1)) / 1048576.0);
    std::fflush(stdout);
  }
  cudaFree(x), cudaFree(v), cudaFree(out);
}

}  // namespace

// With the argument smm_f32 [exact|fast]: only the fp32 softmax_matmul timings; attn_f32
// [exact|fast [128]]: only the classic fp32 attention shape, non-causal, or the head-dim-128 one
// (both for a profiler).
int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "smm_f32") {
    std::printf("impl,case,ms,tflops,extra_mib\n");
    time_softmax_matmul(16, 2048, 8192, 512, tileattn::DType::f32, argc > 2 ? argv[2] : nullptr);
    return 0;
  }
  if (argc > 1 && std::string(argv[1]) == "attn_f32") {
    std::printf("impl,case,ms,tflops,extra_mib\n");
    if (argc > 3 && std::string(argv[3]) == "128") time_attention(2, 8, 8192, 128, false, argv[2]);
    else time_attention(8, 1, 16384, 64, false, argc > 2 ? argv[2] : nullptr);
    return 0;
  }
  std::printf("accuracy,case,max_abs,rel_l2\n");
  accuracy_attention(1, 2, 1024, 64, false);
  accuracy_attention(1, 2, 1024, 128, true);
  for (auto mode : {tileattn::Fp32Mode::exact, tileattn::Fp32Mode::fast})
    accuracy_softmax_matmul(2, 256, 2048, 256, tileattn::DType::f32, mode, 4.0f);
  accuracy_softmax_matmul(2, 256, 2048, 256, tileattn::DType::f16, tileattn::Fp32Mode::exact, 4.0f);
  accuracy_softmax_matmul(2, 256, 2048, 256, tileattn::DType::bf16, tileattn::Fp32Mode::exact, 4.0f);

  std::printf("impl,case,ms,tflops,extra_mib\n");
  time_attention(8, 1, 16384, 64, false);
  time_attention(8, 1, 16384, 64, true);
  time_attention(2, 8, 8192, 128, false);
  for (auto t : {tileattn::DType::f32, tileattn::DType::f16, tileattn::DType::bf16})
    time_softmax_matmul(16, 2048, 8192, 512, t);
  return 0;
}
