#pragma once
// Error metrics against a float64 reference.
//
//   ErrorStats e = compare(got, want);   // same length, dense float64
//   EXPECT_LE(e.max_abs, tol) << e;
//   EXPECT_TRUE(within(got, want, rel, abs)) << "O";   // elementwise |got - want| <= rel|want| + abs
//
// Equal infinities (L = -inf of an empty row) count as exact; NaN or a mismatched infinity in
// `got` makes max_abs infinite and is counted in `nonfinite`, so one bad element fails any bound.
#include <gtest/gtest.h>

#include <cstdint>
#include <ostream>
#include <vector>

#include "tileattn/problem.hpp"

namespace tileattn::test {

struct ErrorStats {
  double max_abs = 0.0;   // max |got - want|
  double rel_l2 = 0.0;    // ||got - want|| / ||want|| (absolute when ||want|| == 0)
  double max_ref = 0.0;   // max |want| over finite entries (to scale tolerances)
  int64_t nonfinite = 0;  // elements where got is NaN or an infinity want does not have
  int64_t worst = -1;     // index of the max_abs element
};

ErrorStats compare(const std::vector<double>& got, const std::vector<double>& want);
std::ostream& operator<<(std::ostream& os, const ErrorStats& e);

// Success when every element has |got - want| <= rel * |want| + abs (equal infinities pass, NaN
// fails); otherwise names the worst elements and the overall ErrorStats.
testing::AssertionResult within(const std::vector<double>& got, const std::vector<double>& want, double rel,
                                double abs);

// flash-attn's accuracy rule (docs/accuracy.md): the error of `got` against the float64 `oracle`
// is at most twice the error of a same-precision naive implementation (`naive`), plus an
// absolute `floor`; errors are max |x - oracle| over the whole tensor, equal infinities exact.
// The floor is the whole allowance where the naive error is ~0 (e.g. gradients that are exactly
// 0 with one visible key), so it must not be raised to hide an error there.
testing::AssertionResult two_x_rule(const std::vector<double>& got, const std::vector<double>& naive,
                                    const std::vector<double>& oracle, double floor);

// The 2x rule's floor for an output of magnitude up to 1, the floors of
// tests/python/test_attention.py: 1e-6 (f32), 2e-4 (f16), 2e-3 (bf16); gradients take twice it.
double two_x_floor(DType dtype);

// The same floor in units of the oracle's largest element (at least 1), for outputs that reach
// well past 1, where an absolute floor is a couple of ulps.
double two_x_floor(DType dtype, const std::vector<double>& oracle);

// Unit roundoff of a dtype: 2^-24 (f32), 2^-11 (f16), 2^-8 (bf16).
double unit_roundoff(DType dtype);

// Rounds each element to `dtype` and back (what a correct kernel at best stores). Goes through
// fp32, so a double lying within 2^-24 relative of an fp16/bf16 tie may round the other way.
std::vector<double> round_to(const std::vector<double>& values, DType dtype);

}  // namespace tileattn::test
