#pragma once
// The weights of one row of merge_attention (include/tileattn/merge.hpp), written once for the
// CPU path and the CUDA kernel so that both round alike.
#include <math.h>

#include "host_device.hpp"

namespace tileattn {

struct MergeWeights {
  float a, b;  // O = a * O_a + b * O_b; a side that is -inf (or +inf) gets exactly 0
  float lse;   // log(exp(L_a) + exp(L_b)); -inf when both are
};

// With m = max(L_a, L_b) and w = exp(min - m) <= 1: L = m + log1p(w), which keeps the full fp32
// precision of L where log(1 + w) would round w away for w < 2^-24. A -inf side contributes
// nothing, and both -inf give (0, 0, -inf) rather than the NaN of -inf - -inf. +inf is flash-attn's
// mark of a row without keys, so it is an empty side too.
TA_HOST_DEVICE MergeWeights merge_weights(float lse_a, float lse_b) {
  if (lse_a == INFINITY) lse_a = -INFINITY;
  if (lse_b == INFINITY) lse_b = -INFINITY;
  const float m = fmaxf(lse_a, lse_b);
  if (m == -INFINITY) return {0.0f, 0.0f, -INFINITY};
  const float ea = expf(lse_a - m), eb = expf(lse_b - m);  // one of them is 1
  const float inv = 1.0f / (ea + eb);
  return {ea * inv, eb * inv, m + log1pf(fminf(ea, eb))};
}

}  // namespace tileattn
