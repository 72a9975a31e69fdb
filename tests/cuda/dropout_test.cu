// Attention dropout on the CUDA backend (the portable kernels; fp32 in exact and fast mode, the
// exact backward on Hopper's split-TF32 passes where the build has them): the kernels must draw
// the mask of src/common/philox.hpp bit for bit, whatever their tiling, GQA packing, split-KV or
// variable lengths.
//
// Exact checks: with Q = 0 every visible weight is 1 / n (n visible keys), and with V one-hot on
// key % 64, O[i, d] = (kept keys j = d mod 64 of row i) / (n (1 - p)): a small integer count per
// element, so one wrongly kept or dropped key moves it by a whole count. Likewise dV with dO one-hot
// on query % 64 (full masks only: then every weight is 1 / seqlen_k). Random inputs then check O,
// L, dQ, dK and dV against the float64 oracle (which implements the same rule), with the CPU
// backend's error on the same inputs and seed as the comparison point: a different mask moves the
// gradients by a fraction of their size, far past the bound. fp32 fast mode (TF32 products)
// checks O and L against fp32_forward_test.cu's TF32 bound instead, and the gradients against
// gpu_test_util.cuh's.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "common/mask.hpp"
#include "common/philox.hpp"
#include "cpu/reference.hpp"
#include "gpu_test_util.cuh"
#include "host/validate.hpp"
#include "tileattn/attention.hpp"

