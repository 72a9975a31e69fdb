// Attention dropout (flash-attn 2 semantics, problem.hpp): the Philox generator against published
// known-answer vectors, the keep rule's statistics, and the tiled CPU forward and backward against
// the float64 oracle with the same mask under the 2x rule (the naive implementation here applies
// the mask after a same-precision softmax, as a framework's dropout layer does). Also: same seed
// bitwise, other seeds other masks, p = 0 identical to no dropout, the validation messages and the
// CUDA backend's refusal.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "common/mask.hpp"
#include "common/philox.hpp"
#include "cpu/convert.hpp"
#include "cpu/reference.hpp"
#include "host/validate.hpp"
#include "support/host_problem.hpp"
#include "support/metrics.hpp"
#include "tileattn/attention.hpp"
#include "tileattn/error.hpp"

namespace tileattn::test {
namespace {

// Random123's known-answer vectors for philox4x32 with 10 rounds.
TEST(Philox, KnownAnswers) {
  struct Kat {
    Philox4 ctr;
    uint32_t k0, k1;
    Philox4 want;
  };
  const Kat kats[] = {
      {{0, 0, 0, 0}, 0, 0, {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
      {{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, 0xffffffffu, 0xffffffffu,
       {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
      {{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, 0xa4093822u, 0x299f31d0u,
       {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
  };
  for (const Kat& k : kats) {
    const Philox4 r = philox4x32_10(k.ctr, k.k0, k.k1);
    EXPECT_EQ(r.x, k.want.x);
    EXPECT_EQ(r.y, k.want.y);
    EXPECT_EQ(r.z, k.want.z);
    EXPECT_EQ(r.w, k.want.w);
  }
}

// The documented counter layout, spelled out once more by hand.
TEST(Philox, MaskRuleLayout) {
  const uint64_t seed = 0x0123456789abcdefull, offset = 0xfffffffffffffff0ull;  // offset + stream wraps
  const int64_t heads = 6;
  for (int64_t b : {0, 3})
    for (int64_t h : {0, 5})
      for (int64_t row : {0, 7, 1000})
        for (int64_t col : {0, 1, 2, 3, 4, 13, 4097}) {
          const uint64_t n = offset + uint64_t(b * heads + h);
          const Philox4 r = philox4x32_10({uint32_t(col / 4), uint32_t(row), uint32_t(n), uint32_t(n >> 32)},
                                          uint32_t(seed), uint32_t(seed >> 32));
          const uint32_t u[4] = {r.x, r.y, r.z, r.w};
          const uint32_t threshold = dropout_threshold(0.37f);
          EXPECT_EQ(dropout_keep(seed, offset, b, h, heads, row, col, threshold), u[col % 4] >= threshold);
        }
  EXPECT_EQ(dropout_threshold(0.0f), 0u);
  EXPECT_EQ(dropout_threshold(0.5f), 0x80000000u);
}

// Kept fraction within 5 standard deviations of 1 - p, for the whole mask and per (batch, head);
// two heads' masks agree as independent draws do (p^2 + (1-p)^2).
TEST(Dropout, KeptFractionIsBinomial) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (float p : {0.05f, 0.25f, 0.5f, 0.9f}) {
    const uint32_t t = dropout_threshold(p);
    const int64_t rows = 97, cols = 203, heads = 3, batch = 2;
    int64_t kept_all = 0, agree = 0;
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t h = 0; h < heads; ++h) {
        int64_t kept = 0;
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t j = 0; j < cols; ++j) {
            const bool k = dropout_keep(seed, 12345, b, h, heads, i, j, t);
            kept += k;
            if (h == 1) agree += k == dropout_keep(seed, 12345, b, 0, heads, i, j, t);
          }
        const double n = double(rows * cols), sd = std::sqrt(n * p * (1 - p));
        EXPECT_LE(std::fabs(double(kept) - n * (1 - p)), 5 * sd) << "p " << p << " b " << b << " h " << h;
        kept_all += kept;
      }
    const double n = double(batch * heads * rows * cols), sd = std::sqrt(n * p * (1 - p));
    EXPECT_LE(std::fabs(double(kept_all) - n * (1 - p)), 5 * sd) << "p " << p;
    const double na = double(batch * rows * cols), pa = double(p) * p + (1.0 - p) * (1.0 - p);
    EXPECT_LE(std::fabs(double(agree) - na * pa), 5 * std::sqrt(na * pa * (1 - pa))) << "p " << p;
  }
}

float round_to_dtype(float x, DType dtype) {
  if (dtype == DType::f16) return cpu::half_to_float(cpu::float_to_half(x));
  if (dtype == DType::bf16) return cpu::bf16_to_float(cpu::float_to_bf16(x));
  return x;
}

struct Naive {
  std::vector<double> o, dq, dk, dv;
};

// The same-precision naive implementation with dropout, fixed length, no softcap or ALiBi: every
// operation rounded to the dtype, the dropout layer's P * M / (1 - p) materialised, and autograd's
// gradient of it: dV = Pd^T dO, dPd = dO V^T, dP = dPd * M / (1 - p), dS = P (dP - rowsum(P dP)).
Naive naive_dropout(const AttentionProblem& p) {
  const int64_t sq = p.seqlen_q, sk = p.seqlen_k, hq = p.heads_q, hkv = p.heads_kv, group = hq / hkv;
  const int64_t dqk = p.headdim_qk, dv = p.headdim_v;
  const DType dt = p.dtype;
  const float scale = *p.softmax_scale;
  const Dropout drop = make_dropout(p.dropout_p, p.dropout_seed, p.dropout_offset, hq);
  auto at = [&](const TensorView& t, int64_t b, int64_t i, int64_t h, int64_t d) {
    return cpu::load_element(t.data, b * t.batch_stride + i * t.seq_stride + h * t.head_stride + d, dt);
  };
  Naive r;
  r.o.assign(size_t(p.batch * sq * hq * dv), 0.0);
  r.dq.assign(size_t(p.batch * sq * hq * dqk), 0.0);
  std::vector<float> dk(size_t(p.batch * sk * hkv * dqk), 0.0f), dvv(size_t(p.batch * sk * hkv * dv), 0.0f);
  const int64_t reach = sq + sk;
  const Mask mask{int(sq), int(sk), int(std::min(p.window_left, reach)), int(p.causal ? 0 : std::min(p.window_right, reach))};
  std::vector<float> prob(size_t(sq * sk)), pd(size_t(sq * sk)), ds(size_t(sq * sk));
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < hq; ++h) {
      const int64_t hk = h / group;
      for (int64_t i = 0; i < sq; ++i) {
        float* pi = &prob[size_t(i * sk)];
        float m = -INFINITY;
        for (int64_t j = 0; j < sk; ++j) {
          float s = 0.0f;
          for (int64_t d = 0; d < dqk; ++d) s = std::fma(at(p.q, b, i, h, d), at(p.k, b, j, hk, d), s);
          s = round_to_dtype(round_to_dtype(s, dt) * scale, dt);
          pi[j] = mask.visible(int(i), int(j)) ? s : -INFINITY;
          m = std::max(m, pi[j]);
        }
        float sum = 0.0f;
        for (int64_t j = 0; j < sk; ++j) sum += (pi[j] = m == -INFINITY ? 0.0f : std::exp(pi[j] - m));
        for (int64_t j = 0; j < sk; ++j) {
          pi[j] = sum > 0.0f ? round_to_dtype(pi[j] / sum, dt) : 0.0f;
          pd[size_t(i * sk + j)] = drop.keep(b, h, i, j) ? round_to_dtype(pi[j] * drop.scale, dt) : 0.0f;
        }
        for (int64_t d = 0; d < dv; ++d) {
          float o = 0.0f;
          for (int64_t j = 0; j < sk; ++j) o = std::fma(pd[size_t(i * sk + j)], at(p.v, b, j, hk, d), o);
          r.o[size_t(((b * sq + i) * hq + h) * dv + d)] = round_to_dtype(o, dt);
        }
      }
      for (int64_t i = 0; i < sq; ++i) {
        float* dsi = &ds[size_t(i * sk)];
        for (int64_t j = 0; j < sk; ++j) {
          float x = 0.0f;
          for (int64_t d = 0; d < dv; ++d) x = std::fma(at(p.dout, b, i, h, d), at(p.v, b, j, hk, d), x);
          dsi[j] = drop.keep(b, h, i, j) ? round_to_dtype(round_to_dtype(x, dt) * drop.scale, dt) : 0.0f;
        }
        float rowsum = 0.0f;
        for (int64_t j = 0; j < sk; ++j) rowsum = std::fma(prob[size_t(i * sk + j)], dsi[j], rowsum);
        rowsum = round_to_dtype(rowsum, dt);
        for (int64_t j = 0; j < sk; ++j)
          dsi[j] = round_to_dtype(prob[size_t(i * sk + j)] * round_to_dtype(dsi[j] - rowsum, dt), dt);
      }
      for (int64_t i = 0; i < sq; ++i)
        for (int64_t d = 0; d < dqk; ++d) {
          float x = 0.0f;
          for (int64_t j = 0; j < sk; ++j) x = std::fma(ds[size_t(i * sk + j)], at(p.k, b, j, hk, d), x);
          r.dq[size_t(((b * sq + i) * hq + h) * dqk + d)] = round_to_dtype(round_to_dtype(x, dt) * scale, dt);
        }
      for (int64_t j = 0; j < sk; ++j) {
        for (int64_t d = 0; d < dqk; ++d) {
          float x = 0.0f;
          for (int64_t i = 0; i < sq; ++i) x = std::fma(ds[size_t(i * sk + j)], at(p.q, b, i, h, d), x);
          dk[size_t(((b * sk + j) * hkv + hk) * dqk + d)] += round_to_dtype(round_to_dtype(x, dt) * scale, dt);
        }
        for (int64_t d = 0; d < dv; ++d) {
          float x = 0.0f;
          for (int64_t i = 0; i < sq; ++i) x = std::fma(pd[size_t(i * sk + j)], at(p.dout, b, i, h, d), x);
          dvv[size_t(((b * sk + j) * hkv + hk) * dv + d)] += round_to_dtype(x, dt);
        }
      }
    }
  for (float x : dk) r.dk.push_back(round_to_dtype(x, dt));
  for (float x : dvv) r.dv.push_back(round_to_dtype(x, dt));
  return r;
}

struct Case {
  int64_t batch, seqlen_q, seqlen_k, heads_q, heads_kv, headdim;
  DType dtype;
  bool causal;
  float p;
  int num_threads;
};

void set_dropout(AttentionProblem& p, float prob, uint64_t seed, uint64_t offset) {
  p.dropout_p = prob;
  p.dropout_seed = seed;
  p.dropout_offset = offset;
}

void check_against_oracle(const Case& c, int trials) {
  for (int trial = 0; trial < trials; ++trial) {
    ProblemShape shape;
    shape.batch = c.batch;
    shape.seqlen_q = c.seqlen_q;
    shape.seqlen_k = c.seqlen_k;
    shape.heads_q = c.heads_q;
    shape.heads_kv = c.heads_kv;
    shape.headdim_qk = c.headdim;
    shape.dtype = c.dtype;
    shape.causal = c.causal;
    shape.num_threads = c.num_threads;
    HostProblem hp(shape);
    AttentionProblem& p = hp.problem;
    p.backend = Backend::cpu;
    set_dropout(p, c.p, hp.seed * 7 + 1, hp.seed >> 3);
    tileattn::forward(p);
    tileattn::backward(p);
    const AttentionProblem n = host::validate_attention(p, host::Pass::backward, Backend::cpu);
    const auto oracle_fwd = cpu::reference_forward(n);
    const auto oracle = cpu::reference_backward(n);
    const Naive naive = naive_dropout(n);
    // The floor in units of each tensor's largest element (at least 1): the kept weights are
    // scaled by 1 / (1 - p), so at p = 0.9 the gradients reach ~10, where an absolute 2e-6 is two
    // fp32 ulps (a seed with dK's error at 5.3e-6 against the naive 1.5e-6 failed it).
    const auto floor = [&](const std::vector<double>& ref) { return two_x_floor(c.dtype, ref); };
    SCOPED_TRACE("trial " + std::to_string(trial) + " p " + std::to_string(c.p));
    EXPECT_TRUE(two_x_rule(hp.o.gather(), naive.o, oracle_fwd.o, floor(oracle_fwd.o))) << "O";
    // L is the LSE of the undropped scores: the oracle's, as without dropout.
    EXPECT_TRUE(within(hp.gather_lse(), oracle_fwd.lse, 1e-5, 1e-5)) << "L";
    EXPECT_TRUE(two_x_rule(hp.dq.gather(), naive.dq, oracle.dq, 2 * floor(oracle.dq))) << "dQ";
    EXPECT_TRUE(two_x_rule(hp.dk.gather(), naive.dk, oracle.dk, 2 * floor(oracle.dk))) << "dK";
    EXPECT_TRUE(two_x_rule(hp.dv.gather(), naive.dv, oracle.dv, 2 * floor(oracle.dv))) << "dV";
    EXPECT_EQ(hp.o.touched_outside_view(), 0);
    if (::testing::Test::HasFailure()) return;
  }
}

TEST(DropoutAccuracy, Fp32) {
  check_against_oracle({2, 70, 90, 4, 2, 32, DType::f32, false, 0.2f, 1}, 3);   // fused backward schedule
  check_against_oracle({1, 130, 100, 2, 1, 64, DType::f32, true, 0.5f, 4}, 3);  // split schedule, causal
  check_against_oracle({1, 33, 140, 3, 3, 16, DType::f32, false, 0.9f, 2}, 3);
}

TEST(DropoutAccuracy, HalfPrecision) {
  for (DType dt : {DType::f16, DType::bf16}) {
    SCOPED_TRACE(dt == DType::f16 ? "f16" : "bf16");
    check_against_oracle({2, 65, 65, 2, 1, 64, dt, true, 0.3f, 1}, 3);
    check_against_oracle({1, 80, 50, 4, 2, 40, dt, false, 0.1f, 4}, 3);
  }
}

// Masks, windows and variable-length sequences: the mask uses positions within each sequence, so
// the oracle (which reads every sequence's rows itself) must agree with the tiles. Also with a
// gradient for L (dlse): L is the undropped scores' LSE, so its term takes the undropped P.
TEST(DropoutAccuracy, VarlenAndWindowAgainstOracle) {
  for (bool lse_grad : {false, true}) {
    SCOPED_TRACE(lse_grad ? "with dlse" : "without dlse");
    ProblemShape shape;
    shape.seqlens_q = {37, 0, 90, 5};
    shape.seqlens_k = {50, 3, 70, 130};
    shape.heads_q = 4;
    shape.heads_kv = 2;
    shape.headdim_qk = 24;
    shape.headdim_v = 40;
    shape.window_left = 20;
    shape.window_right = 7;
    shape.num_threads = 3;
    shape.lse_grad = lse_grad;
    HostProblem hp(shape);
    AttentionProblem& p = hp.problem;
    p.backend = Backend::cpu;
    set_dropout(p, 0.4f, hp.seed, 99);
    tileattn::forward(p);
    tileattn::backward(p);
    const AttentionProblem n = host::validate_attention(p, host::Pass::backward, Backend::cpu);
    const auto f = cpu::reference_forward(n);
    const auto g = cpu::reference_backward(n);
    EXPECT_TRUE(within(hp.o.gather(), f.o, 1e-5, 1e-6)) << "O";
    EXPECT_TRUE(within(hp.gather_lse(), f.lse, 1e-5, 1e-5)) << "L";
    EXPECT_TRUE(within(hp.dq.gather(), g.dq, 1e-4, 1e-5)) << "dQ";
    EXPECT_TRUE(within(hp.dk.gather(), g.dk, 1e-4, 1e-5)) << "dK";
    EXPECT_TRUE(within(hp.dv.gather(), g.dv, 1e-4, 1e-5)) << "dV";
  }
}

struct Outputs {
  std::vector<double> o, lse, dq, dk, dv;
  bool operator==(const Outputs&) const = default;
};

Outputs run(HostProblem& hp, float prob, uint64_t seed, uint64_t offset, int threads) {
  hp.poison_outputs();
  AttentionProblem p = hp.problem;
  p.backend = Backend::cpu;
  p.num_threads = threads;
  p.deterministic = true;
  set_dropout(p, prob, seed, offset);
  tileattn::forward(p);
  tileattn::backward(p);
  return {hp.o.gather(), hp.gather_lse(), hp.dq.gather(), hp.dk.gather(), hp.dv.gather()};
}

ProblemShape repeat_shape() {
  ProblemShape s;
  s.batch = 2;
  s.seqlen_q = 70;
  s.seqlen_k = 90;
  s.heads_q = 4;
  s.heads_kv = 2;
  s.headdim_qk = 32;
  s.dtype = DType::bf16;
  return s;
}

TEST(Dropout, SameSeedIsBitwiseWhateverTheThreads) {
  HostProblem hp(repeat_shape());
  const Outputs a = run(hp, 0.3f, 42, 7, 1);   // fused backward schedule
  const Outputs b = run(hp, 0.3f, 42, 7, 1);
  const Outputs c = run(hp, 0.3f, 42, 7, 16);  // split schedule
  EXPECT_TRUE(a == b);
  EXPECT_TRUE(a == c);
}

TEST(Dropout, OtherSeedOrOffsetOtherMask) {
  HostProblem hp(repeat_shape());
  const Outputs a = run(hp, 0.3f, 42, 7, 2);
  EXPECT_NE(a.o, run(hp, 0.3f, 43, 7, 2).o);
  EXPECT_NE(a.o, run(hp, 0.3f, 42, 8, 2).o);
  EXPECT_NE(a.o, run(hp, 0.0f, 42, 7, 2).o);
  // L is the undropped LSE whatever the mask.
  EXPECT_EQ(a.lse, run(hp, 0.0f, 42, 7, 2).lse);
}

// dropout_rng_state replaces the seed and offset fields, and is read when the call runs: the
// oracle reads it too.
TEST(Dropout, RngStateStandsForSeedAndOffset) {
  HostProblem hp(repeat_shape());
  const Outputs fields = run(hp, 0.3f, 42, 7, 2);
  uint64_t state[2] = {42, 7};
  hp.problem.dropout_rng_state = state;
  const Outputs from_state = run(hp, 0.3f, 1, 2, 2);  // the fields are ignored
  EXPECT_TRUE(fields == from_state);
  state[0] = 43;
  EXPECT_NE(fields.o, run(hp, 0.3f, 42, 7, 2).o);
  AttentionProblem with_dropout = hp.problem;
  with_dropout.dropout_p = 0.3f;
  const AttentionProblem n = host::validate_attention(with_dropout, host::Pass::backward, Backend::cpu);
  state[0] = 42;
  const auto oracle = cpu::reference_forward(n);
  const Outputs again = run(hp, 0.3f, 0, 0, 2);
  EXPECT_TRUE(fields == again);
  EXPECT_TRUE(within(again.o, oracle.o, 1e-2, 1e-2));
}

TEST(Dropout, ZeroIsNoDropoutExactly) {
  HostProblem hp(repeat_shape());
  const Outputs none = run(hp, 0.0f, 0, 0, 2);
  EXPECT_TRUE(none == run(hp, 0.0f, 123456789, 987654321, 2));
}

// Every row's kept weights, through the library: with Q = 0 each weight is 1/sk, and with V = 1
// (headdim_v 1) O_i = kept_i / (sk (1 - p)); kept_i must be the rule's count for that row.
TEST(Dropout, ForwardKeepsWhatTheRuleKeeps) {
  ProblemShape s;
  s.seqlen_q = 9;
  s.seqlen_k = 300;
  s.heads_q = 2;
  s.headdim_qk = 8;
  s.headdim_v = 1;
  s.with_backward = false;
  HostProblem hp(s);
  hp.q.scatter(std::vector<double>(size_t(9 * 2 * 8), 0.0));
  hp.v.scatter(std::vector<double>(size_t(300), 1.0));
  AttentionProblem& p = hp.problem;
  p.backend = Backend::cpu;
  set_dropout(p, 0.25f, 5, 6);
  tileattn::forward(p);
  const std::vector<double> o = hp.o.gather();
  const uint32_t t = dropout_threshold(0.25f);
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t i = 0; i < 9; ++i) {
      int kept = 0;
      for (int64_t j = 0; j < 300; ++j) kept += dropout_keep(5, 6, 0, h, 2, i, j, t);
      EXPECT_NEAR(o[size_t(i * 2 + h)], kept / (300 * 0.75), 1e-5) << "row " << i << " head " << h;
    }
}

void expect_error(const AttentionProblem& p, Backend backend, ErrorKind kind, const std::string& text) {
  try {
    host::validate_attention(p, host::Pass::forward, backend);
    ADD_FAILURE() << "no error; expected: " << text;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind);
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

TEST(DropoutValidation, Messages) {
  ProblemShape s;
  s.seqlen_q = s.seqlen_k = 4;
  s.headdim_qk = 8;
  s.with_backward = false;
  HostProblem hp(s);
  AttentionProblem p = hp.problem;
  const std::string rule = " must be finite and in [0, 1)";
  p.dropout_p = -0.25f;
  expect_error(p, Backend::cpu, ErrorKind::invalid_argument, "dropout_p=-0.25" + rule);
  p.dropout_p = 1.0f;
  expect_error(p, Backend::cpu, ErrorKind::invalid_argument, "dropout_p=1" + rule);
  p.dropout_p = 1.5f;
  expect_error(p, Backend::cpu, ErrorKind::invalid_argument, "dropout_p=1.5" + rule);
  p.dropout_p = std::numeric_limits<float>::quiet_NaN();
  expect_error(p, Backend::cpu, ErrorKind::invalid_argument, "dropout_p=nan" + rule);
  p.dropout_p = std::numeric_limits<float>::infinity();
  expect_error(p, Backend::cpu, ErrorKind::invalid_argument, "dropout_p=inf" + rule);
  p.dropout_p = 0.5f;
  EXPECT_NO_THROW(host::validate_attention(p, host::Pass::forward, Backend::cuda));
  EXPECT_NO_THROW(host::validate_attention(p, host::Pass::forward, Backend::cpu));
  p.dropout_p = 0.0f;
  EXPECT_NO_THROW(host::validate_attention(p, host::Pass::forward, Backend::cuda));
}

}  // namespace
}  // namespace tileattn::test
