// AttentionProblem::partial_keys on the CUDA backward: the keys of one problem are split into two
// or three parts, each part's backward runs on the device with the whole problem's O and L, and dQ
// summed over the parts, dK and dV put side by side must be the whole problem's gradients: the 2x
// rule against the float64 oracle (naive: tests/support/naive.hpp's partial-key form in the same
// precision, P from the given L and D from the given O), and within twice that allowance of the
// whole backward run on the device. fp32 is the path the
// option changes (no row-statistics pass: P from the given L, D from the given O); fp16/bf16 form
// P and D that way already and must keep doing so with the option set. Without the option the
// fp32 split is wrong (each part renormalised over its own keys): the last test shows it, so the
// comparison can fail.
#include <gtest/gtest.h>

#include <cstddef>
#include <string>
#include <vector>

#include "gpu_test_util.cuh"
#include "support/naive.hpp"
#include "tileattn/attention.hpp"
#include "tileattn/error.hpp"

namespace tileattn::test {
namespace {

const char* dtype_label(DType d) { return d == DType::f32 ? "f32" : d == DType::f16 ? "f16" : "bf16"; }

TensorView from_row(const TensorView& t, int64_t row, DType dtype) {
  TensorView v = t;
  v.data = static_cast<std::byte*>(t.data) + row * t.seq_stride * (dtype == DType::f32 ? 4 : 2);
  return v;
}

struct Case {
  int64_t batch, seqlen_q, seqlen_k, heads_q, heads_kv, headdim_qk, headdim_v;
  bool causal;
  std::vector<int64_t> cuts;  // interior key cuts
  float softcap = 0.0f;
  Layout layout = Layout::bshd;
};

ProblemShape shape_of(const Case& c, DType dtype) {
  ProblemShape s;
  s.batch = c.batch;
  s.seqlen_q = c.seqlen_q;
  s.seqlen_k = c.seqlen_k;
  s.heads_q = c.heads_q;
  s.heads_kv = c.heads_kv;
  s.headdim_qk = c.headdim_qk;
  s.headdim_v = c.headdim_v;
  s.dtype = dtype;
  s.causal = c.causal;
  s.softcap = c.softcap;
  s.layout = c.layout;
  return s;
}

struct SplitGrads {
  std::vector<double> dq, dk, dv;
  int64_t touched_outside = 0;  // writes outside the dK/dV views (poison checked)
};

// Each key part [k0, k1) as its own device backward with the whole problem's O and L, its mask
// the whole one restricted to it (window_right = sk - k1 when causal: tileattn.distributed's
// placement). dQ of each part lands in a poisoned buffer and is summed in double; dK and dV of the
// parts fill one poisoned whole-length buffer each.
SplitGrads split_backward(const HostProblem& hp, const AttentionProblem& device_whole, const Case& c,
                          bool partial_keys) {
  const DType dt = hp.problem.dtype;
  HostTensor dq_part(dt, c.batch, c.seqlen_q, c.heads_q, c.headdim_qk, c.layout);
  HostTensor dk_all(dt, c.batch, c.seqlen_k, c.heads_kv, c.headdim_qk, c.layout);
  HostTensor dv_all(dt, c.batch, c.seqlen_k, c.heads_kv, c.headdim_v, c.layout);
  DeviceBuffer dq_d(dq_part.bytes.data(), dq_part.bytes.size());
  DeviceBuffer dk_d(dk_all.bytes.data(), dk_all.bytes.size());
  DeviceBuffer dv_d(dv_all.bytes.data(), dv_all.bytes.size());
  const std::vector<std::byte> dq_poison = dq_part.bytes;
  std::vector<int64_t> bounds = {0};
  bounds.insert(bounds.end(), c.cuts.begin(), c.cuts.end());
  bounds.push_back(c.seqlen_k);
  SplitGrads g;
  for (size_t part = 0; part + 1 < bounds.size(); ++part) {
    const int64_t k0 = bounds[part], k1 = bounds[part + 1];
    dq_d.upload(dq_poison.data());
    AttentionProblem p = device_whole;
    p.seqlen_k = k1 - k0;
    p.k = from_row(device_whole.k, k0, dt);
    p.v = from_row(device_whole.v, k0, dt);
    TensorView dk = dk_all.view, dv = dv_all.view, dq = dq_part.view;
    dk.data = dk_d.get(), dv.data = dv_d.get(), dq.data = dq_d.get();
    p.dk = from_row(dk, k0, dt);
    p.dv = from_row(dv, k0, dt);
    p.dq = dq;
    p.causal = false;
    p.window_left = -1;
    p.window_right = c.causal ? c.seqlen_k - k1 : -1;
    p.partial_keys = partial_keys;
    tileattn::backward(p);
    check_cuda(cudaDeviceSynchronize(), "partial backward");
    dq_d.download(dq_part.bytes.data());
    g.touched_outside += dq_part.touched_outside_view();
    const std::vector<double> dq_h = dq_part.gather();
    if (g.dq.empty()) g.dq.assign(dq_h.size(), 0.0);
    for (size_t i = 0; i < dq_h.size(); ++i) g.dq[i] += dq_h[i];
  }
  dk_d.download(dk_all.bytes.data());
  dv_d.download(dv_all.bytes.data());
  g.touched_outside += dk_all.touched_outside_view() + dv_all.touched_outside_view();
  g.dk = dk_all.gather();
  g.dv = dv_all.gather();
  return g;
}

constexpr int kTrials = 3;

void check_case(const Case& c, DType dtype) {
  for (int trial = 0; trial < kTrials; ++trial) {
    HostProblem hp(shape_of(c, dtype));
    DeviceProblem dp(hp);
    try {
      tileattn::forward(dp.problem);
      tileattn::backward(dp.problem);  // the whole problem's gradients, for the comparison below
    } catch (const Error& e) {
      // A narrowed build (TILEATTN_HEADDIMS) lacks the bucket; every other error is a failure.
      if (e.kind() == ErrorKind::unsupported) GTEST_SKIP() << e.what();
      throw;
    }
    dp.download();  // O and L into hp, for the naive implementation and the oracle
    const SplitGrads split = split_backward(hp, dp.problem, c, true);
    const AttentionProblem host = host::validate_attention(hp.problem, host::Pass::backward, Backend::cpu);
    const auto oracle = cpu::reference_backward(host);
    // The naive partial-key backward: P from the given L, D from the given O (the whole
    // problem's), each in the dtype; the whole naive backward forms P from its own softmax, which
    // no backward over part of the keys can.
    NaiveOptions partial;
    partial.probs_from_lse = true;
    const NaiveResult naive = naive_attention(host, partial);
    SCOPED_TRACE(std::string(dtype_label(dtype)) + " trial " + std::to_string(trial));
    EXPECT_EQ(split.touched_outside, 0);
    const std::vector<double> whole[] = {hp.dq.gather(), hp.dk.gather(), hp.dv.gather()};
    const std::vector<double>* parts[] = {&split.dq, &split.dk, &split.dv};
    const std::vector<double>* naives[] = {&naive.dq, &naive.dk, &naive.dv};
    const std::vector<double>* oracles[] = {&oracle.dq, &oracle.dk, &oracle.dv};
    const char* names[] = {"dQ (sum of parts)", "dK (parts)", "dV (parts)"};
    for (int t = 0; t < 3; ++t) {
      const double floor = output_floor(dtype, compare(*oracles[t], *oracles[t]).max_ref);
      EXPECT_TRUE(within_2x(names[t], *parts[t], *naives[t], *oracles[t], floor));
      const double allowed = 2 * (2 * compare(*naives[t], *oracles[t]).max_abs + floor);
      EXPECT_LE(compare(*parts[t], whole[t]).max_abs, allowed) << names[t] << " against the whole backward";
    }
    if (::testing::Test::HasFailure()) return;
  }
}

const Case kCases[] = {
    {1, 128, 192, 2, 2, 64, 64, false, {64}},
    {2, 200, 200, 4, 2, 64, 64, true, {100}},
    {1, 130, 300, 6, 2, 40, 24, true, {17, 190}},
    {1, 96, 96, 2, 1, 32, 48, false, {1, 95}, 5.0f, Layout::padded},
    {1, 64, 160, 2, 2, 8, 64, false, {80}},
};

TEST(PartialKeysCuda, Fp32) {
  TA_SKIP_WITHOUT_GPU();
  for (const Case& c : kCases) check_case(c, DType::f32);
}

TEST(PartialKeysCuda, Fp16) {
  TA_SKIP_WITHOUT_GPU();
  for (const Case& c : kCases) check_case(c, DType::f16);
}

TEST(PartialKeysCuda, Bf16) {
  TA_SKIP_WITHOUT_GPU();
  for (const Case& c : kCases) check_case(c, DType::bf16);
}

// Without the option the fp32 backward rebuilds each row's statistics over the part's own keys,
// and the parts no longer add up to the whole gradient.
TEST(PartialKeysCuda, Fp32WithoutTheOptionThePartsDoNotAddUp) {
  TA_SKIP_WITHOUT_GPU();
  const Case c{1, 128, 192, 2, 2, 64, 64, false, {64}};
  HostProblem hp(shape_of(c, DType::f32));
  DeviceProblem dp(hp);
  try {
    tileattn::forward(dp.problem);
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::unsupported) GTEST_SKIP() << e.what();
    throw;
  }
  dp.download();
  const SplitGrads split = split_backward(hp, dp.problem, c, false);
  const AttentionProblem host = host::validate_attention(hp.problem, host::Pass::backward, Backend::cpu);
  const auto oracle = cpu::reference_backward(host);
  const NaiveResult naive = naive_attention(host);
  EXPECT_FALSE(within_2x("dQ (sum of parts)", split.dq, naive.dq, oracle.dq,
                         output_floor(DType::f32, compare(oracle.dq, oracle.dq).max_ref)));
}

}  // namespace
}  // namespace tileattn::test
