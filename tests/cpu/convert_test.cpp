// fp16/bf16 conversions against independent references written from the IEEE definitions:
// decoding by formula, and rounding as a nearest-neighbour search in double with ties to even.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <random>
#include <vector>

#include "cpu/convert.hpp"
#include "support/host_problem.hpp"

namespace tileattn::cpu {
namespace {

// fp16 by definition: (-1)^s 2^(e-15) (1 + m/1024), subnormal 2^-14 (m/1024), e = 31 inf/NaN.
double half_by_formula(uint16_t h) {
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  if (e == 31) return m ? std::nan("") : sign * INFINITY;
  if (e == 0) return sign * std::ldexp(m / 1024.0, -14);
  return sign * std::ldexp(1.0 + m / 1024.0, e - 15);
}

TEST(Convert, HalfToFloatMatchesDefinitionForAllBitPatterns) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const double want = half_by_formula(uint16_t(h));
    const float got = half_to_float(uint16_t(h));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << h;
    } else {
      EXPECT_EQ(double(got), want) << h;
      EXPECT_EQ(std::signbit(got), bool(h & 0x8000)) << h;
    }
  }
}

// The row loads (vectorised, F16C for fp16 where the build has it) decode every bit pattern as the
// definition does, at every offset of a row and for the scalar tail.
TEST(Convert, LoadElementsMatchesDefinitionForAllBitPatterns) {
  std::vector<uint16_t> bits(65536 + 11);
  for (uint32_t h = 0; h < 65536; ++h) bits[h + 3] = uint16_t(h);
  for (const DType dtype : {DType::f16, DType::bf16}) {
    std::vector<float> out(65536);
    load_elements(bits.data(), 3, dtype, 65536, out.data());
    for (uint32_t h = 0; h < 65536; ++h) {
      const double want = dtype == DType::f16 ? half_by_formula(uint16_t(h))
                                              : double(std::bit_cast<float>(uint32_t(h) << 16));
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(out[h])) << h;
      } else {
        EXPECT_EQ(double(out[h]), want) << h;
        EXPECT_EQ(std::signbit(out[h]), bool(h & 0x8000)) << h;
      }
    }
    for (int64_t n = 0; n < 11; ++n) {  // lengths around the 8-wide chunks
      std::vector<float> part(size_t(n) + 1, -7.0f);
      load_elements(bits.data(), 1000 + n, dtype, n, part.data());
      for (int64_t i = 0; i < n; ++i) EXPECT_EQ(part[size_t(i)], load_element(bits.data(), 1000 + n + i, dtype));
      EXPECT_EQ(part[size_t(n)], -7.0f) << "wrote past the row";
    }
  }
}

TEST(Convert, HalfRoundTripIsIdentityForNonNan) {
  for (uint32_t h = 0; h < 65536; ++h) {
    if ((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu)) continue;
    EXPECT_EQ(float_to_half(half_to_float(uint16_t(h))), h);
  }
}

// The fp16 nearest to f: binary search over the finite non-negative fp16 values (their bit
// patterns 0..0x7bff are increasing), ties to the even pattern; 65536 stands for inf (IEEE
// rounds to inf from half an ulp above 65504).
uint16_t nearest_half(float f) {
  const double a = std::abs(double(f));
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  uint32_t lo = 0, hi = 0x7c00;  // half_by_formula(lo) <= a < value(hi)
  auto value = [](uint32_t b) { return b == 0x7c00 ? 65536.0 : half_by_formula(uint16_t(b)); };
  if (a >= 65536.0) return sign | 0x7c00;
  while (hi - lo > 1) {
    const uint32_t mid = (lo + hi) / 2;
    (value(mid) <= a ? lo : hi) = mid;
  }
  const double dlo = a - value(lo), dhi = value(hi) - a;
  const uint32_t pick = dlo < dhi ? lo : dhi < dlo ? hi : (lo & 1u) ? hi : lo;
  return sign | uint16_t(pick);
}

void expect_half_nearest(float f) {
  const uint16_t got = float_to_half(f);
  if (std::isnan(f)) {
    ASSERT_EQ(got & 0x7c00u, 0x7c00u);
    ASSERT_NE(got & 0x3ffu, 0u);
  } else {
    ASSERT_EQ(got, nearest_half(f)) << std::hexfloat << f;
  }
}

TEST(Convert, FloatToHalfIsNearestEvenOnEdgesAndRandomBits) {
  // Ties and neighbours around every fp16 value, in every binade including subnormals.
  for (uint32_t h = 0; h < 0x7bffu; ++h) {
    const float a = half_to_float(uint16_t(h)), b = half_to_float(uint16_t(h + 1));
    const float mid = float((double(a) + double(b)) / 2.0);
    for (float f : {a, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f)}) {
      expect_half_nearest(f);
      expect_half_nearest(-f);
    }
  }
  for (float f : {65504.0f, 65519.99f, 65520.0f, 1e10f, INFINITY, -INFINITY, NAN, 0x1p-25f, 0x1.000002p-25f,
                  0x1p-26f, 0x1p-24f, 0x1.8p-24f, 0.0f, -0.0f})
    expect_half_nearest(f);
  EXPECT_EQ(float_to_half(65520.0f), 0x7c00u);  // the tie above the largest finite value
  EXPECT_EQ(float_to_half(0x1p-25f), 0x0000u);  // the tie below the smallest subnormal
  EXPECT_EQ(float_to_half(0x1.8p-24f), 0x0002u);  // 1.5 subnormal ulps: tie to even
  std::mt19937 rng(test::fresh_seed() & 0xffffffffu);
  for (int i = 0; i < 1'000'000; ++i) expect_half_nearest(std::bit_cast<float>(uint32_t(rng())));
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
