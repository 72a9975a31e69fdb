// Varlen buffers may hold more rows than the sequences cover (cu_seqlens_q[batch] < total_q,
// cu_seqlens_k[batch] < total_k; accepted by design). Those rows belong to no sequence: the forward
// writes O = 0 and L = -inf there, the backward dQ = 0 past cu_seqlens_q[batch] and dK = dV = 0
// past cu_seqlens_k[batch]. Outputs start poisoned (NaN patterns), so a row left unwritten fails.
#include <gtest/gtest.h>

#include <cmath>

#include "cpu/reference.hpp"
#include "support/host_problem.hpp"
#include "support/metrics.hpp"
#include "tileattn/attention.hpp"

namespace tileattn::test {
namespace {

// Rows [r0, rows) of a dense (rows, heads, width) array are exactly 0.
void expect_zero_from(const std::vector<double>& got, int64_t r0, int64_t heads, int64_t width, const char* what) {
  const size_t begin = size_t(r0 * heads * width);
  ASSERT_LE(begin, got.size());
  int64_t bad = 0;
  for (size_t i = begin; i < got.size(); ++i) bad += got[i] != 0.0;
  EXPECT_EQ(bad, 0) << what << ": elements past row " << r0 << " that are not 0 (of " << got.size() - begin << ")";
}

struct Case {
  std::vector<int32_t> covered_q, covered_k;  // the sequences the problem describes
  int32_t tail_q, tail_k;                     // rows after them that no sequence covers
  bool causal;
  int threads;
};

void check(const Case& c, DType dtype) {
  ProblemShape shape;
  // The tail rows are allocated as one more sequence, which the problem then leaves out.
  shape.seqlens_q = c.covered_q;
  shape.seqlens_k = c.covered_k;
  shape.seqlens_q.push_back(c.tail_q);
  shape.seqlens_k.push_back(c.tail_k);
  shape.heads_q = 4;
  shape.heads_kv = 2;
  shape.headdim_qk = 24;
  shape.headdim_v = 40;
  shape.causal = c.causal;
  shape.dtype = dtype;
  shape.num_threads = c.threads;
  HostProblem hp(shape);
  AttentionProblem& p = hp.problem;
  p.batch = int64_t(c.covered_q.size());
  p.backend = Backend::cpu;
  const int64_t first_q = p.cu_seqlens_q[p.batch], first_k = p.cu_seqlens_k[p.batch];
  ASSERT_LT(first_q, p.total_q);
  ASSERT_LT(first_k, p.total_k);

  tileattn::forward(p);
  tileattn::backward(p);

  expect_zero_from(hp.o.gather(), first_q, p.heads_q, p.headdim_v, "O");
  expect_zero_from(hp.dq.gather(), first_q, p.heads_q, p.headdim_qk, "dQ");
  expect_zero_from(hp.dk.gather(), first_k, p.heads_kv, p.headdim_qk, "dK");
  expect_zero_from(hp.dv.gather(), first_k, p.heads_kv, p.headdim_v, "dV");
  const auto lse = hp.gather_lse();
  for (int64_t h = 0; h < p.heads_q; ++h)
    for (int64_t r = first_q; r < p.total_q; ++r) EXPECT_EQ(lse[size_t(h * p.total_q + r)], -INFINITY) << "L head " << h << " row " << r;
  EXPECT_EQ(hp.lse_guard_touched(), 0);
  for (const HostTensor* t : {&hp.o, &hp.dq, &hp.dk, &hp.dv}) EXPECT_EQ(t->touched_outside_view(), 0);

  // The covered rows are untouched by the tail: they match the oracle, which gives the tail the
  // same zeros and -inf.
  const auto ref = cpu::reference_forward(p);
  const auto grad = cpu::reference_backward(p);
  const double rel = dtype == DType::f32 ? 0.0 : 2.0 * unit_roundoff(dtype);
  EXPECT_TRUE(within(hp.o.gather(), ref.o, rel, 1e-4)) << "O";
  EXPECT_TRUE(within(lse, ref.lse, 0.0, 1e-4)) << "L";
  EXPECT_TRUE(within(hp.dq.gather(), grad.dq, rel, 1e-3)) << "dQ";
  EXPECT_TRUE(within(hp.dk.gather(), grad.dk, rel, 1e-3)) << "dK";
  EXPECT_TRUE(within(hp.dv.gather(), grad.dv, rel, 1e-3)) << "dV";
}

class UncoveredRows : public testing::TestWithParam<DType> {};

TEST_P(UncoveredRows, AfterSeveralSequences) { check({{70, 3, 90}, {66, 5, 80}, 37, 29, false, 2}, GetParam()); }

TEST_P(UncoveredRows, CausalOneThread) { check({{5, 130}, {9, 64}, 10, 70, true, 1}, GetParam()); }

TEST_P(UncoveredRows, OnlyQuerySideOrOnlyKeySideLonger) {
  check({{20}, {33}, 65, 1, false, 2}, GetParam());
  check({{20}, {33}, 1, 65, true, 2}, GetParam());
}

// Every sequence empty: the whole buffer is tail.
TEST_P(UncoveredRows, NoRowCovered) { check({{0}, {0}, 12, 7, false, 2}, GetParam()); }

INSTANTIATE_TEST_SUITE_P(Cpu, UncoveredRows, testing::Values(DType::f32, DType::f16, DType::bf16),
                         [](const testing::TestParamInfo<DType>& param) {
                           return param.param == DType::f32 ? "f32" : param.param == DType::f16 ? "f16" : "bf16";
                         });

}  // namespace
}  // namespace tileattn::test
