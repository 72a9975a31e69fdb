#pragma once
// The scalar rules of the online softmax, written once for every kernel. Scores are kept in the
// log2 domain: s2 = score * scale * log2(e), so each exponential is one exp2.
//
// NaN guard: a row that has seen only masked keys has running max -inf; exp2(-inf - -inf) would
// be NaN, so such rows use 0 as the reference max (every exp2 then gives 0 and the sum stays 0).
#include <math.h>

#include "host_device.hpp"

namespace tileattn {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// The max to subtract before exp2 for a row whose running max is m.
TA_HOST_DEVICE float safe_row_max(float m) { return m == -INFINITY ? 0.0f : m; }

// Reference max for kernels that rescale lazily: it stays at m_old until a row's max m_tile
// passes it by more than `slack`, and then moves to the larger of the two. p stays at most
// 2^slack. Moving to the max itself gives the tile's largest score p = 1 exactly, so a row whose
// weight sits on one key keeps it unrounded where P is rounded to 16 bits.
TA_HOST_DEVICE float slack_row_max(float m_old, float m_tile, float slack) {
  if (m_old != -INFINITY && !(m_tile > m_old + slack)) return m_old;
  if (m_tile == -INFINITY) return m_old;
  return fmaxf(m_old, m_tile);
}

// The same, moving to a whole number at or above both: every rescale factor exp2(m_old - m_new)
// is then a power of two, so rescaling rounds nothing: rows that keep rising, rescaled dozens of
// times, lose no accuracy to it (the fp32 softmax(X) V kernels, where P is not rounded).
TA_HOST_DEVICE float lazy_row_max(float m_old, float m_tile, float slack) {
  return ceilf(slack_row_max(m_old, m_tile, slack));
}

// Factor by which the old accumulator and sum shrink when the running max moves m_old -> m_new.
TA_HOST_DEVICE float rescale_factor(float m_old, float m_new) {
  return m_old == -INFINITY ? 0.0f : exp2f(m_old - m_new);
}

// Natural-log LSE of a finished row from its log2-domain max and its sum; -inf for empty rows.
TA_HOST_DEVICE float finish_lse(float m_log2, float row_sum) {
  return row_sum > 0.0f ? (m_log2 + log2f(row_sum)) * kLn2 : -INFINITY;
}

// 1/sum for the output, 0 for empty rows (O = 0, never NaN).
TA_HOST_DEVICE float inverse_row_sum(float row_sum) { return row_sum > 0.0f ? 1.0f / row_sum : 0.0f; }

// Soft-capping in the natural domain: softcap * tanh(s / softcap); its derivative for backward
// is 1 - tanh^2, recovered from the capped value alone.
TA_HOST_DEVICE float apply_softcap(float s, float softcap) { return softcap > 0.0f ? softcap * tanhf(s / softcap) : s; }
TA_HOST_DEVICE float softcap_grad(float capped, float softcap) {
  if (softcap <= 0.0f) return 1.0f;
  float t = capped / softcap;
  return 1.0f - t * t;
}

}  // namespace tileattn
