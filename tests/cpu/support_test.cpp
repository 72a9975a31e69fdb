// The shared test helpers the whole suite leans on: layouts address what they claim, poisoning
// is visible, out-of-view writes are caught, and the metrics treat NaN and infinities strictly.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "cpu/convert.hpp"
#include "support/host_problem.hpp"
#include "support/metrics.hpp"

namespace tileattn::test {
namespace {

TEST(Support, LayoutsAddressTheSameLogicalElements) {
  for (Layout lay : {Layout::bshd, Layout::bhsd, Layout::padded}) {
    HostTensor t(DType::bf16, 2, 5, 3, 7, lay);
    std::vector<double> dense(2 * 5 * 3 * 7);
    for (size_t i = 0; i < dense.size(); ++i) dense[i] = double(i);  // exact in bf16 up to 256
    t.scatter(dense);
    EXPECT_EQ(t.gather(), dense);
    // Element (b=1, s=2, h=1, d=3) through the view's strides.
    const int64_t at = t.view.batch_stride + 2 * t.view.seq_stride + t.view.head_stride + 3;
    EXPECT_EQ(cpu::load_element(t.view.data, at, t.dtype), float(((1 * 5 + 2) * 3 + 1) * 7 + 3));
    EXPECT_EQ(t.touched_outside_view(), 0);
  }
  HostTensor sdpa(DType::f32, 2, 5, 3, 7, Layout::bhsd);
  EXPECT_EQ(sdpa.view.seq_stride, 7);
  EXPECT_EQ(sdpa.view.head_stride, 35);
}

TEST(Support, PoisonIsNanAndOutOfViewWritesAreCounted) {
  HostTensor t(DType::f16, 1, 4, 2, 8, Layout::padded);
  for (double x : t.gather()) EXPECT_TRUE(std::isnan(x));
  cpu::store_element(t.view.data, 8, t.dtype, 1.0f);  // the gap after head 0 of row 0
  cpu::store_element(t.view.data, t.elements() - 1, t.dtype, 1.0f);  // the guard tail
  EXPECT_EQ(t.touched_outside_view(), 2);
}

TEST(Support, HostProblemFillsInputsAndPoisonsOutputs) {
  ProblemShape s;
  s.seqlens_q = {3, 0, 5};
  s.seqlens_k = {4, 2, 0};
  s.heads_q = 4;
  s.heads_kv = 2;
  s.headdim_qk = 8;
  s.headdim_v = 4;
  HostProblem hp(s);
  EXPECT_EQ(hp.problem.batch, 3);
  EXPECT_EQ(hp.problem.seqlen_q, 5);
  EXPECT_EQ(hp.problem.total_q, 8);
  EXPECT_EQ(hp.problem.total_k, 6);
  EXPECT_EQ(hp.cu_seqlens_q, (std::vector<int32_t>{0, 3, 3, 8}));
  EXPECT_EQ(hp.lse_elements(), 4 * 8);
  for (double x : hp.q.gather()) EXPECT_TRUE(std::isfinite(x));
  for (double x : hp.o.gather()) EXPECT_TRUE(std::isnan(x));
  for (double x : hp.gather_lse()) EXPECT_TRUE(std::isnan(x));
  EXPECT_EQ(hp.lse_guard_touched(), 0);
}

TEST(Support, CompareIsStrictAboutNonFiniteValues) {
  const double inf = std::numeric_limits<double>::infinity(), nan = std::nan("");
  EXPECT_EQ(compare({1.0, -inf}, {1.0, -inf}).max_abs, 0.0);
  EXPECT_EQ(compare({1.0, 0.0}, {1.0, -inf}).nonfinite, 1);
  EXPECT_EQ(compare({nan, 0.0}, {1.0, 0.0}).nonfinite, 1);
  EXPECT_TRUE(std::isinf(compare({nan}, {1.0}).max_abs));
  const ErrorStats e = compare({1.0, 2.5}, {1.0, 2.0});
  EXPECT_EQ(e.max_abs, 0.5);
  EXPECT_EQ(e.worst, 1);
  EXPECT_NEAR(e.rel_l2, 0.5 / std::sqrt(5.0), 1e-15);
  EXPECT_TRUE(within({1.0, 2.09}, {1.0, 2.0}, 0.05, 0.0));
  EXPECT_FALSE(within({1.0, 2.2}, {1.0, 2.0}, 0.05, 0.0));
  EXPECT_FALSE(within({nan}, {1.0}, 1.0, 1.0));
}

}  // namespace
}  // namespace tileattn::test
