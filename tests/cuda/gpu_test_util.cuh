#pragma once
// Shared helpers for the GPU tests (include from a .cu test file):
//
//   TA_SKIP_WITHOUT_GPU();                      // GTEST_SKIP when no CUDA device is visible
//   HostProblem hp(shape);                      // support/host_problem.hpp: random inputs, poisoned outputs
//   DeviceProblem dp(hp);                       // byte-for-byte device copies, poison included
//   tileattn::forward(dp.problem);
//   dp.download();                              // outputs back into hp's buffers
//   NaiveForward naive = naive_forward(dp.problem);
//   EXPECT_TRUE(within_2x("O", hp.o.gather(), naive.o, ref.o, output_floor(dtype, ...)));
//
// The 2x rule (flash-attn's): the error of the kernel against the float64 oracle may be at most
// twice the error of a naive implementation in the same precision, plus a small floor. The naive
// kernel here is what a framework does without fusion: scores in fp32 from the stored inputs,
// softmax in fp32, P rounded to the input dtype before P @ V, O rounded to the dtype.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/mask.hpp"
#include "common/online_softmax.hpp"
#include "cpu/reference.hpp"
#include "host/validate.hpp"
#include "support/host_problem.hpp"
#include "support/metrics.hpp"
#include "tileattn/problem.hpp"

namespace tileattn::test {

inline void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(status) + " (" + cudaGetErrorString(status) + ")");
}

inline bool gpu_present() {
  static const bool present = [] {
    int n = 0;
    const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
    cudaGetLastError();  // a missing driver leaves a sticky error otherwise
    return ok;
  }();
  return present;
}

#define TA_SKIP_WITHOUT_GPU() \
  if (!::tileattn::test::gpu_present()) GTEST_SKIP() << "no CUDA device visible"

// A compute capability 9.0 device without TILEATTN_CUDA_KERNELS=sm80: the Hopper kernels run.
inline bool hopper_kernels_run() {
  int device = 0, major = 0, minor = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "major");
  check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "minor");
  const char* forced = std::getenv("TILEATTN_CUDA_KERNELS");
  return major == 9 && minor == 0 && !(forced != nullptr && std::string(forced) == "sm80");
}

