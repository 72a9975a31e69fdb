// The tiled CPU path's building blocks: the vectorised exp2 and the register-blocked tile
// product, against double precision on sizes that exercise full blocks and every edge.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "cpu/gemm_kernels.hpp"
#include "cpu/tile_ops.hpp"
#include "support/host_problem.hpp"

namespace tileattn::cpu {
namespace {

TEST(TileOps, Exp2RowIsAccurateAndMasksExactly) {
  std::mt19937 rng(test::fresh_seed() & 0xffffffffu);
  std::uniform_real_distribution<float> dist(-130.0f, 2.0f);
  for (int64_t n : {1, 3, 4, 7, 64}) {
    std::vector<float> x(static_cast<size_t>(n)), in;
    for (int trial = 0; trial < 2000; ++trial) {
      for (auto& e : x) e = dist(rng);
      // Half-integers, where rounding to the nearest integer may go either way (|f| = 1/2).
      if (trial % 5 == 1)
        for (auto& e : x) e = std::floor(e) + 0.5f;
      x[0] = trial % 3 == 0 ? -INFINITY : x[0];
      const float sub = trial % 2 ? 0.0f : 0.75f;
      in = x;
      exp2_row(x.data(), n, sub);
      for (int64_t j = 0; j < n; ++j) {
        const double arg = double(in[size_t(j)] - sub);  // the fp32 difference the row sees
        if (arg < -126.0) {
          ASSERT_EQ(x[size_t(j)], 0.0f) << in[size_t(j)];
        } else {
          const double want = std::exp2(arg);
          ASSERT_LE(std::abs(x[size_t(j)] - want), 2e-7 * want) << in[size_t(j)] << " - " << sub;
        }
      }
    }
  }
}

TEST(TileOps, GemmMatchesDoubleOnFullBlocksAndEdges) {
  std::mt19937 rng(test::fresh_seed() & 0xffffffffu);
  std::normal_distribution<float> dist;
  for (int64_t m : {1, 2, 5, 64})
    for (int64_t n : {1, 15, 16, 17, 50, 64})
      for (int64_t k : {1, 7, 64})
        for (bool transposed_a : {false, true}) {
          const int64_t lda = 70, ldb = 80, ldc = 90;
          std::vector<float> a(size_t(lda * 70)), b(size_t(ldb * 70)), c(size_t(ldc * 70), -1.0f);
          for (auto& e : a) e = dist(rng);
          for (auto& e : b) e = dist(rng);
          const int64_t a_row = transposed_a ? 1 : lda, a_col = transposed_a ? lda : 1;
          gemm(a.data(), a_row, a_col, b.data(), ldb, c.data(), ldc, m, n, k);
          for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < ldc; ++j) {
              if (j >= n) {
                ASSERT_EQ(c[size_t(i * ldc + j)], -1.0f) << "wrote outside the block";
                continue;
              }
              double want = 0.0, mag = 0.0;
              for (int64_t d = 0; d < k; ++d) {
                const double t = double(a[size_t(i * a_row + d * a_col)]) * b[size_t(d * ldb + j)];
                want += t;
                mag += std::abs(t);
              }
              ASSERT_NEAR(c[size_t(i * ldc + j)], want, 1e-6 * mag + 1e-30) << m << " " << n << " " << k;
            }
          for (int64_t i = m; i < 70; ++i) ASSERT_EQ(c[size_t(i * ldc)], -1.0f) << "wrote past row m";
        }
}

// The products' rounding is part of their contract (tile_ops.hpp): each element sums its k terms in
// runs of kGemmChunk, each run from zero, and adds the runs into C in order, whatever the register
// blocking; the backward's two schedules agree bitwise only because of it. Each element of a
// product must therefore equal the same product computed alone (a 1 x 1 problem: the scalar edge
// loop, no register block), bit for bit.
TEST(TileOps, GemmRoundsTheSameWhateverTheBlocking) {
  std::mt19937 rng(test::fresh_seed() & 0xffffffffu);
  std::normal_distribution<float> dist;
  for (int64_t m : {1, 3, 4, 6, 64})
    for (int64_t n : {1, 8, 16, 24, 40, 64})
      for (int64_t k : {1, 16, 17, 64, 100})
        for (bool transposed_a : {false, true})
          for (bool accumulate : {false, true}) {
            const int64_t lda = 101, ldb = 72, ldc = 80;
            std::vector<float> a(size_t(lda * 101)), b(size_t(ldb * 100)), c(size_t(ldc * 64));
            for (auto& e : a) e = dist(rng);
            for (auto& e : b) e = dist(rng);
            for (auto& e : c) e = dist(rng);
            const std::vector<float> c0 = c;
            const int64_t a_row = transposed_a ? 1 : lda, a_col = transposed_a ? lda : 1;
            const auto product = accumulate ? gemm_accumulate : gemm;
            product(a.data(), a_row, a_col, b.data(), ldb, c.data(), ldc, m, n, k);
            for (int64_t i = 0; i < m; ++i)
              for (int64_t j = 0; j < n; ++j) {
                float alone = c0[size_t(i * ldc + j)];
                product(&a[size_t(i * a_row)], a_row, a_col, &b[size_t(j)], ldb, &alone, 1, 1, 1, k);
                ASSERT_EQ(c[size_t(i * ldc + j)], alone) << m << " " << n << " " << k << " at " << i << "," << j;
              }
          }
}

// The AVX-512 instance and the build target's give the same bits, so that a result does not depend
// on the CPU the process runs on: whole blocks, strips of one vector, masked tails, both ways of
// reading A, overwrite and accumulate.
TEST(TileOps, Avx512AndTargetKernelsGiveTheSameBits) {
  const GemmKernels in_use = gemm_kernels();
  if (!use_gemm_kernels(GemmKernels::avx512)) GTEST_SKIP() << "no AVX-512 in this build or on this CPU";
  std::mt19937 rng(test::fresh_seed() & 0xffffffffu);
  std::normal_distribution<float> dist;
  for (int64_t m : {1, 5, 64})
    for (int64_t n : {3, 16, 40, 64, 100, 256})
      for (int64_t k : {0, 9, 64, 128})
        for (bool transposed_a : {false, true})
          for (bool accumulate : {false, true}) {
            const int64_t lda = 260, ldb = 264, ldc = 270;
            std::vector<float> a(size_t(lda * 260)), b(size_t(ldb * 128)), c(size_t(ldc * 64));
            for (auto& e : a) e = dist(rng);
            for (auto& e : b) e = dist(rng);
            for (auto& e : c) e = dist(rng);
            const int64_t a_row = transposed_a ? 1 : lda, a_col = transposed_a ? lda : 1;
            const auto product = accumulate ? gemm_accumulate : gemm;
            std::vector<float> wide = c, narrow = c;
            use_gemm_kernels(GemmKernels::avx512);
            product(a.data(), a_row, a_col, b.data(), ldb, wide.data(), ldc, m, n, k);
            use_gemm_kernels(GemmKernels::target);
            product(a.data(), a_row, a_col, b.data(), ldb, narrow.data(), ldc, m, n, k);
            ASSERT_EQ(std::memcmp(wide.data(), narrow.data(), wide.size() * sizeof(float)), 0)
                << m << " " << n << " " << k << " transposed " << transposed_a << " accumulate " << accumulate;
          }
  use_gemm_kernels(in_use);
}

// gemm_wide's contract (the backward's dQ and dK at headdim_qk <= 8): C += each element's k terms
// summed in double in order, each product exact, added to the double C once; so it equals that
// scalar sum bit for bit, with every row count (blocks of four and the rest), both layouts of A,
// and nothing written outside the block.
TEST(TileOps, GemmWideAddsTheExactProductsInDouble) {
  std::mt19937 rng(test::fresh_seed() & 0xffffffffu);
  std::normal_distribution<float> dist;
  for (int64_t m : {1, 3, 4, 7, 64})
    for (int64_t n : {1, 2, 4, 5, 8})
      for (int64_t k : {1, 17, 64})
        for (bool transposed_a : {false, true}) {
          const int64_t lda = 70, ldb = 9, ldc = 11;
          std::vector<float> a(size_t(lda * 70)), b(size_t(ldb * 64));
          std::vector<double> c(size_t(ldc * 70));
          for (auto& e : a) e = dist(rng);
          for (auto& e : b) e = dist(rng);
          for (auto& e : c) e = dist(rng);
          const std::vector<double> before = c;
          const int64_t a_row = transposed_a ? 1 : lda, a_col = transposed_a ? lda : 1;
          gemm_wide(a.data(), a_row, a_col, b.data(), ldb, c.data(), ldc, m, n, k);
          for (int64_t i = 0; i < 70; ++i)
            for (int64_t j = 0; j < ldc; ++j) {
              const size_t at = size_t(i * ldc + j);
              if (i >= m || j >= n) {
                ASSERT_EQ(c[at], before[at]) << "wrote outside the block";
                continue;
              }
              double sum = 0.0;
              for (int64_t t = 0; t < k; ++t)
                sum += double(a[size_t(i * a_row + t * a_col)]) * double(b[size_t(t * ldb + j)]);
              ASSERT_EQ(c[at], before[at] + sum) << m << " " << n << " " << k << " transposed " << transposed_a;
            }
        }
}

}  // namespace
}  // namespace tileattn::cpu
