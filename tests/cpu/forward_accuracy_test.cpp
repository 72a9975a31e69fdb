// The CPU forward against flash-attn's 2x rule (support/metrics.hpp, docs/accuracy.md) where the
// scores are large: a score spread scale * sqrt(headdim) of 8-30 (softmax_scale up to ~2, head
// dims up to 256). There the weights exp(s - max) are decided by the last bits of long dot
// products, so any rounding beyond the one a BLAS product makes shows in O and L.
//
// The CPU forward used to sum each score in one fp32 running sum over the head dim; at head dim
// 256 that made O 2.6-3.1x the error of the torch naive implementation (whose MKL product is
// more accurate than one running sum: mean error 2.4e-6 against 3.2e-6), and the fuzzer's
// fp32_large_scores family failed. Summing in runs of 16 (tile_ops.hpp, kGemmChunk) fixed it. The
// naive implementation here sums its scores in runs of 16 too (NaiveOptions::score_run): at
// head dim 256 that is at least as accurate as MKL's products (mean error 1.3e-6), where the
// default naive implementation's one running sum is less accurate than MKL's, and the old forward
// passed against it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "cpu/reference.hpp"
#include "support/host_problem.hpp"
#include "support/metrics.hpp"
#include "support/naive.hpp"
#include "tileattn/attention.hpp"

namespace tileattn::test {
namespace {

constexpr int kTrials = 10;
constexpr double kFloor = 1e-6;  // fp32, as tests/python/test_attention.py
constexpr int64_t kScoreRun = 16;

struct Case {
  int64_t seqlen_q, seqlen_k, headdim_qk, headdim_v;
  float scale;
  bool causal;
};

void check_trials(const Case& c) {
  for (int trial = 0; trial < kTrials; ++trial) {
    ProblemShape shape;
    shape.batch = 2;
    shape.seqlen_q = c.seqlen_q;
    shape.seqlen_k = c.seqlen_k;
    shape.heads_q = 4;
    shape.heads_kv = 2;
    shape.headdim_qk = c.headdim_qk;
    shape.headdim_v = c.headdim_v;
    shape.causal = c.causal;
    shape.softmax_scale = c.scale;
    shape.num_threads = 2;
    HostProblem hp(shape);
    AttentionProblem& p = hp.problem;
    p.backend = Backend::cpu;
    tileattn::forward(p);
    const auto oracle = cpu::reference_forward(p);
    const NaiveResult naive = naive_attention(p, {.score_run = kScoreRun});
    SCOPED_TRACE("trial " + std::to_string(trial));
    // L's magnitude grows with the scores; the floor scales with it as the Python fuzzer's does.
    double lse_magnitude = 1.0;
    for (double x : oracle.lse) lse_magnitude = std::max(lse_magnitude, std::abs(x));
    std::vector<double> lse(hp.lse.begin(), hp.lse.begin() + std::ptrdiff_t(oracle.lse.size()));
    EXPECT_TRUE(two_x_rule(hp.o.gather(), naive.o, oracle.o, kFloor)) << "O";
    EXPECT_TRUE(two_x_rule(lse, naive.lse, oracle.lse, kFloor * lse_magnitude)) << "L";
    if (::testing::Test::HasFailure()) return;
  }
}

TEST(ForwardAccuracy, Fp32LargeScores) {
  check_trials({38, 38, 256, 71, 1.86f, false});    // the fuzzer's case: spread ~30
  check_trials({100, 130, 256, 64, 1.0f, true});    // spread 16, several key tiles
  check_trials({150, 150, 64, 64, 2.0f, false});    // spread 16, online rescaling across tiles
  check_trials({200, 200, 16, 16, 2.0f, true});     // spread 8 with short dot products
}

}  // namespace
}  // namespace tileattn::test
