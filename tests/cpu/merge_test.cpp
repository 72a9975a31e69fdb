// merge_attention on the CPU: the merged (O, L) of two partial results against a float64
// reference with the 2x rule, exact handling of rows where either side (or both) saw no key,
// strided views left untouched outside, thread-count invariance, and every validation rule.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cpu/convert.hpp"
#include "support/metrics.hpp"
#include "tileattn/merge.hpp"

namespace tileattn::test {
namespace {

constexpr float kPoison = 12288.0f;  // exact in f32, f16 and bf16

// A strided (batch, seqlen, heads, headdim) tensor with a gap after every head, row and batch, so
// that writes outside the view show.
struct Strided {
  DType dtype;
  int64_t b, n, h, d;
  TensorView view;
  std::vector<unsigned char> bytes;

  Strided(DType dt, int64_t b_, int64_t n_, int64_t h_, int64_t d_, int64_t pad) : dtype(dt), b(b_), n(n_), h(h_), d(d_) {
    view.head_stride = d + pad;
    view.seq_stride = h * view.head_stride + pad;
    view.batch_stride = n * view.seq_stride + pad;
    const int64_t elems = b * view.batch_stride;
    bytes.resize(size_t(elems * cpu::dtype_size(dtype)));
    for (int64_t e = 0; e < elems; ++e) cpu::store_element(bytes.data(), e, dtype, kPoison);
    view.data = bytes.data();
  }
  int64_t at(int64_t bi, int64_t i, int64_t hi, int64_t di) const {
    return bi * view.batch_stride + i * view.seq_stride + hi * view.head_stride + di;
  }
  float get(int64_t bi, int64_t i, int64_t hi, int64_t di) const {
    return cpu::load_element(bytes.data(), at(bi, i, hi, di), dtype);
  }
  void set(int64_t bi, int64_t i, int64_t hi, int64_t di, float x) {
    cpu::store_element(bytes.data(), at(bi, i, hi, di), dtype, x);
  }
  // Elements outside the view that no longer hold the poison.
  int64_t touched_outside() const {
    std::vector<bool> inside(bytes.size() / size_t(cpu::dtype_size(dtype)), false);
    for (int64_t bi = 0; bi < b; ++bi)
      for (int64_t i = 0; i < n; ++i)
        for (int64_t hi = 0; hi < h; ++hi)
          for (int64_t di = 0; di < d; ++di) inside[size_t(at(bi, i, hi, di))] = true;
    int64_t touched = 0;
    for (size_t e = 0; e < inside.size(); ++e)
      touched += !inside[e] && cpu::load_element(bytes.data(), int64_t(e), dtype) != kPoison;
    return touched;
  }
};

// L as a (batch, heads, seqlen) slice of a longer (batch, heads, seqlen + extra) buffer.
struct Lse {
  int64_t b, h, n, extra;
  std::vector<float> data;
  Lse(int64_t b_, int64_t h_, int64_t n_, int64_t extra_) : b(b_), h(h_), n(n_), extra(extra_) {
    data.assign(size_t(b * h * (n + extra)), kPoison);
  }
  int64_t head_stride() const { return n + extra; }
  int64_t batch_stride() const { return h * (n + extra); }
  float* ptr() { return data.data() + extra; }  // the slice starts `extra` rows in
  float& at(int64_t bi, int64_t hi, int64_t i) { return ptr()[bi * batch_stride() + hi * head_stride() + i]; }
};

enum class Row { both_finite, a_empty, b_empty, both_empty };

struct Case {
  DType out_dtype, out_b_dtype;
};

std::string name(DType d) { return d == DType::f32 ? "f32" : d == DType::f16 ? "f16" : "bf16"; }

class MergeAccuracy : public testing::TestWithParam<Case> {};

TEST_P(MergeAccuracy, MatchesFloat64WithTwoXRuleAndExactEmptyRows) {
  const Case c = GetParam();
  std::mt19937_64 rng{std::random_device{}()};
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> lse_dist(-6.0f, 6.0f);
  const int64_t B = 2, N = 45, H = 3, D = 40;
  Strided oa(c.out_dtype, B, N, H, D, 3), ob(c.out_b_dtype, B, N, H, D, 5);
  Lse la(B, H, N, 4), lb(B, H, N, 2);
  std::vector<Row> kind(size_t(B * N * H));
  std::vector<double> want_o, naive_o, want_l, naive_l;
  for (int64_t bi = 0; bi < B; ++bi)
    for (int64_t i = 0; i < N; ++i)
      for (int64_t h = 0; h < H; ++h) {
        // Mostly finite rows, some far apart (one side's weight below fp32's resolution), and
        // every kind of empty row; an empty side's O holds NaN, which must not leak.
        const int64_t r = (bi * N + i) * H + h;
        const Row k = r % 7 == 1 ? Row::a_empty : r % 7 == 2 ? Row::b_empty : r % 7 == 3 ? Row::both_empty : Row::both_finite;
        kind[size_t(r)] = k;
        float a = lse_dist(rng), b = lse_dist(rng);
        if (r % 11 == 5) b = a - 40.0f;
        // An empty side is -inf (tileattn's forward) or +inf (flash-attn's mark), by row.
        const float empty = r % 2 ? -INFINITY : INFINITY;
        if (k == Row::a_empty || k == Row::both_empty) a = empty;
        if (k == Row::b_empty || k == Row::both_empty) b = empty;
        la.at(bi, h, i) = a;
        lb.at(bi, h, i) = b;
        for (int64_t d = 0; d < D; ++d) {
          oa.set(bi, i, h, d, std::isinf(a) ? NAN : normal(rng));
          ob.set(bi, i, h, d, std::isinf(b) ? NAN : normal(rng));
        }
      }
  // References from the stored (rounded) inputs: float64, and the plain fp32 formula rounded to
  // out's dtype as a same-precision implementation stores it.
  for (int64_t bi = 0; bi < B; ++bi)
    for (int64_t i = 0; i < N; ++i)
      for (int64_t h = 0; h < H; ++h) {
        if (kind[size_t((bi * N + i) * H + h)] != Row::both_finite) continue;
        const double a = la.at(bi, h, i), b = lb.at(bi, h, i);
        const double l = std::max(a, b) + std::log(std::exp(a - std::max(a, b)) + std::exp(b - std::max(a, b)));
        const float af = float(a), bf = float(b), mf = std::max(af, bf);
        const float lf = mf + std::log(std::exp(af - mf) + std::exp(bf - mf));
        want_l.push_back(l);
        naive_l.push_back(lf);
        for (int64_t d = 0; d < D; ++d) {
          want_o.push_back(std::exp(a - l) * oa.get(bi, i, h, d) + std::exp(b - l) * ob.get(bi, i, h, d));
          const float x = std::exp(af - lf) * oa.get(bi, i, h, d) + std::exp(bf - lf) * ob.get(bi, i, h, d);
          naive_o.push_back(cpu::load_element(&x, 0, DType::f32));
        }
      }
  naive_o = round_to(naive_o, c.out_dtype);
  // What a one-sided row must hold: the other side exactly (its O rounded to out's dtype).
  Strided ob_copy = ob;
  Lse lb_copy = lb;

  MergeProblem p;
  p.batch = B, p.seqlen = N, p.heads = H, p.headdim = D;
  p.out = oa.view, p.out_dtype = c.out_dtype;
  p.lse = la.ptr(), p.lse_head_stride = la.head_stride(), p.lse_batch_stride = la.batch_stride();
  p.out_b = ob.view, p.out_b_dtype = c.out_b_dtype;
  p.lse_b = lb.ptr(), p.lse_b_head_stride = lb.head_stride(), p.lse_b_batch_stride = lb.batch_stride();
  Strided oa_before = oa;
  Lse la_before = la;
  merge_attention(p);

  std::vector<double> got_o, got_l;
  for (int64_t bi = 0; bi < B; ++bi)
    for (int64_t i = 0; i < N; ++i)
      for (int64_t h = 0; h < H; ++h) {
        const Row k = kind[size_t((bi * N + i) * H + h)];
        const float l = la.at(bi, h, i);
        if (k == Row::both_finite) {
          got_l.push_back(l);
          for (int64_t d = 0; d < D; ++d) got_o.push_back(oa.get(bi, i, h, d));
          continue;
        }
        for (int64_t d = 0; d < D; ++d) {
          const float o = oa.get(bi, i, h, d);
          if (k == Row::both_empty) {
            ASSERT_EQ(o, 0.0f) << "both sides empty: O must be 0 at b=" << bi << " i=" << i << " h=" << h;
          } else if (k == Row::a_empty) {
            const double want = round_to({double(ob_copy.get(bi, i, h, d))}, c.out_dtype)[0];
            ASSERT_EQ(o, want) << "a empty: O must be O_b at i=" << i;
          } else {
            ASSERT_EQ(o, oa_before.get(bi, i, h, d)) << "b empty: O must stay O_a at i=" << i;
          }
        }
        if (k == Row::both_empty) ASSERT_EQ(l, -INFINITY);
        if (k == Row::a_empty) ASSERT_EQ(l, lb_copy.at(bi, h, i));
        if (k == Row::b_empty) ASSERT_EQ(l, la_before.at(bi, h, i));
      }
  EXPECT_TRUE(two_x_rule(got_o, naive_o, want_o, 4.0 * unit_roundoff(c.out_dtype))) << "O";
  EXPECT_TRUE(two_x_rule(got_l, naive_l, want_l, 1e-6)) << "L";
  EXPECT_EQ(oa.touched_outside(), 0);
  std::vector<bool> in_slice(la.data.size(), false);
  for (int64_t bi = 0; bi < B; ++bi)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < N; ++i) in_slice[size_t(la.extra + bi * la.batch_stride() + h * la.head_stride() + i)] = true;
  for (size_t e = 0; e < la.data.size(); ++e)
    if (!in_slice[e]) EXPECT_EQ(la.data[e], kPoison) << "lse gap " << e;
}

INSTANTIATE_TEST_SUITE_P(Dtypes, MergeAccuracy,
                         testing::Values(Case{DType::f32, DType::f32}, Case{DType::f32, DType::f16},
                                         Case{DType::f32, DType::bf16}, Case{DType::f16, DType::f16},
                                         Case{DType::bf16, DType::bf16}),
                         [](const testing::TestParamInfo<Case>& info) {
                           return name(info.param.out_dtype) + "_from_" + name(info.param.out_b_dtype);
                         });

// Merging is elementwise: the thread count cannot change a bit.
TEST(Merge, BitwiseEqualForAnyThreadCount) {
  std::mt19937_64 rng{std::random_device{}()};
  std::normal_distribution<float> normal;
  const int64_t B = 3, N = 300, H = 4, D = 64;
  std::vector<float> o(size_t(B * N * H * D)), ob(o.size()), l(size_t(B * H * N)), lb(l.size());
  for (auto* v : {&o, &ob, &l, &lb})
    for (float& x : *v) x = normal(rng);
  auto run = [&](int threads) {
    std::vector<float> out = o, lse = l;
    MergeProblem p;
    p.batch = B, p.seqlen = N, p.heads = H, p.headdim = D;
    p.out = {out.data(), N * H * D, H * D, D};
    p.out_b = {ob.data(), N * H * D, H * D, D};
    p.lse = lse.data(), p.lse_head_stride = N, p.lse_batch_stride = H * N;
    p.lse_b = lb.data(), p.lse_b_head_stride = N, p.lse_b_batch_stride = H * N;
    p.num_threads = threads;
    merge_attention(p);
    out.insert(out.end(), lse.begin(), lse.end());
    return out;
  };
  const auto one = run(1), all = run(0);
  EXPECT_EQ(std::memcmp(one.data(), all.data(), one.size() * sizeof(float)), 0);
}

// ---- validation: each rule's message names the argument ------------------------------------

struct Valid {
  std::vector<float> o, ob, l, lb;
  MergeProblem p;
  Valid() : o(2 * 5 * 3 * 8), ob(o.size()), l(2 * 3 * 5), lb(l.size()) {
    p.batch = 2, p.seqlen = 5, p.heads = 3, p.headdim = 8;
    p.out = {o.data(), 5 * 3 * 8, 3 * 8, 8};
    p.out_b = {ob.data(), 5 * 3 * 8, 3 * 8, 8};
    p.lse = l.data(), p.lse_head_stride = 5, p.lse_batch_stride = 15;
    p.lse_b = lb.data(), p.lse_b_head_stride = 5, p.lse_b_batch_stride = 15;
  }
};

void expect_error(const MergeProblem& p, ErrorKind kind, const std::string& text) {
  try {
    merge_attention(p);
    ADD_FAILURE() << "expected an error containing: " << text;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

TEST(MergeValidation, EachRuleNamesItsArgument) {
  using K = ErrorKind;
  {
    Valid v;
    merge_attention(v.p);  // the base case is valid
  }
  const auto with = [](auto&& edit, K kind, const std::string& text) {
    Valid v;
    edit(v.p);
    expect_error(v.p, kind, text);
  };
  with([](MergeProblem& p) { p.seqlen = -1; }, K::invalid_argument, "seqlen=-1 must be >= 0");
  with([](MergeProblem& p) { p.headdim = -2; }, K::invalid_argument, "headdim=-2 must be >= 0");
  with([](MergeProblem& p) { p.out.data = nullptr; }, K::invalid_argument, "out.data is null");
  with([](MergeProblem& p) { p.lse_b = nullptr; }, K::invalid_argument, "lse_b is null");
  with([](MergeProblem& p) { p.out_b.data = static_cast<char*>(p.out_b.data) + 2; }, K::invalid_argument,
       "out_b.data is not aligned to 4 bytes");
  with([](MergeProblem& p) { p.out_dtype = DType(7); }, K::invalid_type, "out_dtype=7 is not a supported DType");
  with([](MergeProblem& p) { p.out_b_dtype = DType(-1); }, K::invalid_type, "out_b_dtype=-1 is not a supported DType");
  with([](MergeProblem& p) { p.out_dtype = DType::bf16, p.out_b_dtype = DType::f16; }, K::invalid_type,
       "out_b_dtype=f16 must equal out_dtype=bf16");
  with([](MergeProblem& p) { p.out.seq_stride = 8; }, K::invalid_argument,
       "out.seq_stride=8 makes output out overlap itself");
  with([](MergeProblem& p) { p.out_b.head_stride = -8; }, K::invalid_argument,
       "out_b.head_stride=-8 must not be negative");
  with([](MergeProblem& p) { p.out.seq_stride = 0; }, K::invalid_argument,
       "out.seq_stride=0 must be positive (seqlen=5 > 1)");
  with([](MergeProblem& p) { p.lse_batch_stride = 0; }, K::invalid_argument,
       "lse.batch_stride=0 must be positive (batch=2 > 1)");
  with([](MergeProblem& p) { p.lse_head_stride = 3; }, K::invalid_argument,
       "lse.head_stride=3 makes output lse overlap itself");
  with([](MergeProblem& p) { p.lse_b_batch_stride = -1; }, K::invalid_argument,
       "lse_b.batch_stride=-1 must not be negative");
  with([](MergeProblem& p) { p.out_b.data = p.out.data; }, K::invalid_argument, "out_b overlaps out");
  with([](MergeProblem& p) { p.lse_b = p.lse + 3; }, K::invalid_argument, "lse_b overlaps lse");
  // A written tensor against the other side's input: a row's write would change a later row's read.
  with([](MergeProblem& p) { p.lse_b = static_cast<float*>(p.out.data) + 4; }, K::invalid_argument,
       "lse_b overlaps out");
  with([](MergeProblem& p) { p.out_b.data = p.lse + 2; }, K::invalid_argument, "out_b overlaps lse");
  with([](MergeProblem& p) { p.num_threads = -1; }, K::invalid_argument, "num_threads=-1 must be >= 0");
  with([](MergeProblem& p) { p.backend = Backend(9); }, K::invalid_argument, "backend=9 is not a Backend");
#ifndef TILEATTN_WITH_CUDA
  with([](MergeProblem& p) { p.backend = Backend::cuda; }, K::device, "no CUDA backend");
#endif
}

// A size of 0 merges nothing and needs no pointers.
TEST(MergeValidation, EmptyProblemIsANoOp) {
  MergeProblem p;
  p.batch = 2, p.seqlen = 0, p.heads = 3, p.headdim = 8;
  EXPECT_NO_THROW(merge_attention(p));
}

}  // namespace
}  // namespace tileattn::test
