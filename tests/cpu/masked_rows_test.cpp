// Rows that see no key (causal with seqlen_q > seqlen_k, windows past the keys, varlen sequences
// without keys) must give O = 0, L = -inf and zero gradients, exactly, never NaN; keys no query
// sees get dK = dV = 0.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "cpu/reference.hpp"
#include "support/host_problem.hpp"
#include "tileattn/attention.hpp"

namespace tileattn::test {
namespace {

// Every (row, head) of `got` (dense (rows, heads, width)) flagged in `empty` must be exactly 0;
// nothing may be NaN or infinite.
void expect_rows_zero(const std::vector<double>& got, const std::vector<bool>& empty, int64_t width, const char* what) {
  ASSERT_EQ(got.size(), empty.size() * size_t(width));
  int64_t nonfinite = 0;
  for (size_t r = 0; r < empty.size(); ++r)
    for (int64_t d = 0; d < width; ++d) {
      nonfinite += !std::isfinite(got[r * width + d]);
      if (empty[r]) {
        ASSERT_EQ(got[r * width + d], 0.0) << what << " row " << r;
      }
    }
  EXPECT_EQ(nonfinite, 0) << what;
}

enum class Empty { queries, keys, both };

// Empty query rows are those whose reference L is -inf; keys no query sees are those whose
// reference dV row is 0 (any visible key gets P > 0 times a random dO). A row that sees a single
// key has a mathematically zero dQ too, but only up to rounding, so it is not flagged.
void check_masked_rows(const ProblemShape& shape, Empty empty_side) {
  HostProblem hp(shape);
  hp.problem.backend = Backend::cpu;
  tileattn::forward(hp.problem);
  tileattn::backward(hp.problem);
  const auto ref = cpu::reference_forward(hp.problem);
  const auto grad = cpu::reference_backward(hp.problem);
  const AttentionProblem& p = hp.problem;
  const int64_t dqk = p.headdim_qk, dv = p.headdim_v, hq = p.heads_q, hkv = p.heads_kv;

  std::vector<bool> empty_q(size_t(hp.rows_q() * hq)), empty_k(size_t(hp.rows_k() * hkv));
  for (int64_t r = 0; r < hp.rows_q(); ++r)
    for (int64_t h = 0; h < hq; ++h) {
      const int64_t l = p.is_varlen() ? h * p.total_q + r : ((r / p.seqlen_q) * hq + h) * p.seqlen_q + r % p.seqlen_q;
      empty_q[size_t(r * hq + h)] = ref.lse[size_t(l)] == -INFINITY;
    }
  for (size_t r = 0; r < empty_k.size(); ++r) {
    bool zero = true;
    for (int64_t d = 0; d < dv; ++d) zero = zero && grad.dv[r * dv + d] == 0.0;
    empty_k[r] = zero;
  }
  const auto count = [](const std::vector<bool>& v) { return std::count(v.begin(), v.end(), true); };
  if (empty_side != Empty::keys) {
    EXPECT_GT(count(empty_q), 0) << "the case should have queries that see no key";
  }
  if (empty_side != Empty::queries) {
    EXPECT_GT(count(empty_k), 0) << "the case should have keys no query sees";
  }

  expect_rows_zero(hp.o.gather(), empty_q, dv, "O");
  expect_rows_zero(hp.dq.gather(), empty_q, dqk, "dQ");
  expect_rows_zero(hp.dk.gather(), empty_k, dqk, "dK");
  expect_rows_zero(hp.dv.gather(), empty_k, dv, "dV");
  const auto lse = hp.gather_lse();
  for (size_t i = 0; i < lse.size(); ++i) {
    if (ref.lse[i] == -INFINITY) {
      EXPECT_EQ(lse[i], -INFINITY) << "L[" << i << "]";
    } else {
      EXPECT_TRUE(std::isfinite(lse[i])) << "L[" << i << "]";
    }
  }
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
                         [](const testing::TestParamInfo<DType>& param) {
                           return param.param == DType::f32 ? "f32" : param.param == DType::f16 ? "f16" : "bf16";
                         });

}  // namespace
}  // namespace tileattn::test
