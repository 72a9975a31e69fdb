// The public entry points run the problem the caller meant: normalisation (default scale, causal
// as window_right = 0) and backend dispatch are checked end to end against the float64 oracle,
// which is handed the same problem spelled out explicitly.
#include <gtest/gtest.h>

#include <cmath>

#include "cpu/reference.hpp"
#include "support/host_problem.hpp"
#include "support/metrics.hpp"
#include "tileattn/attention.hpp"

namespace tileattn::test {
namespace {

// fp32 on the CPU backend accumulates in fp32 over at most a few dozen terms here.
constexpr double kTol = 2e-5;

ProblemShape gqa_causal_shape() {
  ProblemShape s;
  s.batch = 2;
  s.seqlen_q = 7;
  s.seqlen_k = 12;  // bottom-right aligned causal
  s.heads_q = 4;
  s.heads_kv = 2;
  s.headdim_qk = 16;
  s.headdim_v = 8;
  s.dtype = DType::f32;
  s.causal = true;  // window_right left at -1: validation folds it
  return s;
}

// The oracle's problem: the default scale written out and causal spelled as the window it means.
AttentionProblem explicit_problem(const AttentionProblem& p) {
  AttentionProblem e = p;
  e.softmax_scale = float(1.0 / std::sqrt(double(p.headdim_qk)));
  e.causal = false;
  e.window_right = 0;
  return e;
}

TEST(Dispatch, ForwardUsesDefaultScaleAndCausalWindow) {
  HostProblem hp(gqa_causal_shape());
  hp.problem.backend = Backend::automatic;  // host memory: resolves to cpu
  ASSERT_FALSE(hp.problem.softmax_scale.has_value());
  forward(hp.problem);
  const cpu::ReferenceForward ref = cpu::reference_forward(explicit_problem(hp.problem));
  EXPECT_TRUE(within(hp.o.gather(), ref.o, kTol, kTol)) << "O";
  EXPECT_TRUE(within(hp.gather_lse(), ref.lse, kTol, kTol)) << "L";
  EXPECT_EQ(hp.o.touched_outside_view(), 0);
  EXPECT_EQ(hp.lse_guard_touched(), 0);
}

TEST(Dispatch, BackwardUsesDefaultScaleAndCausalWindow) {
  HostProblem hp(gqa_causal_shape());
  forward(hp.problem);
  backward(hp.problem);
  const cpu::ReferenceBackward ref = cpu::reference_backward(explicit_problem(hp.problem));
  EXPECT_TRUE(within(hp.dq.gather(), ref.dq, kTol, kTol)) << "dQ";
  EXPECT_TRUE(within(hp.dk.gather(), ref.dk, kTol, kTol)) << "dK";
  EXPECT_TRUE(within(hp.dv.gather(), ref.dv, kTol, kTol)) << "dV";
}

TEST(Dispatch, AnInvalidProblemWritesNothing) {
  HostProblem hp(gqa_causal_shape());
  hp.problem.window_left = -3;  // below -1
  EXPECT_THROW(forward(hp.problem), Error);
  const std::vector<double> o = hp.o.gather();
  for (double x : o) ASSERT_TRUE(std::isnan(x)) << "O was written although validation failed";
}

TEST(Dispatch, SoftmaxMatmulRunsOnTheCpu) {
  SoftmaxMatmulShape s;
  s.batch = 2;
  s.d1 = 5;
  s.d2 = 33;
  s.d3 = 6;
  HostSoftmaxMatmul hs(s);
  hs.problem.backend = Backend::automatic;
  softmax_matmul(hs.problem);
  EXPECT_TRUE(within(hs.out.gather(), cpu::reference_softmax_matmul(hs.problem), kTol, kTol));
  EXPECT_EQ(hs.out.touched_outside_view(), 0);
}

}  // namespace
}  // namespace tileattn::test
