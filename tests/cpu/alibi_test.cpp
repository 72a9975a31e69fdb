// ALiBi in the float64 oracle, against flash-attn 2's definition written out here independently:
// its kernel adds slope * j to the (soft-capped) score when it takes its causal branch (right
// bound 0, no left bound) and -slope * |i + sk - sq - j| otherwise, per sequence, and returns the
// LSE of those biased scores. O is the same either way; the oracle must give that O and that LSE.
// The oracle's gradient with a bias is checked against finite differences of its own forward.
// The tiled CPU backend is compared with the oracle in attention_sweep_test (ALiBi cases there).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/reference.hpp"
#include "support/host_problem.hpp"
#include "support/metrics.hpp"
#include "tileattn/attention.hpp"

namespace tileattn::test {
namespace {

struct Expected {
  std::vector<double> o, lse;
};

// flash-attn's forward on the gathered inputs, one (sequence, head) score matrix at a time.
Expected flash_attn_formula(const HostProblem& hp) {
  const ProblemShape& sh = hp.shape;
  const AttentionProblem& p = hp.problem;
  const std::vector<double> q = hp.q.gather(), k = hp.k.gather(), v = hp.v.gather();
  const int64_t hq = p.heads_q, hkv = p.heads_kv, dqk = p.headdim_qk, dv = p.headdim_v;
  const int64_t rows_q = hp.rows_q();
  const double scale = sh.softmax_scale ? double(*sh.softmax_scale) : 1.0 / std::sqrt(double(dqk));
  // flash-attn's causal flag after its own normalisation: window_left >= seqlen_k means none.
  const int64_t right = sh.causal ? 0 : sh.window_right;
  const int64_t left = sh.window_left >= p.seqlen_k ? -1 : sh.window_left;
  const bool causal_branch = right == 0 && left < 0;
  Expected e;
  e.o.assign(size_t(rows_q * hq * dv), 0.0);
  e.lse.assign(size_t(rows_q * hq), -std::numeric_limits<double>::infinity());
  for (int64_t b = 0; b < p.batch; ++b) {
    const bool varlen = p.is_varlen();
    const int64_t q0 = varlen ? p.cu_seqlens_q[b] : b * p.seqlen_q, k0 = varlen ? p.cu_seqlens_k[b] : b * p.seqlen_k;
    const int64_t sq = varlen ? p.cu_seqlens_q[b + 1] - q0 : p.seqlen_q;
    const int64_t sk = varlen ? p.cu_seqlens_k[b + 1] - k0 : p.seqlen_k;
    for (int64_t h = 0; h < hq; ++h) {
      const double slope = p.alibi_slopes[b * p.alibi_batch_stride + h];
      const int64_t hk = h / (hq / hkv);
      for (int64_t i = 0; i < sq; ++i) {
        std::vector<double> s(size_t(sk), -std::numeric_limits<double>::infinity());
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < sk; ++j) {
          const int64_t diag = i + sk - sq;
          if ((left >= 0 && j < diag - left) || (right >= 0 && j > diag + right)) continue;
          double x = 0.0;
          for (int64_t d = 0; d < dqk; ++d) x += q[size_t(((q0 + i) * hq + h) * dqk + d)] * k[size_t(((k0 + j) * hkv + hk) * dqk + d)];
          x *= scale;
          if (sh.softcap > 0.0f) x = sh.softcap * std::tanh(x / sh.softcap);
          x += causal_branch ? slope * double(j) : -slope * std::fabs(double(diag - j));
          s[size_t(j)] = x;
          m = std::max(m, x);
        }
        if (m == -std::numeric_limits<double>::infinity()) continue;
        double sum = 0.0;
        for (double& x : s) sum += (x = std::exp(x - m));
        const int64_t li = varlen ? h * p.total_q + q0 + i : (b * hq + h) * p.seqlen_q + i;
        e.lse[size_t(li)] = m + std::log(sum);
        for (int64_t j = 0; j < sk; ++j)
          for (int64_t d = 0; d < dv; ++d)
            e.o[size_t(((q0 + i) * hq + h) * dv + d)] += s[size_t(j)] / sum * v[size_t(((k0 + j) * hkv + hk) * dv + d)];
      }
    }
  }
  return e;
}

ProblemShape small(int64_t sq, int64_t sk) {
  ProblemShape s;
  s.batch = 2;
  s.seqlen_q = sq;
  s.seqlen_k = sk;
  s.heads_q = 4;
  s.heads_kv = 2;
  s.headdim_qk = 8;
  s.headdim_v = 6;
  s.alibi = ProblemShape::Alibi::per_batch_head;
  return s;
}

void expect_oracle_matches_formula(const ProblemShape& shape) {
  HostProblem hp(shape);
  const cpu::ReferenceForward ref = cpu::reference_forward(hp.problem);
  const Expected want = flash_attn_formula(hp);
  EXPECT_TRUE(within(ref.o, want.o, 1e-12, 1e-12)) << "O";
  EXPECT_TRUE(within(ref.lse, want.lse, 1e-12, 1e-12)) << "L";
}

TEST(AlibiOracle, NonCausal) { expect_oracle_matches_formula(small(9, 9)); }
TEST(AlibiOracle, NonCausalShorterQueries) { expect_oracle_matches_formula(small(5, 13)); }
TEST(AlibiOracle, NonCausalLongerQueries) { expect_oracle_matches_formula(small(13, 5)); }

TEST(AlibiOracle, CausalLCarriesFlashAttnsRowConstant) {
  for (auto [sq, sk] : {std::pair<int64_t, int64_t>{9, 9}, {5, 13}, {13, 5}}) {
    auto s = small(sq, sk);
    s.causal = true;
    expect_oracle_matches_formula(s);
  }
}

TEST(AlibiOracle, SlopesPerHeadSharedByTheBatch) {
  auto s = small(7, 11);
  s.alibi = ProblemShape::Alibi::per_head;
  s.causal = true;
  expect_oracle_matches_formula(s);
}

TEST(AlibiOracle, Softcap) {
  auto s = small(8, 10);
  s.softcap = 2.0f;
  s.softmax_scale = 0.8f;
  expect_oracle_matches_formula(s);
  s.causal = true;
  expect_oracle_matches_formula(s);
}

// flash-attn picks the form from the window, not the flag: a window (-1, 0) is its causal branch,
// causal with a left bound is not, and a left bound reaching every key counts as none.
TEST(AlibiOracle, FormFollowsTheWindow) {
  auto s = small(9, 12);
  s.window_right = 0;
  expect_oracle_matches_formula(s);
  s.window_right = -1;
  s.causal = true;
  s.window_left = 3;
  expect_oracle_matches_formula(s);
  s.window_left = 12;
  expect_oracle_matches_formula(s);
  s.causal = false;
  s.window_left = 2;
  s.window_right = 4;
  expect_oracle_matches_formula(s);
}

TEST(AlibiOracle, VarlenBiasPerSequence) {
  auto s = small(0, 0);
  s.seqlens_q = {3, 0, 7, 5};
  s.seqlens_k = {6, 2, 7, 0};
  expect_oracle_matches_formula(s);
  s.causal = true;
  expect_oracle_matches_formula(s);
}

// Without the bias the same inputs give another O: the bias is really applied.
TEST(AlibiOracle, BiasChangesTheOutput) {
  HostProblem hp(small(9, 9));
  const cpu::ReferenceForward with = cpu::reference_forward(hp.problem);
  hp.problem.alibi_slopes = nullptr;
  const cpu::ReferenceForward without = cpu::reference_forward(hp.problem);
  EXPECT_GT(compare(with.o, without.o).max_abs, 1e-3);
}

// sum(O * dO) by central differences (as reference_test does), with the bias in both forms.
double loss(const AttentionProblem& p, const std::vector<double>& q, const std::vector<double>& k,
            const std::vector<double>& v, const std::vector<double>& dout) {
  const auto f = cpu::reference_forward_dense(p, q, k, v);
  double l = 0.0;
  for (size_t i = 0; i < f.o.size(); ++i) l += f.o[i] * dout[i];
  return l;
}

void expect_gradient_matches_differences(const ProblemShape& shape) {
  HostProblem hp(shape);
  std::vector<double> q = hp.q.gather(), k = hp.k.gather(), v = hp.v.gather();
  const std::vector<double> dout = hp.dout.gather();
  const auto grad = cpu::reference_backward_dense(hp.problem, q, k, v, dout);
  constexpr double h = 1e-5, tol = 1e-7;
  auto check = [&](std::vector<double>& param, const std::vector<double>& analytic, const char* name) {
    for (size_t i = 0; i < param.size(); ++i) {
      const double saved = param[i];
      param[i] = saved + h;
      const double up = loss(hp.problem, q, k, v, dout);
      param[i] = saved - h;
      const double down = loss(hp.problem, q, k, v, dout);
      param[i] = saved;
      EXPECT_NEAR(analytic[i], (up - down) / (2.0 * h), tol) << name << "[" << i << "]";
    }
  };
  check(q, grad.dq, "dQ");
  check(k, grad.dk, "dK");
  check(v, grad.dv, "dV");
}

TEST(AlibiOracleGradient, MatchesFiniteDifferences) {
  auto s = small(4, 5);
  s.headdim_qk = 3;
  s.headdim_v = 2;
  expect_gradient_matches_differences(s);
  s.causal = true;
  s.softcap = 1.5f;
  s.softmax_scale = 0.9f;
  expect_gradient_matches_differences(s);
}

TEST(AlibiOracleGradient, MatchesFiniteDifferencesVarlen) {
  auto s = small(0, 0);
  s.headdim_qk = 3;
  s.headdim_v = 2;
  s.seqlens_q = {3, 0, 4, 2};
  s.seqlens_k = {2, 3, 5, 0};
  s.causal = true;
  expect_gradient_matches_differences(s);
}

}  // namespace
}  // namespace tileattn::test
