// The CPU backward against flash-attn's 2x rule (support/metrics.hpp, docs/accuracy.md) where it
// used to break: fp32 with headdim_v much larger than headdim_qk (dP = dO V^T is a long sum that
// dS = P (dP - D) cancels against D), a single visible key (dQ and dK are exactly 0, and so is
// a naive implementation's), and fp16 at seqlen 2. Each case runs several trials on fresh random
// inputs: the failures were 6-9 trials in 10.
#include <gtest/gtest.h>

#include "cpu/reference.hpp"
#include "support/host_problem.hpp"
#include "support/metrics.hpp"
#include "support/naive.hpp"
#include "tileattn/attention.hpp"

namespace tileattn::test {
namespace {

constexpr int kTrials = 10;

struct Case {
  int64_t seqlen_q, seqlen_k, headdim_qk, headdim_v;
  DType dtype;
  bool causal;
  bool alibi = false;
  bool lse_grad = false;
};

void check_trials(const Case& c) {
  for (int trial = 0; trial < kTrials; ++trial) {
    ProblemShape shape;
    shape.seqlen_q = c.seqlen_q;
    shape.seqlen_k = c.seqlen_k;
    shape.heads_q = shape.heads_kv = 2;
    shape.headdim_qk = c.headdim_qk;
    shape.headdim_v = c.headdim_v;
    shape.dtype = c.dtype;
    shape.causal = c.causal;
    if (c.alibi) shape.alibi = ProblemShape::Alibi::per_head;
    shape.lse_grad = c.lse_grad;
    shape.num_threads = 2;
    HostProblem hp(shape);
    AttentionProblem& p = hp.problem;
    p.backend = Backend::cpu;
    tileattn::forward(p);
    tileattn::backward(p);
    const auto oracle_fwd = cpu::reference_forward(p);
    const auto oracle = cpu::reference_backward(p);
    const NaiveResult naive = naive_attention(p);
    // Gradients reach past 10 here (dK at headdim_v 256), where the fixed floor is two fp32 ulps:
    // it takes two more of the largest element, as flash-attn's tests add the reference's own
    // rounding at its magnitude. (Scaled as a whole it let a D off by 16 ulps through.)
    const auto grad_floor = [&](const std::vector<double>& ref) {
      return 2 * two_x_floor(c.dtype) + 4 * unit_roundoff(DType::f32) * compare(ref, ref).max_ref;
    };
    SCOPED_TRACE("trial " + std::to_string(trial));
    EXPECT_TRUE(two_x_rule(hp.o.gather(), naive.o, oracle_fwd.o, two_x_floor(c.dtype))) << "O";
    EXPECT_TRUE(two_x_rule(hp.dq.gather(), naive.dq, oracle.dq, grad_floor(oracle.dq))) << "dQ";
    EXPECT_TRUE(two_x_rule(hp.dk.gather(), naive.dk, oracle.dk, grad_floor(oracle.dk))) << "dK";
    EXPECT_TRUE(two_x_rule(hp.dv.gather(), naive.dv, oracle.dv, grad_floor(oracle.dv))) << "dV";
    if (::testing::Test::HasFailure()) return;
  }
}

TEST(BackwardAccuracy, Fp32SmallHeaddimQkLargeHeaddimV) {
  for (int64_t d : {1, 2, 3, 4}) {
    SCOPED_TRACE("headdim_qk " + std::to_string(d));
    check_trials({33, 33, d, 256, DType::f32, false});
    check_trials({100, 70, d, 256, DType::f32, d % 2 == 0});
  }
}

// Head dims where D = rowsum(O * dO) is used (src/cpu/backward.cpp, use_consistent_delta).
TEST(BackwardAccuracy, Fp32DFromO) {
  check_trials({64, 80, 16, 256, DType::f32, false});
  check_trials({50, 50, 64, 64, DType::f32, true});
  check_trials({33, 33, 128, 32, DType::f32, false});
}

// A gradient for L too (problem.hpp's dlse): D less dL, on every way D is formed (rowsum(O dO),
// rowsum(P dP) over the row's tiles or from one tile) and through ALiBi's causal-form offset.
TEST(BackwardAccuracy, LseGradient) {
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    SCOPED_TRACE(dt == DType::f32 ? "f32" : dt == DType::f16 ? "f16" : "bf16");
    check_trials({50, 50, 64, 64, dt, true, false, true});
    check_trials({33, 100, 16, 256, dt, false, false, true});
    check_trials({100, 70, 32, 64, dt, true, true, true});
    check_trials({7, 9, 4, 8, dt, false, false, true});
  }
}

// ALiBi: in the causal form the backward reads L less slope * (i + sk - sq), recovered from a
// stored fp32 L whose rounding grows with that offset.
TEST(BackwardAccuracy, Alibi) {
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    SCOPED_TRACE(dt == DType::f32 ? "f32" : dt == DType::f16 ? "f16" : "bf16");
    check_trials({120, 120, 64, 64, dt, true, true});
    check_trials({70, 200, 32, 64, dt, false, true});
    check_trials({200, 70, 64, 32, dt, true, true});
  }
}

TEST(BackwardAccuracy, Fp32OneVisibleKeyGivesZeroDqDk) {
  check_trials({20, 1, 8, 192, DType::f32, false});
  // One key: P = 1 exactly, and dS = P (dP - D) with D = rowsum(dO * O) = dO . V = dP is exactly 0.
  for (int trial = 0; trial < kTrials; ++trial) {
    ProblemShape shape;
    shape.seqlen_q = 20;
    shape.seqlen_k = 1;
    shape.headdim_qk = 8;
    shape.headdim_v = 192;
    HostProblem hp(shape);
    hp.problem.backend = Backend::cpu;
    tileattn::forward(hp.problem);
    tileattn::backward(hp.problem);
    for (double x : hp.dq.gather()) ASSERT_EQ(x, 0.0) << "dQ";
    for (double x : hp.dk.gather()) ASSERT_EQ(x, 0.0) << "dK";
  }
}

// Values repeated along the sequence (stride 0, as expand() gives): every dP of a row is the same
// value, so dS = P (dP - D) and dQ, dK are exactly 0, as in a naive implementation; D from
// rowsum(O * dO) left O's rounding summed over headdim_v (dQ up to 8e-6 at 2 keys, headdim 205).
// Two keys take the one-tile path (D from the tile's own P and dP), 100 the consistent pass.
TEST(BackwardAccuracy, Fp32RepeatedValuesGiveZeroDqDk) {
  for (int64_t keys : {2, 100}) {
    SCOPED_TRACE("seqlen_k " + std::to_string(keys));
    for (int trial = 0; trial < kTrials; ++trial) {
      ProblemShape shape;
      shape.batch = 2;
      shape.seqlen_q = 3;
      shape.seqlen_k = keys;
      shape.headdim_qk = shape.headdim_v = 205;
      shape.num_threads = 2;
      HostProblem hp(shape);
      hp.problem.v.seq_stride = 0;
      hp.problem.backend = Backend::cpu;
      tileattn::forward(hp.problem);
      tileattn::backward(hp.problem);
      for (double x : hp.dq.gather()) ASSERT_EQ(x, 0.0) << "dQ";
      for (double x : hp.dk.gather()) ASSERT_EQ(x, 0.0) << "dK";
    }
  }
}

TEST(BackwardAccuracy, Fp16SeqlenTwo) {
  check_trials({2, 2, 16, 16, DType::f16, false});
  check_trials({2, 2, 64, 64, DType::f16, true});
}

}  // namespace
}  // namespace tileattn::test
