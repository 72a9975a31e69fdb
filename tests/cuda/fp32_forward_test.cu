// fp32 attention forward on the GPU against the float64 oracle.
//   exact mode: the 2x rule against a naive fp32 kernel (plain FMA, no TF32);
//   fast mode (TF32): a TF32 bound, documented in docs/perf.md.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "cpu/reference.hpp"
#include "gpu_test_util.cuh"
#include "host/validate.hpp"
#include "tileattn/attention.hpp"

namespace tileattn::test {
namespace {

// Fast mode (Q and P rounded to TF32, K and V truncated; gpu_test_util.cuh's kTf32Roundoff): a
// score moves by about 3u * scale * sqrt(sum (q_i k_i)^2) ~ 3u for scale = 1/sqrt(d)
// and N(0, 1) inputs, which moves P relatively by as much; P and V add 3u. 16u of the largest
// output (resp. of max(1, |L|)) leaves room for the tails of a few hundred thousand outputs.
constexpr double kFastRelBound = 16 * kTf32Roundoff;

struct Case {
  std::string name;
  ProblemShape shape;
};

ProblemShape base(int64_t sq, int64_t sk, int64_t d) {
  ProblemShape s;
  s.batch = 2;
  s.seqlen_q = sq;
  s.seqlen_k = sk;
  s.heads_q = 2;
  s.heads_kv = 2;
  s.headdim_qk = d;
  s.with_backward = false;
  return s;
}

std::vector<Case> cases() {
  std::vector<Case> c;
  c.push_back({"plain_d64", base(200, 200, 64)});
  {
    auto s = base(257, 257, 64);
    s.causal = true;
    c.push_back({"causal_square", s});
  }
  {
    auto s = base(100, 300, 128);
    s.causal = true;
    c.push_back({"causal_sq_lt_sk", s});
  }
  {
    auto s = base(300, 100, 64);  // bottom-right: the first 200 rows see no key
    s.causal = true;
    c.push_back({"causal_sq_gt_sk_masked_rows", s});
  }
  {
    auto s = base(333, 333, 32);
    s.window_left = 32;
    s.window_right = 16;
    c.push_back({"window", s});
  }
  {
    auto s = base(150, 220, 64);
    s.softcap = 1.5f;
    s.softmax_scale = 0.5f;
    c.push_back({"softcap", s});
  }
  {
    auto s = base(130, 170, 80);
    s.heads_q = 6;
    s.heads_kv = 2;
    c.push_back({"gqa_d80", s});
  }
  {
    auto s = base(1, 1, 64);
    s.seqlens_q = {37, 0, 150, 64, 5};
    s.seqlens_k = {50, 20, 150, 0, 300};
    s.causal = true;
    c.push_back({"varlen_with_empty", s});
  }
  {
    auto s = base(150, 700, 64);  // several key tiles and a tail, shared K/V heads
    s.heads_q = 4;
    c.push_back({"gqa_d64_long_keys", s});
  }
  {
    // Long key ranges: on Hopper, exact mode's fresh P V accumulators per 32 keys add up over
    // 64 tiles; the tail tile is partial.
    auto s = base(130, 4100, 64);
    c.push_back({"long_keys_d64", s});
    auto t = base(2000, 2000, 32);
    t.batch = 1;
    t.causal = true;
    c.push_back({"long_causal_d32", t});
  }
  {
    auto s = base(90, 90, 64);
    s.layout = Layout::bhsd;
    s.window_left = 0;
    s.window_right = 0;
    c.push_back({"bhsd_diagonal_window", s});
  }
  {
    auto s = base(1, 1, 128);  // head dim 128 takes 64-key tiles and one raw V stage on Hopper
    s.seqlens_q = {70, 0, 200, 33};
    s.seqlens_k = {90, 30, 260, 0};
    s.window_left = 40;
    s.window_right = 8;
    s.softcap = 2.0f;
    c.push_back({"varlen_window_softcap_d128", s});
  }
  for (int64_t d : {32, 40, 96, 128, 160, 192, 256}) {
    auto s = base(140, 190, d);
    s.layout = Layout::padded;
    s.causal = d % 64 == 0;
    c.push_back({"headdim_" + std::to_string(d), s});
  }
  {
    auto s = base(120, 120, 64);
    s.headdim_v = 128;
    c.push_back({"dqk64_dv128", s});
  }
  {
    auto s = base(120, 77, 256);
    s.headdim_v = 32;
    s.causal = true;
    c.push_back({"dqk256_dv32", s});
  }
  {
    auto s = base(70, 90, 33);  // odd head dims take the 4-byte copy path
    s.headdim_v = 17;
    s.layout = Layout::bhsd;
    c.push_back({"odd_dims", s});
  }
  // ALiBi (on Hopper the ALiBi instances of the TF32 and split-TF32 kernels; exact mode at head
  // dim 128 the portable kernel): both L forms, GQA, sq != sk both ways, softcap underneath, a window, varlen per
  // sequence, both slope shapes, and head dim 128 (one raw V stage on Hopper).
  {
    using A = ProblemShape::Alibi;
    auto s = base(130, 170, 64);
    s.heads_q = 6;
    s.heads_kv = 2;
    s.alibi = A::per_head;
    c.push_back({"alibi_gqa", s});
    s.causal = true;
    s.alibi = A::per_batch_head;
    c.push_back({"alibi_gqa_causal", s});
    auto t = base(300, 100, 64);  // the first 200 rows see no key
    t.causal = true;
    t.softcap = 1.5f;
    t.softmax_scale = 0.5f;
    t.alibi = A::per_head;
    c.push_back({"alibi_softcap_causal_sq_gt_sk", t});
    auto u = base(100, 300, 64);
    u.causal = true;
    u.alibi = A::per_head;
    c.push_back({"alibi_causal_sq_lt_sk", u});
    auto w = base(200, 260, 64);
    w.window_left = 50;
    w.window_right = 20;
    w.alibi = A::per_batch_head;
    c.push_back({"alibi_window", w});
    auto v = base(1, 1, 64);
    v.seqlens_q = {37, 0, 150, 64, 5};
    v.seqlens_k = {50, 20, 150, 0, 300};
    v.alibi = A::per_batch_head;
    c.push_back({"alibi_varlen", v});
    v.causal = true;
    v.alibi = A::per_head;
    c.push_back({"alibi_varlen_causal", v});
    auto x = base(150, 330, 128);
    x.heads_q = 4;
    x.heads_kv = 1;
    x.causal = true;
    x.softcap = 3.0f;
    x.alibi = A::per_batch_head;
    c.push_back({"alibi_mqa_softcap_causal_d128", x});
  }
  return c;
}

class Fp32Forward : public testing::TestWithParam<Case> {};

// False when a narrowed build (TILEATTN_HEADDIMS) lacks the case's bucket: the caller skips.
// Every other error is a failure.
bool run(DeviceProblem& dp, Fp32Mode mode) {
  dp.poison_outputs();
  dp.problem.fp32_mode = mode;
  try {
    tileattn::forward(dp.problem);
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::unsupported && std::string(e.what()).find("head-dim bucket") != std::string::npos)
      return false;
    throw;
  }
  dp.download();
  return true;
}

TEST_P(Fp32Forward, ExactWithin2xOfNaiveFp32) {
  TA_SKIP_WITHOUT_GPU();
  HostProblem hp(GetParam().shape);
  const auto ref = cpu::reference_forward(host::validate_attention(hp.problem, host::Pass::forward, Backend::cpu));
  DeviceProblem dp(hp);
  const NaiveForward naive = naive_forward(dp.problem);
  if (!run(dp, Fp32Mode::exact)) GTEST_SKIP() << "head dim outside this build's buckets";
  const auto o = hp.o.gather();
  const auto lse = hp.gather_lse();
  const ErrorStats eo = compare(o, ref.o);
  EXPECT_TRUE(within_2x("O", o, naive.o, ref.o, output_floor(DType::f32, eo.max_ref)));
  const ErrorStats el = compare(lse, ref.lse);
  EXPECT_TRUE(within_2x("L", lse, naive.lse, ref.lse, output_floor(DType::f32, el.max_ref)));
  EXPECT_EQ(hp.o.touched_outside_view(), 0);
  EXPECT_EQ(hp.lse_guard_touched(), 0);
}

TEST_P(Fp32Forward, FastWithinTf32Bound) {
  TA_SKIP_WITHOUT_GPU();
  HostProblem hp(GetParam().shape);
  const auto ref = cpu::reference_forward(host::validate_attention(hp.problem, host::Pass::forward, Backend::cpu));
  DeviceProblem dp(hp);
  if (!run(dp, Fp32Mode::fast)) GTEST_SKIP() << "head dim outside this build's buckets";
  const ErrorStats eo = compare(hp.o.gather(), ref.o);
  const ErrorStats el = compare(hp.gather_lse(), ref.lse);
  EXPECT_EQ(eo.nonfinite, 0) << eo;
  EXPECT_EQ(el.nonfinite, 0) << el;
  EXPECT_LE(eo.max_abs, kFastRelBound * std::max(1.0, eo.max_ref)) << "O " << eo;
  EXPECT_LE(el.max_abs, kFastRelBound * std::max(1.0, el.max_ref)) << "L " << el;
  EXPECT_EQ(hp.o.touched_outside_view(), 0);
  EXPECT_EQ(hp.lse_guard_touched(), 0);
  RecordProperty("fast_o_max_abs", property_text(eo.max_abs));
  RecordProperty("fast_o_rel_l2", property_text(eo.rel_l2));
}

INSTANTIATE_TEST_SUITE_P(Sweep, Fp32Forward, testing::ValuesIn(cases()),
                         [](const testing::TestParamInfo<Case>& info) { return info.param.name; });

// Rows that see no key must come out as O = 0 and L = -inf exactly, in both modes.
TEST(Fp32ForwardMasked, EmptyRowsAreZeroWithMinusInfLse) {
  TA_SKIP_WITHOUT_GPU();
  auto s = base(200, 64, 64);
  s.causal = true;
  HostProblem hp(s);
  DeviceProblem dp(hp);
  for (Fp32Mode mode : {Fp32Mode::exact, Fp32Mode::fast}) {
    if (!run(dp, mode)) GTEST_SKIP() << "head dim outside this build's buckets";
    const auto o = hp.o.gather();
    const auto lse = hp.gather_lse();
    const int64_t rows = hp.rows_q(), h = s.heads_q, d = s.headdim_qk;
    int64_t bad = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = r % s.seqlen_q;
      if (i >= s.seqlen_q - s.seqlen_k) continue;  // this row sees keys
      for (int64_t hh = 0; hh < h; ++hh) {
        for (int64_t c = 0; c < d; ++c) bad += o[size_t((r * h + hh) * d + c)] != 0.0;
        const int64_t b = r / s.seqlen_q;
        bad += !(std::isinf(lse[size_t((b * h + hh) * s.seqlen_q + i)]) && lse[size_t((b * h + hh) * s.seqlen_q + i)] < 0);
      }
    }
    EXPECT_EQ(bad, 0) << (mode == Fp32Mode::exact ? "exact" : "fast");
  }
}