namespace tileattn::test {
namespace {

constexpr int64_t kDim = 64;  // one-hot over key % 64: every build has this head dim

// fp32 fast mode's bound on O and L relative to max(1, largest reference value): 16 TF32 unit
// roundoffs, as fp32_forward_test.cu derives it.
constexpr double kTf32FastRelBound = 16.0 / 2048.0;

std::string dtype_name(DType t, Fp32Mode mode = Fp32Mode::exact) {
  if (t == DType::f32) return mode == Fp32Mode::exact ? "f32 exact" : "f32 fast";
  return t == DType::f16 ? "f16" : "bf16";
}

struct MaskCase {
  std::string name;
  ProblemShape shape;
  float p;
  int num_splits = 0;
};

std::vector<MaskCase> mask_cases(DType t) {
  auto shape = [&](int64_t batch, int64_t sq, int64_t sk, int64_t hq, int64_t hkv) {
    ProblemShape s;
    s.dtype = t;
    s.batch = batch, s.seqlen_q = sq, s.seqlen_k = sk, s.heads_q = hq, s.heads_kv = hkv;
    s.headdim_qk = kDim;
    return s;
  };
  std::vector<MaskCase> c;
  c.push_back({"prefill_gqa", shape(2, 150, 300, 4, 2), 0.3f});
  c.push_back({"decode_gqa_packed", shape(2, 3, 300, 8, 2), 0.5f});        // packed rows, decode kernel
  c.push_back({"decode_split", shape(1, 1, 1000, 2, 2), 0.2f, 4});         // split-KV partials
  c.push_back({"packed_split", shape(1, 40, 700, 4, 1), 0.6f, 3});         // packed rows, main kernel
  {
    auto s = shape(1, 200, 100, 2, 2);  // bottom-right causal: the first 100 rows see no key
    s.causal = true;
    c.push_back({"causal_sq_gt_sk", s, 0.4f});
  }
  {
    auto s = shape(1, 1, 1, 4, 2);
    s.seqlens_q = {37, 0, 90, 5};
    s.seqlens_k = {50, 3, 130, 260};
    s.causal = true;
    s.window_left = 40;
    c.push_back({"varlen_causal_window", s, 0.25f});
  }
  {
    // An odd window: query tiles whose first visible key is odd (the fp32 forward's tiles start
    // at the first visible key, the Philox pairs at even keys).
    auto s = shape(1, 150, 300, 4, 2);
    s.causal = true;
    s.window_left = 33;
    c.push_back({"causal_odd_window_gqa", s, 0.35f});
  }
  return c;
}

// Sequence of each row and its position in it (q side when qside).
struct RowPos {
  int64_t b, i, len_q, len_k;
};
RowPos row_pos(const HostProblem& hp, int64_t r, bool qside) {
  const AttentionProblem& p = hp.problem;
  if (hp.cu_seqlens_q.empty()) {
    const int64_t s = qside ? p.seqlen_q : p.seqlen_k;
    return {r / s, r % s, p.seqlen_q, p.seqlen_k};
  }
  const std::vector<int32_t>& cu = qside ? hp.cu_seqlens_q : hp.cu_seqlens_k;
  int64_t b = 0;
  while (cu[size_t(b + 1)] <= r) ++b;
  return {b, r - cu[size_t(b)], hp.cu_seqlens_q[size_t(b + 1)] - hp.cu_seqlens_q[size_t(b)],
          hp.cu_seqlens_k[size_t(b + 1)] - hp.cu_seqlens_k[size_t(b)]};
}

void set_dropout(AttentionProblem& p, float prob, uint64_t seed, uint64_t offset) {
  p.dropout_p = prob, p.dropout_seed = seed, p.dropout_offset = offset;
}

void check_exact_masks(const MaskCase& c, Fp32Mode mode = Fp32Mode::exact) {
  SCOPED_TRACE(c.name + " " + dtype_name(c.shape.dtype, mode));
  HostProblem hp(c.shape);
  AttentionProblem& p = hp.problem;
  p.fp32_mode = mode;
  // Offsets near 2^32 carry into the counter's high word within the problem's streams.
  set_dropout(p, c.p, hp.seed * 0x9E3779B97F4A7C15ull + 3, 0xFFFFFFFFull - 2);
  p.num_splits = c.num_splits;
  const int64_t rows_q = hp.rows_q(), rows_k = hp.rows_k(), hq = p.heads_q, hkv = p.heads_kv;
  hp.q.scatter(std::vector<double>(size_t(rows_q * hq * kDim), 0.0));
  std::vector<double> v(size_t(rows_k * hkv * kDim), 0.0), dout(size_t(rows_q * hq * kDim), 0.0);
  for (int64_t r = 0; r < rows_k; ++r)
    for (int64_t h = 0; h < hkv; ++h) v[size_t((r * hkv + h) * kDim + row_pos(hp, r, false).i % kDim)] = 1.0;
  for (int64_t r = 0; r < rows_q; ++r)
    for (int64_t h = 0; h < hq; ++h) dout[size_t((r * hq + h) * kDim + row_pos(hp, r, true).i % kDim)] = 1.0;
  hp.v.scatter(v);
  hp.dout.scatter(dout);
  const AttentionProblem n = host::validate_attention(p, host::Pass::backward, Backend::cpu);
  const Dropout d = make_dropout(p.dropout_p, p.dropout_seed, p.dropout_offset, hq);

  DeviceProblem dp(hp);
  tileattn::forward(dp.problem);
  tileattn::backward(dp.problem);
  dp.download();

  const std::vector<double> o = hp.o.gather();
  int64_t wrong = 0;
  for (int64_t r = 0; r < rows_q; ++r) {
    const RowPos x = row_pos(hp, r, true);
    const Mask mask{int(x.len_q), int(x.len_k), int(n.window_left), int(n.window_right)};
    for (int64_t h = 0; h < hq; ++h) {
      std::vector<int> kept(kDim, 0);
      int visible = 0;
      for (int64_t j = 0; j < x.len_k; ++j) {
        if (!mask.visible(int(x.i), int(j))) continue;
        ++visible;
        kept[size_t(j % kDim)] += d.keep(x.b, h, x.i, j);
      }
      const double unit = visible ? double(d.scale) / visible : 0.0;
      for (int64_t e = 0; e < kDim; ++e) {
        const double got = o[size_t((r * hq + h) * kDim + e)], want = kept[size_t(e)] * unit;
        if (!(std::fabs(got - want) <= 0.25 * unit) && wrong++ < 5)
          ADD_FAILURE() << "O row " << r << " head " << h << " dim " << e << ": " << got << " want " << want
                        << " (one key = " << unit << ")";
      }
    }
  }
  EXPECT_EQ(wrong, 0) << "elements of O off by a key";

  // dV where every weight is 1 / seqlen_k: summed over the kv group's query heads.
  if (p.causal || n.window_left >= 0 || n.window_right >= 0 || p.is_varlen()) return;
  const std::vector<double> dv = hp.dv.gather();
  const int64_t group = hq / hkv;
  const double unit = double(d.scale) / double(p.seqlen_k);
  wrong = 0;
  for (int64_t r = 0; r < rows_k; ++r) {
    const int64_t b = r / p.seqlen_k, j = r % p.seqlen_k;
    for (int64_t hk = 0; hk < hkv; ++hk) {
      std::vector<int> kept(kDim, 0);
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h)
        for (int64_t i = 0; i < p.seqlen_q; ++i) kept[size_t(i % kDim)] += d.keep(b, h, i, j);
      for (int64_t e = 0; e < kDim; ++e) {
        const double got = dv[size_t((r * hkv + hk) * kDim + e)], want = kept[size_t(e)] * unit;
        if (!(std::fabs(got - want) <= 0.25 * unit) && wrong++ < 5)
          ADD_FAILURE() << "dV key row " << r << " kv head " << hk << " dim " << e << ": " << got << " want " << want;
      }
    }
  }
  EXPECT_EQ(wrong, 0) << "elements of dV off by a key";
}

TEST(CudaDropout, ForwardAndDvKeepWhatTheRuleKeepsF16) {
  TA_SKIP_WITHOUT_GPU();
  for (const MaskCase& c : mask_cases(DType::f16)) check_exact_masks(c);
}

TEST(CudaDropout, ForwardAndDvKeepWhatTheRuleKeepsBf16) {
  TA_SKIP_WITHOUT_GPU();
  for (const MaskCase& c : mask_cases(DType::bf16)) check_exact_masks(c);
}

// fp32: the portable fp32 forward (fp64 products, or TF32 in fast mode: dropout never takes the
// Hopper fast kernel) and the fp32 backward, whose D pass draws the mask too (on Hopper, exact
// mode: the split-TF32 passes, rows being queries or keys).
TEST(CudaDropout, ForwardAndDvKeepWhatTheRuleKeepsF32Exact) {
  TA_SKIP_WITHOUT_GPU();
  for (const MaskCase& c : mask_cases(DType::f32)) check_exact_masks(c, Fp32Mode::exact);
}

TEST(CudaDropout, ForwardAndDvKeepWhatTheRuleKeepsF32Fast) {
  TA_SKIP_WITHOUT_GPU();
  for (const MaskCase& c : mask_cases(DType::f32)) check_exact_masks(c, Fp32Mode::fast);
}

// Random inputs: the GPU's error against the oracle may be at most twice the CPU backend's on the
// same problem, plus a few roundings of the largest value.
void check_against_oracle(ProblemShape shape, float prob, bool deterministic, Fp32Mode mode) {
  HostProblem hp(shape);
  AttentionProblem& p = hp.problem;
  set_dropout(p, prob, hp.seed ^ 0x5DEECE66Dull, hp.seed >> 7);
  p.deterministic = deterministic;
  p.fp32_mode = mode;

  DeviceProblem dp(hp);
  tileattn::forward(dp.problem);
  tileattn::backward(dp.problem);
  dp.download();
  const std::vector<double> o = hp.o.gather(), lse = hp.gather_lse();
  const std::vector<double> dq = hp.dq.gather(), dk = hp.dk.gather(), dv = hp.dv.gather();
  EXPECT_EQ(hp.o.touched_outside_view(), 0);

  hp.poison_outputs();
  p.backend = Backend::cpu;
  tileattn::forward(p);
  tileattn::backward(p);
  const AttentionProblem n = host::validate_attention(p, host::Pass::backward, Backend::cpu);
  const cpu::ReferenceForward f = cpu::reference_forward(n);
  const cpu::ReferenceBackward g = cpu::reference_backward(n);

  const double u = unit_roundoff(shape.dtype);
  auto check = [&](const char* what, const std::vector<double>& got, const std::vector<double>& cpu_out,
                   const std::vector<double>& want) {
    const double floor = 4.0 * u * std::max(1.0, compare(want, want).max_ref);
    EXPECT_TRUE(within_2x(what, got, cpu_out, want, floor));
  };
  if (shape.dtype == DType::f32 && mode == Fp32Mode::fast) {
    const ErrorStats eo = compare(o, f.o), el = compare(lse, f.lse);
    EXPECT_EQ(eo.nonfinite, 0) << eo;
    EXPECT_LE(eo.max_abs, kTf32FastRelBound * std::max(1.0, eo.max_ref)) << "O " << eo;
    EXPECT_LE(el.max_abs, kTf32FastRelBound * std::max(1.0, el.max_ref)) << "L " << el;
  } else {
    check("O", o, hp.o.gather(), f.o);
    // L is the log-sum-exp of the undropped scores.
    EXPECT_TRUE(within(lse, f.lse, 1e-5, 1e-5)) << "L";
  }
  if (shape.dtype == DType::f32 && mode == Fp32Mode::fast) {
    EXPECT_TRUE(within_tf32_grad_bound("dQ", dq, g.dq));
    EXPECT_TRUE(within_tf32_grad_bound("dK", dk, g.dk));
    EXPECT_TRUE(within_tf32_grad_bound("dV", dv, g.dv));
    return;
  }
  check("dQ", dq, hp.dq.gather(), g.dq);
  check("dK", dk, hp.dk.gather(), g.dk);
  check("dV", dv, hp.dv.gather(), g.dv);
}

// Causal with GQA, and varlen with a window, in both dQ modes.
void check_gradient_cases(DType t, Fp32Mode mode = Fp32Mode::exact) {
  for (bool deterministic : {false, true}) {
    SCOPED_TRACE(dtype_name(t, mode) + (deterministic ? " deterministic" : " atomic dQ"));
    ProblemShape s;
    s.dtype = t;
    s.batch = 2, s.seqlen_q = 130, s.seqlen_k = 170, s.heads_q = 4, s.heads_kv = 2, s.headdim_qk = kDim;
    s.causal = true;
    check_against_oracle(s, 0.3f, deterministic, mode);
    ProblemShape v;
    v.dtype = t;
    v.seqlens_q = {37, 0, 150, 5};
    v.seqlens_k = {50, 20, 150, 300};
    v.heads_q = 2, v.heads_kv = 1, v.headdim_qk = kDim;
    v.window_left = 30, v.window_right = 10;
    check_against_oracle(v, 0.5f, deterministic, mode);
    if (testing::Test::HasFailure()) return;
  }
}

TEST(CudaDropout, GradientsAgainstOracle) {
  TA_SKIP_WITHOUT_GPU();
  for (DType t : {DType::f16, DType::bf16}) {
    check_gradient_cases(t);
    if (testing::Test::HasFailure()) return;
  }
}

// fp32 in both modes.
TEST(CudaDropout, GradientsAgainstOracleF32) {
  TA_SKIP_WITHOUT_GPU();
  for (Fp32Mode mode : {Fp32Mode::exact, Fp32Mode::fast}) {
    check_gradient_cases(DType::f32, mode);
    if (testing::Test::HasFailure()) return;
  }
}

}  // namespace
}  // namespace tileattn::test
