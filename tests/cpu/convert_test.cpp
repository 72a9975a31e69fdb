// fp16/bf16 conversions against independent references: the compiler's _Float16 (libgcc's
// correctly rounded conversion) and a nearest-neighbour search in double for bf16.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <random>

#include "cpu/convert.hpp"
#include "support/host_problem.hpp"

namespace tileattn::cpu {
namespace {

TEST(Convert, HalfToFloatMatchesCompilerForAllBitPatterns) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float want = float(std::bit_cast<_Float16>(uint16_t(h)));
    const float got = half_to_float(uint16_t(h));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << h;
    } else {
      EXPECT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(want)) << h;
    }
  }
}

TEST(Convert, HalfRoundTripIsIdentityForNonNan) {
  for (uint32_t h = 0; h < 65536; ++h) {
    if ((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu)) continue;
    EXPECT_EQ(float_to_half(half_to_float(uint16_t(h))), h);
  }
}

void expect_half_matches_compiler(float f) {
  const uint16_t want = std::bit_cast<uint16_t>(_Float16(f));
  const uint16_t got = float_to_half(f);
  if (std::isnan(f)) {
    EXPECT_EQ(got & 0x7c00u, 0x7c00u);
    EXPECT_NE(got & 0x3ffu, 0u);
  } else {
    ASSERT_EQ(got, want) << std::hexfloat << f;
  }
}

TEST(Convert, FloatToHalfMatchesCompilerOnEdgesAndRandomBits) {
  // Ties and neighbours around every fp16 value, in every binade including subnormals.
  for (uint32_t h = 0; h < 0x7c00u; ++h) {
    const float a = half_to_float(uint16_t(h)), b = half_to_float(uint16_t(h + 1));
    const float mid = float((double(a) + double(b)) / 2.0);
    for (float f : {a, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f)}) {
      expect_half_matches_compiler(f);
      expect_half_matches_compiler(-f);
    }
  }
  for (float f : {65504.0f, 65519.99f, 65520.0f, 1e10f, INFINITY, -INFINITY, NAN, 0x1p-25f, 0x1.000002p-25f,
                  0x1p-26f, 0x1p-24f, 0x1.8p-24f, 0.0f, -0.0f})
    expect_half_matches_compiler(f);
  std::mt19937 rng(test::fresh_seed() & 0xffffffffu);
  for (int i = 0; i < 2'000'000; ++i) expect_half_matches_compiler(std::bit_cast<float>(uint32_t(rng())));
}

// The bf16 nearest to f by search in double, ties to the even bit pattern; inf stands for 2^128
// (IEEE rounds to inf from half an ulp above the largest finite value).
uint16_t nearest_bf16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint16_t lo = uint16_t(x >> 16), hi = uint16_t(lo + 1);
  const double vhi = (hi & 0x7fffu) == 0x7f80u ? std::copysign(0x1p128, double(f)) : double(bf16_to_float(hi));
  const double dlo = std::abs(double(bf16_to_float(lo)) - double(f));
  const double dhi = std::abs(vhi - double(f));
  if ((x & 0xffffu) == 0) return lo;
  if (dlo < dhi) return lo;
  if (dhi < dlo) return hi;
  return (lo & 1u) ? hi : lo;
}

TEST(Convert, FloatToBf16IsNearestEven) {
  std::mt19937 rng(test::fresh_seed() & 0xffffffffu);
  for (int i = 0; i < 2'000'000; ++i) {
    const float f = std::bit_cast<float>(uint32_t(rng()));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(f))));
      continue;
    }
    ASSERT_EQ(float_to_bf16(f), nearest_bf16(f)) << std::hexfloat << f;
  }
  EXPECT_EQ(float_to_bf16(INFINITY), 0x7f80u);
  EXPECT_EQ(float_to_bf16(std::bit_cast<float>(0x7f7fffffu)), 0x7f80u);  // FLT_MAX rounds to inf
  EXPECT_EQ(float_to_bf16(std::bit_cast<float>(0x00018000u)), 0x0002u);  // subnormal tie, to even
  EXPECT_EQ(float_to_bf16(std::bit_cast<float>(0x00008000u)), 0x0000u);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::bit_cast<float>(0x7f800001u)))));
}

}  // namespace
}  // namespace tileattn::cpu
