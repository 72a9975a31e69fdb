#include "support/metrics.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

#include "cpu/convert.hpp"

namespace tileattn::test {

ErrorStats compare(const std::vector<double>& got, const std::vector<double>& want) {
  ErrorStats e;
  if (got.size() != want.size()) {
    e.max_abs = e.rel_l2 = std::numeric_limits<double>::infinity();
    e.nonfinite = int64_t(std::max(got.size(), want.size()));
    return e;
  }
  double diff2 = 0.0, ref2 = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = got[i], w = want[i];
    double d;
    if (std::isfinite(w)) {
      e.max_ref = std::max(e.max_ref, std::abs(w));
      ref2 += w * w;
      d = std::isfinite(g) ? std::abs(g - w) : std::numeric_limits<double>::infinity();
    } else {
      d = (g == w) ? 0.0 : std::numeric_limits<double>::infinity();
    }
    if (std::isinf(d)) {
      ++e.nonfinite;
    } else {
      diff2 += d * d;
    }
    if (d > e.max_abs || (std::isinf(d) && e.worst < 0)) {
      e.max_abs = d;
      e.worst = int64_t(i);
    }
  }
  e.rel_l2 = e.nonfinite ? std::numeric_limits<double>::infinity()
                         : (ref2 > 0.0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2));
  return e;
}

std::ostream& operator<<(std::ostream& os, const ErrorStats& e) {
  return os << "max_abs=" << e.max_abs << " rel_l2=" << e.rel_l2 << " max_ref=" << e.max_ref
            << " nonfinite=" << e.nonfinite << " worst_index=" << e.worst;
}

testing::AssertionResult within(const std::vector<double>& got, const std::vector<double>& want, double rel,
                                double abs) {
  const ErrorStats e = compare(got, want);
  if (got.size() != want.size())
    return testing::AssertionFailure() << "size " << got.size() << " != reference size " << want.size();
  int64_t bad = 0;
  std::ostringstream first;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = got[i], w = want[i];
    const bool ok = std::isfinite(w) ? std::abs(g - w) <= rel * std::abs(w) + abs : g == w;
    if (ok) continue;
    if (bad < 5) first << "\n  [" << i << "] got " << g << " want " << w;
    ++bad;
  }
  if (bad == 0) return testing::AssertionSuccess();
  return testing::AssertionFailure() << bad << " of " << got.size() << " elements outside |got - want| <= " << rel
                                     << "|want| + " << abs << " (" << e << "); first:" << first.str();
}

testing::AssertionResult two_x_rule(const std::vector<double>& got, const std::vector<double>& naive,
                                    const std::vector<double>& oracle, double floor) {
  const ErrorStats ours = compare(got, oracle), theirs = compare(naive, oracle);
  const double bound = 2.0 * theirs.max_abs + floor;
  if (ours.nonfinite == 0 && ours.max_abs <= bound) return testing::AssertionSuccess();
  return testing::AssertionFailure() << "error " << ours.max_abs << " > 2 x naive " << theirs.max_abs << " + " << floor
                                     << " = " << bound << " (" << ours << ")";
}

double two_x_floor(DType dtype) { return dtype == DType::f32 ? 1e-6 : dtype == DType::f16 ? 2e-4 : 2e-3; }

double two_x_floor(DType dtype, const std::vector<double>& oracle) {
  return two_x_floor(dtype) * std::max(1.0, compare(oracle, oracle).max_ref);
}

double unit_roundoff(DType dtype) {
  switch (dtype) {
    case DType::f32: return 0x1p-24;
    case DType::f16: return 0x1p-11;
    case DType::bf16: return 0x1p-8;
  }
  return 0.0;
}

std::vector<double> round_to(const std::vector<double>& values, DType dtype) {
  std::vector<double> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    const float f = float(values[i]);
    float r = f;
    if (dtype == DType::f16) r = cpu::half_to_float(cpu::float_to_half(f));
    if (dtype == DType::bf16) r = cpu::bf16_to_float(cpu::float_to_bf16(f));
    out[i] = r;
  }
  return out;
}

}  // namespace tileattn::test
