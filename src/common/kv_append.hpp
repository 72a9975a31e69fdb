#pragma once
// Appending to a key/value cache with the rotary embedding (problem.hpp's k_new, v_new and
// rotary fields), as every backend does it: where the new rows of sequence b go, at which cache
// positions q and the new keys are rotated, and the rotation of one element. Like key_span,
// nothing here trusts the int32 tables: a length validation could not read is clamped, so every
// write stays inside the cache (an impossible length appends fewer rows, never elsewhere).
#include <cstdint>

#include "common/host_device.hpp"
#include "common/key_rows.hpp"
#include "tileattn/problem.hpp"

namespace tileattn {

// The new rows of one sequence: new row i (i < count) is row `first + i` of `keys` and is rotated
// at cache position `position + i`. count is seqlen_new except for lengths validation refuses.
struct AppendSpan {
  KeySpan keys;
  int first;
  int count;
  int position;
};

// Appending is fixed length only, so key_span's row0 is the left pad (0 when paged) and its rows
// are cache rows [row0, row0 + len), the last seqlen_new of them new.
TA_HOST_DEVICE AppendSpan append_span(const KeySpan& s, int seqlen_new) {
  const int first = s.len > seqlen_new ? s.len - seqlen_new : 0;
  return {s, first, s.len - first, int(s.row0) + first};
}
TA_HOST_DEVICE AppendSpan append_span(const KeyLayout& l, int b, int seqlen_new) {
  return append_span(key_span(l, b), seqlen_new);
}

// The cache position q's row i is rotated at: flash-attn rotates every query at the first new
// row unless the mask is causal or local, where query i sits at the new row i.
TA_HOST_DEVICE int query_position(const AppendSpan& a, int i, bool per_query) {
  return a.position + (per_query ? i : 0);
}

// Element j (< rotary_dim) of a rotated head row: the other element of its pair, the pair's
// frequency (the column of rotary_cos/sin) and whether j is the pair's first element.
struct RotaryLane {
  int partner;
  int freq;
  bool first;
};

TA_HOST_DEVICE RotaryLane rotary_lane(int j, int rotary_dim, bool interleaved) {
  if (interleaved) return {j ^ 1, j >> 1, (j & 1) == 0};
  const int half = rotary_dim >> 1;
  return j < half ? RotaryLane{j + half, j, true} : RotaryLane{j - half, j - half, false};
}

// The pair (a, b) becomes (a cos - b sin, a sin + b cos); x is this lane's element.
TA_HOST_DEVICE float rotate(float x, float partner, float cos, float sin, bool first) {
  return first ? x * cos - partner * sin : partner * sin + x * cos;
}

// q's rotated copy, which the attention reads in place of q: contiguous (batch, seqlen_q,
// heads_q, headdim_qk) at `data`, rotated_q_elements(p) elements.
inline int64_t rotated_q_elements(const AttentionProblem& p) {
  return p.has_rotary() ? p.batch * p.seqlen_q * p.heads_q * p.headdim_qk : 0;
}
inline TensorView rotated_q_view(const AttentionProblem& p, void* data) {
  return {data, p.seqlen_q * p.heads_q * p.headdim_qk, p.heads_q * p.headdim_qk, p.headdim_qk};
}

}  // namespace tileattn
