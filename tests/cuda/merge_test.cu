// merge_attention on CUDA against the CPU path on the same inputs (both use the weights of
// src/common/merge_weights.hpp; only expf/log1pf may round differently by an ulp), with rows where
// either side or both saw no key exact, an expanded other side (zero batch strides), and the
// memory-space rule.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "cpu/convert.hpp"
#include "gpu_test_util.cuh"
#include "tileattn/merge.hpp"

namespace tileattn::test {
namespace {

struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t bytes) { check_cuda(cudaMalloc(&ptr, bytes), "cudaMalloc"); }
  ~DeviceBuffer() { cudaFree(ptr); }
};

// expanded_b: out_b and lse_b hold one batch's rows, read for every batch (batch strides 0).
void run_case(DType out_dtype, DType out_b_dtype, bool expanded_b = false) {
  const int64_t B = 2, N = 77, H = 5, D = 96, rows = B * N * H;
  std::mt19937_64 rng{std::random_device{}()};
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> lse_dist(-6.0f, 6.0f);
  const int64_t rows_b = expanded_b ? rows / B : rows;
  const size_t elems = size_t(rows * D), elems_b = size_t(rows_b * D);
  std::vector<unsigned char> oa(elems * cpu::dtype_size(out_dtype)), ob(elems_b * cpu::dtype_size(out_b_dtype));
  std::vector<float> la(static_cast<size_t>(rows)), lb(static_cast<size_t>(rows_b));
  for (int64_t r = 0; r < rows; ++r) la[size_t(r)] = r % 5 == 1 || r % 5 == 3 ? -INFINITY : lse_dist(rng);
  for (int64_t r = 0; r < rows_b; ++r) lb[size_t(r)] = r % 5 == 2 || r % 5 == 3 ? -INFINITY : lse_dist(rng);
  // O in (batch, seqlen, heads, headdim); L in (batch, heads, seqlen): row r of L is (b, h, i).
  for (size_t e = 0; e < elems; ++e) cpu::store_element(oa.data(), int64_t(e), out_dtype, normal(rng));
  for (size_t e = 0; e < elems_b; ++e) cpu::store_element(ob.data(), int64_t(e), out_b_dtype, normal(rng));
  MergeProblem p;
  p.batch = B, p.seqlen = N, p.heads = H, p.headdim = D;
  p.out = {oa.data(), N * H * D, H * D, D}, p.out_dtype = out_dtype;
  p.out_b = {ob.data(), expanded_b ? 0 : N * H * D, H * D, D}, p.out_b_dtype = out_b_dtype;
  p.lse_head_stride = N, p.lse_batch_stride = H * N, p.lse_b_head_stride = N;
  p.lse_b_batch_stride = expanded_b ? 0 : H * N;

  DeviceBuffer doa(oa.size()), dob(ob.size()), dla(la.size() * 4), dlb(lb.size() * 4);
  check_cuda(cudaMemcpy(doa.ptr, oa.data(), oa.size(), cudaMemcpyHostToDevice), "copy");
  check_cuda(cudaMemcpy(dob.ptr, ob.data(), ob.size(), cudaMemcpyHostToDevice), "copy");
  check_cuda(cudaMemcpy(dla.ptr, la.data(), la.size() * 4, cudaMemcpyHostToDevice), "copy");
  check_cuda(cudaMemcpy(dlb.ptr, lb.data(), lb.size() * 4, cudaMemcpyHostToDevice), "copy");
  MergeProblem dp = p;
  dp.out.data = doa.ptr, dp.out_b.data = dob.ptr;
  dp.lse = static_cast<float*>(dla.ptr), dp.lse_b = static_cast<const float*>(dlb.ptr);
  merge_attention(dp);
  check_cuda(cudaDeviceSynchronize(), "merge kernel");

  p.lse = la.data(), p.lse_b = lb.data(), p.backend = Backend::cpu;
  merge_attention(p);  // the CPU result, in place in oa / la
  std::vector<unsigned char> got_o(oa.size());
  std::vector<float> got_l(la.size());
  check_cuda(cudaMemcpy(got_o.data(), doa.ptr, got_o.size(), cudaMemcpyDeviceToHost), "copy back");
  check_cuda(cudaMemcpy(got_l.data(), dla.ptr, got_l.size() * 4, cudaMemcpyDeviceToHost), "copy back");

  // CUDA's expf is within 2 ulp of the exact value, the host's libm within 1: the two weights can
  // differ by a few ulp, so an fp32 output may differ by that much (seen: 1 ulp at 1.8 on an H100).
  const double tol_o = 8.0 * unit_roundoff(out_dtype), tol_l = 1e-6;
  for (int64_t r = 0; r < rows; ++r) {
    if (std::isinf(la[size_t(r)])) {
      ASSERT_EQ(got_l[size_t(r)], -INFINITY) << "row " << r;
    } else {
      ASSERT_NEAR(got_l[size_t(r)], la[size_t(r)], tol_l * std::max(1.0f, std::fabs(la[size_t(r)]))) << "row " << r;
    }
  }
  for (size_t e = 0; e < elems; ++e) {
    const float want = cpu::load_element(oa.data(), int64_t(e), out_dtype);
    const float got = cpu::load_element(got_o.data(), int64_t(e), out_dtype);
    ASSERT_TRUE(std::isfinite(got)) << "element " << e;
    ASSERT_NEAR(got, want, tol_o * std::max(1.0f, std::fabs(want))) << "element " << e;
  }
}

TEST(MergeCuda, MatchesCpuPathF32FromBf16) {
  TA_SKIP_WITHOUT_GPU();
  run_case(DType::f32, DType::bf16);
}
TEST(MergeCuda, MatchesCpuPathF32FromF32) {
  TA_SKIP_WITHOUT_GPU();
  run_case(DType::f32, DType::f32);
}
TEST(MergeCuda, MatchesCpuPathBf16) {
  TA_SKIP_WITHOUT_GPU();
  run_case(DType::bf16, DType::bf16);
}
TEST(MergeCuda, MatchesCpuPathF16) {
  TA_SKIP_WITHOUT_GPU();
  run_case(DType::f16, DType::f16);
}

TEST(MergeCuda, ReadsAnExpandedOtherSide) {
  TA_SKIP_WITHOUT_GPU();
  run_case(DType::f32, DType::bf16, true);
}

TEST(MergeCuda, HostLseWithDeviceOutIsRefused) {
  TA_SKIP_WITHOUT_GPU();
  DeviceBuffer o(4 * 8), ob(4 * 8);
  std::vector<float> l(1), lb(1);
  MergeProblem p;
  p.batch = p.seqlen = p.heads = 1, p.headdim = 8;
  p.out = {o.ptr, 8, 8, 8}, p.out_b = {ob.ptr, 8, 8, 8};
  p.lse = l.data(), p.lse_b = lb.data();
  try {
    merge_attention(p);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("lse is not memory of the current CUDA device"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tileattn::test
