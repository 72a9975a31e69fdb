#pragma once
// The score modifiers of one problem -- scale, soft-capping, ALiBi -- prepared once on the host
// from the validated problem (score_mod) and read by every backend, so that the CPU path and each
// GPU kernel family take their constants from one place. The float64 oracle writes the same
// formula out in double instead (it must not share the implementation it judges).
//
// A raw product x = q.k of query row i and key j of a sequence of lengths sq, sk becomes the score,
// in natural units,
//   s(i, j) = cap(scale * x) + bias(i, j),    cap(y) = softcap * tanh(y / softcap)  (y when softcap = 0)
//   bias(i, j) = -slope * |i + sk - sq - j|     (ALiBi, bottom-right aligned per sequence; 0 without slopes)
// with slope = alibi_slopes[b * alibi_batch_stride + h] for sequence b, query head h.
//
// flash-attn's causal kernels add slope * j instead: the same softmax (the two differ by the
// per-row constant slope * (i + sk - sq)), but the LSE they return carries that constant. Here the
// scores use the form above, small near the diagonal where the weight is, and the LSE is stored
// plus lse_offset(i) (and read back minus it), so that L equals flash-attn's softmax_lse. The
// causal form applies where flash-attn's kernel takes its causal branch: a right bound of 0 and no
// left bound (a left bound reaching past every key counts as none).
#include <math.h>

#include <cstdint>

#include "host_device.hpp"
#include "online_softmax.hpp"
#include "tileattn/problem.hpp"

namespace tileattn {

struct ScoreMod {
  float scale = 1.0f;         // softmax_scale
  float scale_log2 = 0.0f;    // scale * log2(e): natural units to the log2 domain in one multiply
  float softcap = 0.0f;       // 0: off
  float softcap_pre = 0.0f;   // scale / softcap: x * softcap_pre = scale * x / softcap (0: off)
  float softcap_post = 0.0f;  // softcap / scale: the cap in raw units, cap(scale x) / scale (0: off)
  const float* alibi_slopes = nullptr;  // null: no bias (kernels then skip the bias per tile)
  int64_t alibi_batch_stride = 0;       // 0: one slope per head for every sequence
  bool alibi_lse_offset = false;        // causal form: L carries slope * (i + sk - sq)

  TA_HOST_DEVICE bool has_alibi() const { return alibi_slopes != nullptr; }

  // Slope of sequence b, query head h; 0 without ALiBi.
  TA_HOST_DEVICE float slope(int64_t b, int64_t h) const {
    return alibi_slopes != nullptr ? alibi_slopes[b * alibi_batch_stride + h] : 0.0f;
  }

  // The capped score cap(scale * x) of a raw product, natural units.
  TA_HOST_DEVICE float capped(float x) const { return softcap > 0.0f ? softcap * tanhf(x * softcap_pre) : x * scale; }

  // d cap / d y at a capped score c (1 without a cap): 1 - tanh^2, from c alone.
  TA_HOST_DEVICE float cap_grad(float c) const { return softcap_grad(c, softcap); }

  // |i + sk - sq - j|: the distance ALiBi penalises, summed so that no int32 intermediate overflows.
  TA_HOST_DEVICE static float alibi_distance(int i, int j, int sq, int sk) {
    const int d = (i - sq) + (sk - j);
    return float(d < 0 ? -d : d);
  }
  // bias(i, j) in the units of `slope` (natural slope: natural units; slope / scale: raw units).
  TA_HOST_DEVICE static float alibi_bias(float slope, int i, int j, int sq, int sk) {
    return -slope * alibi_distance(i, j, sq, sk);
  }
  // What L carries beyond the LSE of the scores above, natural units (0 but in the causal form).
  TA_HOST_DEVICE float lse_offset(float slope, int i, int sq, int sk) const {
    return alibi_lse_offset ? slope * float((i - sq) + sk) : 0.0f;
  }
};

// The one preparation, from a validated (normalised) problem.
inline ScoreMod score_mod(const AttentionProblem& p) {
  ScoreMod m;
  m.scale = p.softmax_scale ? *p.softmax_scale : 1.0f;
  m.scale_log2 = m.scale * kLog2e;
  if (p.softcap > 0.0f) {
    m.softcap = p.softcap;
    m.softcap_pre = m.scale / p.softcap;
    m.softcap_post = p.softcap / m.scale;
  }
  m.alibi_slopes = p.alibi_slopes;
  m.alibi_batch_stride = p.alibi_batch_stride;
  const bool no_left = p.window_left < 0 || p.window_left >= p.seqlen_k;
  m.alibi_lse_offset = p.alibi_slopes != nullptr && p.window_right == 0 && no_left;
  return m;
}

}  // namespace tileattn