// Owning device allocation of raw bytes.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes) check_cuda(cudaMalloc(&ptr_, bytes), "cudaMalloc");
  }
  DeviceBuffer(const void* host, size_t bytes) : DeviceBuffer(bytes) { upload(host); }
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr, o.bytes_ = 0; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }

  void upload(const void* host) {
    if (bytes_) check_cuda(cudaMemcpy(ptr_, host, bytes_, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
  }
  void download(void* host) const {
    if (bytes_) check_cuda(cudaMemcpy(host, ptr_, bytes_, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
  }
  template <class T = void>
  T* get() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Device mirror of a HostProblem: every buffer copied byte for byte (the poisoned gaps and guard
// tails too), views re-pointed with the same strides, options unchanged, backend set to cuda.
class DeviceProblem {
 public:
  explicit DeviceProblem(HostProblem& hp) : hp_(hp), problem(hp.problem) {
    mirror(hp.q, q_, problem.q);
    mirror(hp.k, k_, problem.k);
    mirror(hp.v, v_, problem.v);
    mirror(hp.o, o_, problem.o);
    mirror(hp.dout, dout_, problem.dout);
    mirror(hp.dq, dq_, problem.dq);
    mirror(hp.dk, dk_, problem.dk);
    mirror(hp.dv, dv_, problem.dv);
    lse_ = DeviceBuffer(hp.lse.data(), hp.lse.size() * sizeof(float));
    problem.lse = lse_.get<float>();
    if (!hp.cu_seqlens_q.empty()) {
      cu_q_ = DeviceBuffer(hp.cu_seqlens_q.data(), hp.cu_seqlens_q.size() * sizeof(int32_t));
      cu_k_ = DeviceBuffer(hp.cu_seqlens_k.data(), hp.cu_seqlens_k.size() * sizeof(int32_t));
      problem.cu_seqlens_q = cu_q_.get<int32_t>();
      problem.cu_seqlens_k = cu_k_.get<int32_t>();
    }
    if (!hp.alibi_slopes.empty()) {
      alibi_ = DeviceBuffer(hp.alibi_slopes.data(), hp.alibi_slopes.size() * sizeof(float));
      problem.alibi_slopes = alibi_.get<float>();
    }
    if (!hp.dlse.empty()) {
      dlse_ = DeviceBuffer(hp.dlse.data(), hp.dlse.size() * sizeof(float));
      problem.dlse = dlse_.get<float>();
    }
    problem.backend = Backend::cuda;
  }
  DeviceProblem(const DeviceProblem&) = delete;
  DeviceProblem& operator=(const DeviceProblem&) = delete;

  // Waits for the device and copies O, L (and dQ, dK, dV when allocated) into the HostProblem.
  void download() {
    check_cuda(cudaDeviceSynchronize(), "kernel execution");
    o_.download(hp_.o.bytes.data());
    lse_.download(hp_.lse.data());
    if (dq_.bytes()) dq_.download(hp_.dq.bytes.data());
    if (dk_.bytes()) dk_.download(hp_.dk.bytes.data());
    if (dv_.bytes()) dv_.download(hp_.dv.bytes.data());
  }
  // Poisons the outputs on both sides (e.g. before a second run on the same inputs).
  void poison_outputs() {
    hp_.poison_outputs();
    o_.upload(hp_.o.bytes.data());
    lse_.upload(hp_.lse.data());
    if (dq_.bytes()) dq_.upload(hp_.dq.bytes.data());
    if (dk_.bytes()) dk_.upload(hp_.dk.bytes.data());
    if (dv_.bytes()) dv_.upload(hp_.dv.bytes.data());
  }

 private:
  static void mirror(HostTensor& t, DeviceBuffer& buf, TensorView& view) {
    if (t.bytes.empty()) return;
    buf = DeviceBuffer(t.bytes.data(), t.bytes.size());
    view.data = buf.get();
  }

  HostProblem& hp_;
  DeviceBuffer q_, k_, v_, o_, dout_, dq_, dk_, dv_, lse_, cu_q_, cu_k_, alibi_, dlse_;

 public:
  AttentionProblem problem;
};

// ---- the naive same-precision forward ---------------------------------------------------------

namespace naive_detail {

template <class T>
__device__ __forceinline__ float load(const void* base, int64_t i) {
  if constexpr (std::is_same_v<T, float>) return static_cast<const float*>(base)[i];
  else if constexpr (std::is_same_v<T, __half>) return __half2float(static_cast<const __half*>(base)[i]);
  else return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
}
template <class T>
__device__ __forceinline__ float round_to(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else if constexpr (std::is_same_v<T, __half>) return __half2float(__float2half_rn(x));
  else return __bfloat162float(__float2bfloat16_rn(x));
}

constexpr int kThreads = 128;

template <bool is_max>
__device__ float block_reduce(float x, float* shared) {
  for (int off = 16; off > 0; off /= 2) {
    const float y = __shfl_xor_sync(0xffffffffu, x, off);
    x = is_max ? fmaxf(x, y) : x + y;
  }
  __syncthreads();  // `shared` may still be read from the previous reduction
  if (threadIdx.x % 32 == 0) shared[threadIdx.x / 32] = x;
  __syncthreads();
  x = shared[0];
  for (int w = 1; w < kThreads / 32; ++w) x = is_max ? fmaxf(x, shared[w]) : x + shared[w];
  return x;
}

// One block per (query row, head). `scores` holds seqlen_k floats per block.
// o_out: dense (rows_q, heads_q, headdim_v); lse_out: the problem's L layout.
template <class T>
__global__ void __launch_bounds__(kThreads) naive_forward_kernel(AttentionProblem p, float scale, float* scores, float* o_out, float* lse_out) {
  __shared__ float red[kThreads / 32];
  const int64_t h = blockIdx.x % p.heads_q;
  const int64_t r = blockIdx.x / p.heads_q;  // row among rows_q
  int64_t b, i, sq, sk, q_row, k_row0;
  if (p.cu_seqlens_q) {
    b = 0;
    while (p.cu_seqlens_q[b + 1] <= r) ++b;
    i = r - p.cu_seqlens_q[b];
    sq = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
    sk = p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b];
    q_row = r;
    k_row0 = p.cu_seqlens_k[b];
  } else {
    b = r / p.seqlen_q;
    i = r % p.seqlen_q;
    sq = p.seqlen_q;
    sk = p.seqlen_k;
    q_row = i;
    k_row0 = 0;
  }
  const int64_t kvh = h / (p.heads_q / p.heads_kv);
  const int64_t qb = p.cu_seqlens_q ? 0 : b;
  const int64_t q_off = qb * p.q.batch_stride + q_row * p.q.seq_stride + h * p.q.head_stride;
  const int64_t k_off = qb * p.k.batch_stride + k_row0 * p.k.seq_stride + kvh * p.k.head_stride;
  const int64_t v_off = qb * p.v.batch_stride + k_row0 * p.v.seq_stride + kvh * p.v.head_stride;
  const Mask mask{int(sq), int(sk), int(p.window_left), int(p.window_right)};
  float* s = scores + int64_t(blockIdx.x) * p.seqlen_k;

  float row_max = -INFINITY;
  for (int64_t j = threadIdx.x; j < sk; j += kThreads) {
    float acc = 0.0f;
    for (int64_t d = 0; d < p.headdim_qk; ++d)
      acc += load<T>(p.q.data, q_off + d) * load<T>(p.k.data, k_off + j * p.k.seq_stride + d);
    float x = apply_softcap(acc * scale, p.softcap);
    if (p.alibi_slopes) x -= p.alibi_slopes[b * p.alibi_batch_stride + h] * fabsf(float(i + sk - sq - j));
    if (!mask.visible(int(i), int(j))) x = -INFINITY;
    s[j] = x;
    row_max = fmaxf(row_max, x);
  }
  row_max = block_reduce<true>(row_max, red);
  const int64_t lse_index = p.cu_seqlens_q ? h * p.total_q + r : (b * p.heads_q + h) * p.seqlen_q + i;
  float* o = o_out + (r * p.heads_q + h) * p.headdim_v;
  if (row_max == -INFINITY) {
    for (int64_t d = threadIdx.x; d < p.headdim_v; d += kThreads) o[d] = 0.0f;
    if (threadIdx.x == 0) lse_out[lse_index] = -INFINITY;
    return;
  }
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < sk; j += kThreads) sum += expf(s[j] - row_max);
  sum = block_reduce<false>(sum, red);
  for (int64_t j = threadIdx.x; j < sk; j += kThreads) s[j] = round_to<T>(expf(s[j] - row_max) / sum);
  __syncthreads();
  for (int64_t d = threadIdx.x; d < p.headdim_v; d += kThreads) {
    float acc = 0.0f;
    for (int64_t j = 0; j < sk; ++j) acc += s[j] * load<T>(p.v.data, v_off + j * p.v.seq_stride + d);
    o[d] = round_to<T>(acc);
  }
  // ALiBi's causal form: L carries slope * (i + sk - sq), as flash-attn's softmax_lse does.
  const bool alibi_offset = p.alibi_slopes && (p.causal || p.window_right == 0) &&
                            (p.window_left < 0 || p.window_left >= p.seqlen_k);
  const float offset = alibi_offset ? p.alibi_slopes[b * p.alibi_batch_stride + h] * float(i + sk - sq) : 0.0f;
  if (threadIdx.x == 0) lse_out[lse_index] = row_max + logf(sum) + offset;
}

}  // namespace naive_detail

struct NaiveForward {
  std::vector<double> o;    // dense (rows_q, heads_q, headdim_v), like the oracle's
  std::vector<double> lse;  // the problem's L layout
};

// Runs the naive kernel on a device problem (as DeviceProblem::problem gives it).
inline NaiveForward naive_forward(const AttentionProblem& device_problem) {
  const AttentionProblem p = host::validate_attention(device_problem, host::Pass::forward, Backend::cuda);
  const int64_t rows_q = p.is_varlen() ? p.total_q : p.batch * p.seqlen_q;
  const int64_t blocks = rows_q * p.heads_q;
  NaiveForward out;
  out.o.assign(size_t(rows_q * p.heads_q * p.headdim_v), 0.0);
  out.lse.assign(size_t(blocks), 0.0);
  if (blocks == 0) return out;
  DeviceBuffer scores(size_t(blocks * std::max<int64_t>(p.seqlen_k, 1)) * sizeof(float));
  DeviceBuffer o(out.o.size() * sizeof(float)), lse(out.lse.size() * sizeof(float));
  const unsigned grid = unsigned(blocks);
  const float scale = *p.softmax_scale;
  float *s = scores.get<float>(), *od = o.get<float>(), *ld = lse.get<float>();
  constexpr int threads = naive_detail::kThreads;
  switch (p.dtype) {
    case DType::f32: naive_detail::naive_forward_kernel<float><<<grid, threads>>>(p, scale, s, od, ld); break;
    case DType::f16: naive_detail::naive_forward_kernel<__half><<<grid, threads>>>(p, scale, s, od, ld); break;
    case DType::bf16: naive_detail::naive_forward_kernel<__nv_bfloat16><<<grid, threads>>>(p, scale, s, od, ld); break;
  }
  check_cuda(cudaGetLastError(), "naive_forward_kernel launch");
  check_cuda(cudaDeviceSynchronize(), "naive_forward_kernel");
  std::vector<float> of(out.o.size()), lf(out.lse.size());
  o.download(of.data());
  lse.download(lf.data());
  out.o.assign(of.begin(), of.end());
  out.lse.assign(lf.begin(), lf.end());
  return out;
}

// TF32 keeps 10 explicit mantissa bits: u = 2^-11 when rounded, 2^-10 when the tensor core
// truncates an fp32 operand.
constexpr double kTf32Roundoff = 1.0 / 2048.0;

// fp32 fast mode's gradients: every backward product in TF32 (operands truncated, 2u each), P from
// the fast forward's L and D from its O. Each gradient's largest error stays within this many
// roundoffs of its largest reference element.
constexpr double kTf32GradRelBound = 32 * kTf32Roundoff;

// ---- the 2x rule ------------------------------------------------------------------------------

// Floor for outputs stored in `dtype`: one rounding of the largest reference value.
inline double output_floor(DType dtype, double max_ref) { return unit_roundoff(dtype) * std::max(1.0, max_ref); }

// Test properties keep six significant digits: std::to_string's fixed six decimals would print
// fp32-sized errors as 0.000001 and hide the margin.
inline std::string property_text(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", x);
  return buf;
}

// With TILEATTN_MARGIN_LOG set, every comparison also appends one line
//   err/bound  err  naive_err  bound  what  suite.test
// to that file: test processes run in parallel, and one short append per line keeps them whole
// (the gtest XML reports of parallel processes can collide).
inline void record_margin(const std::string& what, double err, double naive, double bound) {
  const char* path = std::getenv("TILEATTN_MARGIN_LOG");
  if (path == nullptr || *path == 0) return;
  const testing::TestInfo* info = testing::UnitTest::GetInstance()->current_test_info();
  char line[512];
  std::snprintf(line, sizeof line, "%.4f\t%.6g\t%.6g\t%.6g\t%s\t%s.%s\n", bound > 0 ? err / bound : 0.0, err, naive,
                bound, what.c_str(), info ? info->test_suite_name() : "?", info ? info->name() : "?");
  if (FILE* f = std::fopen(path, "a")) {
    std::fputs(line, f);
    std::fclose(f);
  }
}

// Passes when max|got - ref| <= 2 * max|naive - ref| + floor, and got has no NaN/inf where ref is finite.
inline testing::AssertionResult within_2x(const std::string& what, const std::vector<double>& got,
                                          const std::vector<double>& naive, const std::vector<double>& ref,
                                          double floor) {
  const ErrorStats e = compare(got, ref);
  const ErrorStats n = compare(naive, ref);
  const double bound = 2.0 * n.max_abs + floor;
  // Kept in the gtest XML report (--gtest_output) so a passing sweep still documents its margins.
  testing::Test::RecordProperty(what + "_err", property_text(e.max_abs));
  testing::Test::RecordProperty(what + "_naive_err", property_text(n.max_abs));
  testing::Test::RecordProperty(what + "_bound", property_text(bound));
  record_margin(what, e.max_abs, n.max_abs, bound);
  std::ostringstream os;
  os << what << ": kernel {" << e << "} naive {" << n << "} bound=" << bound;
  if (e.nonfinite == 0 && e.max_abs <= bound) return testing::AssertionSuccess() << os.str();
  return testing::AssertionFailure() << os.str();
}

// fp32 fast mode's gradients: no NaN/inf where ref is finite, and max|got - ref| within
// kTf32GradRelBound of ref's largest element.
inline testing::AssertionResult within_tf32_grad_bound(const std::string& what, const std::vector<double>& got,
                                                       const std::vector<double>& ref) {
  const ErrorStats e = compare(got, ref);
  const double bound = kTf32GradRelBound * e.max_ref;
  testing::Test::RecordProperty(what + "_fast_err", property_text(e.max_abs));
  record_margin(what + "_fast", e.max_abs, 0.0, bound);
  std::ostringstream os;
  os << what << " (TF32): {" << e << "} bound=" << bound;
  if (e.nonfinite == 0 && e.max_abs <= bound) return testing::AssertionSuccess() << os.str();
  return testing::AssertionFailure() << os.str();
}

// L is fp32 everywhere; its error is a few fp32 roundings of |L|.
constexpr double kLseFloor = 1e-5;

// The forward's outputs (downloaded into hp) against the float64 oracle and the naive kernel,
// with the 2x rule, and no write outside O's view or past L's end.
inline void expect_forward_within_2x(HostProblem& hp, const DeviceProblem& dp) {
  const AttentionProblem host = host::validate_attention(hp.problem, host::Pass::forward, Backend::cpu);
  const cpu::ReferenceForward ref = cpu::reference_forward(host);
  const NaiveForward naive = naive_forward(dp.problem);
  const double o_max = compare(ref.o, ref.o).max_ref;
  EXPECT_TRUE(within_2x("O", hp.o.gather(), naive.o, ref.o, output_floor(hp.problem.dtype, o_max)));
  const double l_max = compare(ref.lse, ref.lse).max_ref;
  EXPECT_TRUE(within_2x("L", hp.gather_lse(), naive.lse, ref.lse, kLseFloor * std::max(1.0, l_max)));
  EXPECT_EQ(hp.o.touched_outside_view(), 0) << "O written outside its view";
  EXPECT_EQ(hp.lse_guard_touched(), 0) << "L written past its end";
}

}  // namespace tileattn::test