// A row that sees one key has P = 1 and O = V. Exact mode gives V bit for bit there, as a
// naive fp32 kernel does (Hopper: V in three TF32 parts holds every fp32 value exactly).
TEST(Fp32ForwardOneKey, ExactModeGivesVExactly) {
  TA_SKIP_WITHOUT_GPU();
  for (int64_t d : {32, 64, 128}) {
    auto s = base(300, 300, d);
    s.window_left = 0;
    s.window_right = 0;
    HostProblem hp(s);
    DeviceProblem dp(hp);
    if (!run(dp, Fp32Mode::exact)) continue;  // a head dim this build lacks
    const auto o = hp.o.gather(), v = hp.v.gather();
    ASSERT_EQ(o.size(), v.size());
    int64_t bad = 0;
    for (size_t i = 0; i < o.size(); ++i) bad += o[i] != v[i];
    EXPECT_EQ(bad, 0) << "head dim " << d << ": " << bad << " of " << o.size() << " outputs differ from V";
  }
}

// AttentionProblem::softmax_stats: where the exact Hopper kernel runs without a cap, each row's
// (max, sum) with L = max + log(sum) to fp32 rounding at |L| (and -inf, 0 for a row that sees no
// key); NaN everywhere else (a soft cap here, fast mode), never the poison it was handed.
TEST(Fp32ForwardSoftmaxStats, RowMaxAndSumOrNaN) {
  TA_SKIP_WITHOUT_GPU();
  auto s = base(300, 100, 64);  // bottom-right causal: the first 200 rows see no key
  s.causal = true;
  for (const auto [mode, softcap] : {std::pair{Fp32Mode::exact, 0.0f}, std::pair{Fp32Mode::exact, 2.0f},
                                     std::pair{Fp32Mode::fast, 0.0f}}) {
    SCOPED_TRACE(std::string(mode == Fp32Mode::exact ? "exact" : "fast") + " softcap " + std::to_string(softcap));
    s.softcap = softcap;
    HostProblem hp(s);
    DeviceProblem dp(hp);
    const size_t rows = size_t(hp.lse_elements());
    std::vector<float> stats(2 * rows, -123.0f);
    DeviceBuffer buffer(stats.data(), stats.size() * sizeof(float));
    dp.problem.softmax_stats = buffer.get<float>();
    if (!run(dp, mode)) GTEST_SKIP() << "head dim outside this build's buckets";
    buffer.download(stats.data());
    const bool written = mode == Fp32Mode::exact && softcap == 0.0f && hopper_kernels_run();
    int64_t bad = 0;
    for (size_t r = 0; r < rows; ++r) {
      const float m = stats[2 * r], l = stats[2 * r + 1], lse = hp.lse[r];
      if (!written) {
        bad += !(std::isnan(m) && std::isnan(l));
      } else if (std::isinf(lse)) {
        bad += !(m == -INFINITY && l == 0.0f);
      } else {
        // L's own roundings (its max in log2 units, the log, the sum) at the terms' magnitude.
        const double log_l = std::log(double(l)), gap = std::abs(double(m) + log_l - double(lse));
        bad += !(l >= 1.0f && gap <= 8 * 0x1p-24 * std::max({1.0, std::abs(double(m)), log_l}));
      }
    }
    EXPECT_EQ(bad, 0) << bad << " of " << rows << " rows";
  }
}

}  // namespace
}  // namespace tileattn::test
