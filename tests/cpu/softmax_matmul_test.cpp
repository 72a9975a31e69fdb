// softmax(X) @ V on the CPU against the float64 oracle, over shapes around the tile size, dtypes,
// padded strides and peaky rows (large X, where a softmax without max subtraction overflows).
#include <gtest/gtest.h>

#include "cpu/reference.hpp"
#include "support/host_problem.hpp"
#include "support/metrics.hpp"
#include "tileattn/attention.hpp"

namespace tileattn::test {
namespace {

struct Case {
  int64_t batch, d1, d2, d3;
  DType dtype;
  bool padded;
  float x_scale;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << "b=" << c.batch << " d1=" << c.d1 << " d2=" << c.d2 << " d3=" << c.d3 << " dtype=" << int(c.dtype);
}

class SoftmaxMatmul : public testing::TestWithParam<Case> {};

// Same tolerance rule as the attention sweep: fp32 accumulation slack (1e-5 of the output scale,
// an order above what is observed) plus one rounding of the stored output.
TEST_P(SoftmaxMatmul, TiledMatchesOracle) {
  const Case c = GetParam();
  SoftmaxMatmulShape shape;
  shape.batch = c.batch;
  shape.d1 = c.d1;
  shape.d2 = c.d2;
  shape.d3 = c.d3;
  shape.dtype = c.dtype;
  shape.padded = c.padded;
  shape.x_scale = c.x_scale;
  shape.num_threads = 2;
  HostSoftmaxMatmul hs(shape);
  hs.problem.backend = Backend::cpu;
  tileattn::softmax_matmul(hs.problem);
  const std::vector<double> want = cpu::reference_softmax_matmul(hs.problem);
  const double scale = std::max(compare(want, want).max_ref, 1.0);
  const double rel = c.dtype == DType::f32 ? 0.0 : unit_roundoff(c.dtype);
  EXPECT_TRUE(within(hs.out.gather(), want, rel, 2e-5 * scale));
  EXPECT_EQ(hs.out.touched_outside_view(), 0);
}

INSTANTIATE_TEST_SUITE_P(Cpu, SoftmaxMatmul,
                         testing::Values(Case{1, 1, 1, 1, DType::f32, false, 1.0f},
                                         Case{2, 63, 64, 32, DType::f32, false, 1.0f},
                                         Case{3, 65, 65, 100, DType::f32, true, 1.0f},
                                         Case{1, 200, 1000, 64, DType::f32, false, 1.0f},
                                         Case{2, 130, 300, 17, DType::f32, false, 40.0f},
                                         Case{2, 130, 300, 17, DType::f16, true, 8.0f},
                                         Case{2, 70, 129, 256, DType::f16, false, 1.0f},
                                         Case{2, 70, 129, 80, DType::bf16, false, 1.0f},
                                         Case{1, 33, 500, 64, DType::bf16, true, 40.0f}));

// Rows of X that are -inf throughout give zero rows (every key masked, as in attention), not
// NaN; rows with some keys -inf match the oracle.
TEST(SoftmaxMatmulMaskedRows, FullyMaskedRowsGiveZeros) {
  for (DType dt : {DType::f32, DType::bf16}) {
    SoftmaxMatmulShape shape;
    shape.batch = 2, shape.d1 = 40, shape.d2 = 300, shape.d3 = 24, shape.dtype = dt;
    shape.masked_rows = true;
    shape.num_threads = 2;
    HostSoftmaxMatmul hs(shape);
    hs.problem.backend = Backend::cpu;
    tileattn::softmax_matmul(hs.problem);
    const std::vector<double> want = cpu::reference_softmax_matmul(hs.problem);
    const std::vector<double> got = hs.out.gather();
    int64_t zero_rows = 0;
    for (int64_t row = 0; row < shape.batch * shape.d1; ++row) {
      if (!SoftmaxMatmulShape::row_fully_masked(row % shape.d1)) continue;
      ++zero_rows;
      for (int64_t d = 0; d < shape.d3; ++d) EXPECT_EQ(got[size_t(row * shape.d3 + d)], 0.0) << "row " << row;
    }
    EXPECT_EQ(zero_rows, 12);
    const double rel = dt == DType::f32 ? 0.0 : unit_roundoff(dt);
    EXPECT_TRUE(within(got, want, rel, 2e-5 * std::max(compare(want, want).max_ref, 1.0)));
  }
}

}  // namespace
}  // namespace tileattn::test
