// The oracle itself: its analytic gradient against central finite differences of its own float64
// forward, and its forward against closed forms and decompositions it must satisfy (uniform
// attention, GQA as repeated heads, varlen as separate sequences).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/reference.hpp"
#include "support/host_problem.hpp"
#include "support/metrics.hpp"

namespace tileattn::test {
namespace {

using cpu::reference_backward_dense;
using cpu::reference_forward_dense;

struct Dense {
  std::vector<double> q, k, v, dout;
};

Dense dense_inputs(const HostProblem& hp) { return {hp.q.gather(), hp.k.gather(), hp.v.gather(), hp.dout.gather()}; }

// sum(O * dO) + sum(L * dL) over the rows that see a key (dL: the problem's dlse, when set): its
// gradient with respect to Q, K, V is exactly what backward returns for dO and dL.
double loss(const AttentionProblem& p, const Dense& x) {
  const auto f = reference_forward_dense(p, x.q, x.k, x.v);
  double l = 0.0;
  for (size_t i = 0; i < f.o.size(); ++i) l += f.o[i] * x.dout[i];
  if (p.dlse != nullptr)
    for (size_t i = 0; i < f.lse.size(); ++i)
      if (std::isfinite(f.lse[i])) l += f.lse[i] * double(p.dlse[i]);
  return l;
}

// Central differences with step h: truncation error ~h^2 * |f'''| ~ 1e-10 and cancellation error
// ~1e-16 * |loss| / h ~ 1e-10 for these magnitudes, so 1e-7 separates a correct gradient from a
// wrong one (a missing softcap derivative or scale is an O(0.1) difference).
void expect_gradient_matches_differences(const ProblemShape& shape) {
  HostProblem hp(shape);
  Dense x = dense_inputs(hp);
  const auto grad = reference_backward_dense(hp.problem, x.q, x.k, x.v, x.dout);
  constexpr double h = 1e-5, tol = 1e-7;
  auto check = [&](std::vector<double>& param, const std::vector<double>& analytic, const char* name) {
    ASSERT_EQ(param.size(), analytic.size()) << name;
    for (size_t i = 0; i < param.size(); ++i) {
      const double saved = param[i];
      param[i] = saved + h;
      const double up = loss(hp.problem, x);
      param[i] = saved - h;
      const double down = loss(hp.problem, x);
      param[i] = saved;
      EXPECT_NEAR(analytic[i], (up - down) / (2.0 * h), tol) << name << "[" << i << "]";
    }
  };
  check(x.q, grad.dq, "dQ");
  check(x.k, grad.dk, "dK");
  check(x.v, grad.dv, "dV");
}

ProblemShape tiny() {
  ProblemShape s;
  s.seqlen_q = 4;
  s.seqlen_k = 5;
  s.heads_q = 4;
  s.heads_kv = 2;
  s.headdim_qk = 3;
  s.headdim_v = 2;
  s.batch = 2;
  return s;
}

TEST(ReferenceGradient, MatchesFiniteDifferences) { expect_gradient_matches_differences(tiny()); }

TEST(ReferenceGradient, MatchesFiniteDifferencesCausalWithMaskedRows) {
  auto s = tiny();
  s.seqlen_q = 6;  // sq > sk: the first row sees no key
  s.causal = true;
  expect_gradient_matches_differences(s);
}

TEST(ReferenceGradient, MatchesFiniteDifferencesWindow) {
  auto s = tiny();
  s.window_left = 1;
  s.window_right = 1;
  expect_gradient_matches_differences(s);
}

TEST(ReferenceGradient, MatchesFiniteDifferencesSoftcap) {
  auto s = tiny();
  s.softcap = 1.5f;
  s.softmax_scale = 0.9f;  // scores of a few units: tanh is well inside its curved part
  expect_gradient_matches_differences(s);
}

// D from the given O. With O the oracle's own forward (rounded to fp32), the gradient is the exact
// one up to that rounding, on a layout where a wrong row, head or sequence of O would show
// (varlen, GQA, causal with rows that see no key). With one row's O moved by e, D moves by
// dO . e there, and dQ_i = scale sum_j P_ij (dP_ij - D_i) K_j by -scale (dO . e) (P K)_i in that
// row only; (P K)_i is the forward with K in place of V.
TEST(ReferenceGradient, GivenOFormsDFromTheProblemsO) {
  auto s = tiny();
  s.headdim_v = s.headdim_qk;  // so that P K is a forward
  s.seqlens_q = {3, 0, 6, 2};
  s.seqlens_k = {2, 3, 5, 0};
  s.causal = true;
  HostProblem hp(s);
  const auto fwd = cpu::reference_forward(hp.problem);
  hp.o.scatter(fwd.o);
  const auto exact = cpu::reference_backward(hp.problem);
  const auto given = cpu::reference_backward(hp.problem, cpu::OracleDelta::given_o);
  const double max_ref = compare(exact.dq, exact.dq).max_ref;
  EXPECT_TRUE(within(given.dq, exact.dq, 0.0, 1e-6 * max_ref)) << "dQ";
  EXPECT_TRUE(within(given.dk, exact.dk, 0.0, 1e-6 * max_ref)) << "dK";
  EXPECT_EQ(compare(given.dv, exact.dv).max_abs, 0.0) << "dV does not involve D";

  // Dense row 7 is query 4 of the third sequence (6 queries, 5 keys: it sees keys 0..3), head 1.
  const int64_t row = 7, head = 1, hq = s.heads_q, d = s.headdim_qk;
  const size_t at = size_t((row * hq + head) * d);
  const std::vector<double> o_before = hp.o.gather(), dout = hp.dout.gather(), q = hp.q.gather(), k = hp.k.gather();
  std::vector<double> o = o_before;
  // Each component moves with its dO's sign, so that the shift dO . e cannot cancel to near zero
  // (a fixed e left |dO . e| below 1e-3 for about one draw in a thousand).
  for (int64_t c = 0; c < d; ++c)
    o[at + size_t(c)] += (dout[at + size_t(c)] < 0.0 ? -0.25 : 0.25) * double(c + 1);
  hp.o.scatter(o);
  const std::vector<double> o_after = hp.o.gather();  // the shift as stored (fp32)
  double shift = 0.0;
  for (int64_t c = 0; c < d; ++c) shift += dout[at + size_t(c)] * (o_after[at + size_t(c)] - o_before[at + size_t(c)]);
  const auto moved = cpu::reference_backward(hp.problem, cpu::OracleDelta::given_o);
  const auto pk = reference_forward_dense(hp.problem, q, k, k).o;
  const double scale = 1.0 / std::sqrt(double(d));
  for (size_t i = 0; i < given.dq.size(); ++i) {
    const bool in_row = i >= at && i < at + size_t(d);
    const double want = given.dq[i] - (in_row ? scale * shift * pk[i] : 0.0);
    EXPECT_NEAR(moved.dq[i], want, 1e-12 * std::max(1.0, std::fabs(want))) << "dQ[" << i << "]";
  }
  EXPECT_GT(std::fabs(shift), 1e-3);
}

// P from the given L. With O and L the oracle's own forward (rounded to fp32), the gradient is the
// exact one up to that rounding. With each row's L raised by its own d_r, that row's P is
// exp(-d_r) times what it was and D (from the given O) is unchanged, so its dQ row scales by
// exp(-d_r), exactly but for double rounding: a row, head or sequence of L read from the wrong
// place would show. Rows that see no key keep L = -inf and zero gradients.
TEST(ReferenceGradient, GivenStatsFormsPFromTheProblemsL) {
  auto s = tiny();
  s.seqlens_q = {3, 0, 6, 2};
  s.seqlens_k = {2, 3, 5, 0};
  s.causal = true;
  s.softcap = 2.0f;
  HostProblem hp(s);
  const auto fwd = cpu::reference_forward(hp.problem);
  hp.o.scatter(fwd.o);
  for (size_t r = 0; r < fwd.lse.size(); ++r) hp.lse[r] = float(fwd.lse[r]);
  const auto exact = cpu::reference_backward(hp.problem);
  const auto given = cpu::reference_backward(hp.problem, cpu::OracleDelta::given_stats);
  const char* names[] = {"dQ", "dK", "dV"};
  const std::vector<double>* exacts[] = {&exact.dq, &exact.dk, &exact.dv};
  const std::vector<double>* givens[] = {&given.dq, &given.dk, &given.dv};
  for (int t = 0; t < 3; ++t)
    EXPECT_TRUE(within(*givens[t], *exacts[t], 0.0, 1e-6 * compare(*exacts[t], *exacts[t]).max_ref)) << names[t];

  const int64_t rows = hp.rows_q(), hq = s.heads_q, d = s.headdim_qk;
  const std::vector<float> before(hp.lse.begin(), hp.lse.begin() + hp.lse_elements());
  int64_t empty_rows = 0;
  for (size_t r = 0; r < before.size(); ++r) {
    empty_rows += std::isinf(before[r]) ? 1 : 0;
    hp.lse[r] += 0.125f * float(r % 7 + 1);
  }
  const auto moved = cpu::reference_backward(hp.problem, cpu::OracleDelta::given_stats);
  // Exact up to double rounding of dQ's terms, which may cancel to a row far below the tensor's
  // largest element; a wrong factor (at least 12% off) stands far above it.
  const double tolerance = 1e-12 * compare(given.dq, given.dq).max_ref;
  for (int64_t row = 0; row < rows; ++row)
    for (int64_t h = 0; h < hq; ++h) {
      const size_t l = size_t(h * rows + row);  // L's varlen layout: (heads_q, total_q)
      const double factor = std::isinf(before[l]) ? 0.0 : std::exp(double(before[l]) - double(hp.lse[l]));
      for (int64_t c = 0; c < d; ++c) {
        const size_t i = size_t((row * hq + h) * d + c);
        EXPECT_NEAR(moved.dq[i], factor * given.dq[i], tolerance) << "dQ row " << row << " head " << h;
      }
    }
  EXPECT_GT(empty_rows, 0);
}

TEST(ReferenceGradient, MatchesFiniteDifferencesVarlen) {
  auto s = tiny();
  s.seqlens_q = {3, 0, 4, 2};
  s.seqlens_k = {2, 3, 5, 0};
  s.causal = true;
  expect_gradient_matches_differences(s);
}

// A loss that reads L too: each row's scores get dL_i P_ij besides dO's part, through the cap and
// ALiBi's bias alike; rows that see no key (causal sq > sk, an empty varlen sequence) get none.
TEST(ReferenceGradient, MatchesFiniteDifferencesWithLseGradient) {
  auto s = tiny();
  s.lse_grad = true;
  expect_gradient_matches_differences(s);
  s.seqlen_q = 6;
  s.causal = true;
  s.alibi = ProblemShape::Alibi::per_head;
  expect_gradient_matches_differences(s);
  s = tiny();
  s.lse_grad = true;
  s.softcap = 1.5f;
  s.softmax_scale = 0.9f;
  expect_gradient_matches_differences(s);
  s = tiny();
  s.lse_grad = true;
  s.seqlens_q = {3, 0, 4, 2};
  s.seqlens_k = {2, 3, 5, 0};
  s.window_left = 1;
  expect_gradient_matches_differences(s);
}

// With all keys equal, every visible key gets the same weight: O is the mean of the visible V
// rows, and L = score + log(count). Visibility written from the flash-attn rule, not from Mask.
TEST(ReferenceForward, UniformScoresAverageVisibleValues) {
  for (auto [left, right] : {std::pair<int64_t, int64_t>{-1, -1}, {-1, 0}, {2, 1}, {0, 3}}) {
    ProblemShape s;
    s.seqlen_q = 9;
    s.seqlen_k = 6;
    s.headdim_qk = 4;
    s.window_left = left;
    s.window_right = right;
    HostProblem hp(s);
    Dense x = dense_inputs(hp);
    for (int64_t j = 0; j < 6; ++j)
      for (int64_t d = 0; d < 4; ++d) x.k[size_t(j * 4 + d)] = x.k[size_t(d)];
    const auto f = reference_forward_dense(hp.problem, x.q, x.k, x.v);
    for (int64_t i = 0; i < 9; ++i) {
      const int64_t diag = i + 6 - 9;
      std::vector<double> mean(4, 0.0);
      int count = 0;
      for (int64_t j = 0; j < 6; ++j) {
        if ((left >= 0 && j < diag - left) || (right >= 0 && j > diag + right)) continue;
        ++count;
        for (int64_t d = 0; d < 4; ++d) mean[size_t(d)] += x.v[size_t(j * 4 + d)];
      }
      double score = 0.0;
      for (int64_t d = 0; d < 4; ++d) score += x.q[size_t(i * 4 + d)] * x.k[size_t(d)] * 0.5;  // scale 1/sqrt(4)
      for (int64_t d = 0; d < 4; ++d)
        EXPECT_NEAR(f.o[size_t(i * 4 + d)], count ? mean[size_t(d)] / count : 0.0, 1e-12) << i << " " << d;
      if (count) {
        EXPECT_NEAR(f.lse[size_t(i)], score + std::log(double(count)), 1e-12) << i;
      } else {
        EXPECT_EQ(f.lse[size_t(i)], -INFINITY) << i;
      }
    }
  }
}

// GQA is MHA with each K/V head repeated over its group: outputs agree, and dK/dV of a kv head
// are the sums of the repeated heads' gradients.
TEST(ReferenceForward, GqaEqualsRepeatedHeads) {
  ProblemShape s;
  s.seqlen_q = 7;
  s.seqlen_k = 11;
  s.heads_q = 6;
  s.heads_kv = 2;
  s.headdim_qk = 5;
  s.headdim_v = 3;
  s.causal = true;
  HostProblem hp(s);
  const Dense x = dense_inputs(hp);
  ProblemShape m = s;
  m.heads_kv = 6;
  HostProblem mhp(m);
  Dense y = x;
  y.k.assign(size_t(11 * 6 * 5), 0.0);
  y.v.assign(size_t(11 * 6 * 3), 0.0);
  for (int64_t j = 0; j < 11; ++j)
    for (int64_t h = 0; h < 6; ++h) {
      for (int64_t d = 0; d < 5; ++d) y.k[size_t((j * 6 + h) * 5 + d)] = x.k[size_t((j * 2 + h / 3) * 5 + d)];
      for (int64_t d = 0; d < 3; ++d) y.v[size_t((j * 6 + h) * 3 + d)] = x.v[size_t((j * 2 + h / 3) * 3 + d)];
    }
  const auto fg = reference_forward_dense(hp.problem, x.q, x.k, x.v);
  const auto fm = reference_forward_dense(mhp.problem, y.q, y.k, y.v);
  EXPECT_TRUE(within(fg.o, fm.o, 0.0, 1e-14));
  EXPECT_TRUE(within(fg.lse, fm.lse, 0.0, 1e-14));
  const auto gg = reference_backward_dense(hp.problem, x.q, x.k, x.v, x.dout);
  const auto gm = reference_backward_dense(mhp.problem, y.q, y.k, y.v, y.dout);
  EXPECT_TRUE(within(gg.dq, gm.dq, 0.0, 1e-14));
  std::vector<double> dk(gg.dk.size(), 0.0), dv(gg.dv.size(), 0.0);
  for (int64_t j = 0; j < 11; ++j)
    for (int64_t h = 0; h < 6; ++h) {
      for (int64_t d = 0; d < 5; ++d) dk[size_t((j * 2 + h / 3) * 5 + d)] += gm.dk[size_t((j * 6 + h) * 5 + d)];
      for (int64_t d = 0; d < 3; ++d) dv[size_t((j * 2 + h / 3) * 3 + d)] += gm.dv[size_t((j * 6 + h) * 3 + d)];
    }
  EXPECT_TRUE(within(gg.dk, dk, 0.0, 1e-13));
  EXPECT_TRUE(within(gg.dv, dv, 0.0, 1e-13));
}

// A varlen batch is its sequences run one at a time (each with its own bottom-right alignment).
TEST(ReferenceForward, VarlenEqualsSeparateSequences) {
  ProblemShape s;
  s.seqlens_q = {3, 8, 1};
  s.seqlens_k = {5, 4, 6};
  s.heads_q = 2;
  s.heads_kv = 1;
  s.headdim_qk = 4;
  s.window_left = 2;
  s.causal = true;
  HostProblem hp(s);
  const Dense x = dense_inputs(hp);
  const auto fv = reference_forward_dense(hp.problem, x.q, x.k, x.v);
  const auto gv = reference_backward_dense(hp.problem, x.q, x.k, x.v, x.dout);
  int64_t q0 = 0, k0 = 0;
  for (size_t b = 0; b < 3; ++b) {
    const int64_t sq = s.seqlens_q[b], sk = s.seqlens_k[b];
    ProblemShape one = s;
    one.seqlens_q.clear();
    one.seqlens_k.clear();
    one.seqlen_q = sq;
    one.seqlen_k = sk;
    HostProblem ohp(one);
    auto rows = [](const std::vector<double>& a, int64_t r0, int64_t n, int64_t width) {
      return std::vector<double>(a.begin() + r0 * width, a.begin() + (r0 + n) * width);
    };
    const Dense y{rows(x.q, q0, sq, 8), rows(x.k, k0, sk, 4), rows(x.v, k0, sk, 4), rows(x.dout, q0, sq, 8)};
    const auto f = reference_forward_dense(ohp.problem, y.q, y.k, y.v);
    const auto g = reference_backward_dense(ohp.problem, y.q, y.k, y.v, y.dout);
    EXPECT_EQ(rows(fv.o, q0, sq, 8), f.o) << b;
    EXPECT_EQ(rows(gv.dq, q0, sq, 8), g.dq) << b;
    EXPECT_EQ(rows(gv.dk, k0, sk, 4), g.dk) << b;
    EXPECT_EQ(rows(gv.dv, k0, sk, 4), g.dv) << b;
    for (int64_t h = 0; h < 2; ++h)  // varlen L is (heads, total_q); fixed is (batch=1, heads, sq)
      for (int64_t i = 0; i < sq; ++i)
        EXPECT_EQ(fv.lse[size_t(h * hp.problem.total_q + q0 + i)], f.lse[size_t(h * sq + i)]) << b;
    q0 += sq;
    k0 += sk;
  }
}

}  // namespace
}  // namespace tileattn::test
