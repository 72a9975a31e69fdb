// Rows that see no key (causal with seqlen_q > seqlen_k, windows past the keys, varlen sequences
// without keys) must give O = 0, L = -inf and zero gradients, exactly, never NaN; keys no query
// sees get dK = dV = 0.
#include <gtest/gtest.h>

#include <cmath>

#include "cpu/reference.hpp"
#include "support/host_problem.hpp"
#include "tileattn/attention.hpp"

namespace tileattn::test {
namespace {

// Rows the reference leaves all-zero must be exactly zero; `expect_empty`: the case has such rows.
void expect_rows_exact(const std::vector<double>& got, const std::vector<double>& want, int64_t width, const char* what,
                       bool expect_empty) {
  ASSERT_EQ(got.size(), want.size());
  int64_t empty_rows = 0, nonfinite = 0;
  for (size_t r = 0; r * width < got.size(); ++r) {
    bool empty = true;
    for (int64_t d = 0; d < width; ++d) empty = empty && want[r * width + d] == 0.0;
    for (int64_t d = 0; d < width; ++d) {
      nonfinite += !std::isfinite(got[r * width + d]);
      if (empty) ASSERT_EQ(got[r * width + d], 0.0) << what << " row " << r;
    }
    empty_rows += empty;
  }
  EXPECT_EQ(nonfinite, 0) << what;
  if (expect_empty) EXPECT_GT(empty_rows, 0) << what << ": the case should have rows the mask empties";
}

enum class Empty { queries, keys, both };

void check_masked_rows(const ProblemShape& shape, Empty empty_side) {
  const bool queries = empty_side != Empty::keys, keys = empty_side != Empty::queries;
  HostProblem hp(shape);
  hp.problem.backend = Backend::cpu;
  tileattn::forward(hp.problem);
  tileattn::backward(hp.problem);
  const auto ref = cpu::reference_forward(hp.problem);
  const auto grad = cpu::reference_backward(hp.problem);
  const int64_t dqk = shape.headdim_qk, dv = shape.headdim_v ? shape.headdim_v : dqk;
  expect_rows_exact(hp.o.gather(), ref.o, dv, "O", queries);
  expect_rows_exact(hp.dq.gather(), grad.dq, dqk, "dQ", queries);
  expect_rows_exact(hp.dk.gather(), grad.dk, dqk, "dK", keys);
  expect_rows_exact(hp.dv.gather(), grad.dv, dv, "dV", keys);
  const auto lse = hp.gather_lse();
  int64_t empty = 0;
  for (size_t i = 0; i < lse.size(); ++i) {
    if (ref.lse[i] == -INFINITY) {
      ++empty;
      EXPECT_EQ(lse[i], -INFINITY) << "L[" << i << "]";
    } else {
      EXPECT_TRUE(std::isfinite(lse[i])) << "L[" << i << "]";
    }
  }
  if (queries) EXPECT_GT(empty, 0);
}

ProblemShape shape(int64_t sq, int64_t sk, DType dt) {
  ProblemShape s;
  s.seqlen_q = sq;
  s.seqlen_k = sk;
  s.heads_q = 4;
  s.heads_kv = 2;
  s.headdim_qk = 40;
  s.dtype = dt;
  s.num_threads = 2;
  return s;
}

class MaskedRows : public testing::TestWithParam<DType> {};

TEST_P(MaskedRows, CausalWithMoreQueriesThanKeys) {
  auto s = shape(150, 70, GetParam());  // rows 0..79 see no key
  s.causal = true;
  check_masked_rows(s, Empty::queries);
}

TEST_P(MaskedRows, WindowEntirelyPastTheKeys) {
  auto s = shape(200, 20, GetParam());  // left window 5: rows 0..174 end before key 0
  s.window_left = 5;
  s.window_right = 0;
  check_masked_rows(s, Empty::queries);
}

TEST_P(MaskedRows, KeysNoQuerySees) {
  auto s = shape(10, 150, GetParam());  // query i sees keys [i + 135, i + 140]
  s.causal = true;
  s.window_left = 5;
  check_masked_rows(s, Empty::keys);
}

TEST_P(MaskedRows, VarlenSequencesWithoutKeysOrQueries) {
  auto s = shape(0, 0, GetParam());
  s.seqlens_q = {70, 3, 90, 0};
  s.seqlens_k = {0, 5, 66, 80};
  s.causal = true;
  check_masked_rows(s, Empty::both);
}

INSTANTIATE_TEST_SUITE_P(Cpu, MaskedRows, testing::Values(DType::f32, DType::f16, DType::bf16),
                         [](const testing::TestParamInfo<DType>& info) {
                           return info.param == DType::f32 ? "f32" : info.param == DType::f16 ? "f16" : "bf16";
                         });

}  // namespace
}  // namespace tileattn::test
