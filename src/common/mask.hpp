#pragma once
// The attention mask of one (sequence, head): causal and sliding window, bottom-right aligned
// when seqlen_q != seqlen_k (flash-attn >= 2.1). Shared by every backend so that the CPU oracle,
// the tiled CPU path and the GPU kernels agree on which keys a query sees.
//
// Query row i sees keys j with  i + shift - left <= j <= i + shift + right,  shift = sk - sq,
// clipped to [0, sk). left/right < 0 mean unbounded on that side.
#include "host_device.hpp"

namespace tileattn {

struct Mask {
  int seqlen_q = 0;
  int seqlen_k = 0;
  int left = -1;   // window_left, -1 = unbounded
  int right = -1;  // window_right, -1 = unbounded (causal is right == 0)

  TA_HOST_DEVICE bool has_left() const { return left >= 0; }
  TA_HOST_DEVICE bool has_right() const { return right >= 0; }
  TA_HOST_DEVICE bool any() const { return left >= 0 || right >= 0; }
  TA_HOST_DEVICE int shift() const { return seqlen_k - seqlen_q; }

  // First visible key of row i (may exceed end_key(i): the row then sees nothing).
  TA_HOST_DEVICE int begin_key(int i) const {
    if (!has_left()) return 0;
    int b = i + shift() - left;
    return b < 0 ? 0 : b;
  }
  // One past the last visible key of row i.
  TA_HOST_DEVICE int end_key(int i) const {
    if (!has_right()) return seqlen_k;
    long long e = (long long)i + shift() + right + 1;
    return e > seqlen_k ? seqlen_k : (e < 0 ? 0 : (int)e);
  }
  TA_HOST_DEVICE bool visible(int i, int j) const { return j >= begin_key(i) && j < end_key(i); }

  // Key range any row of the query tile [i0, i1) sees: tiles outside it are skipped.
  TA_HOST_DEVICE int tile_begin_key(int i0) const { return begin_key(i0); }
  TA_HOST_DEVICE int tile_end_key(int i1) const { return end_key(i1 - 1); }

  // Key range every row of [i0, i1) sees in full: key tiles inside it need no mask arithmetic.
  TA_HOST_DEVICE int full_begin_key(int i1) const { return begin_key(i1 - 1); }
  TA_HOST_DEVICE int full_end_key(int i0) const { return end_key(i0); }

  // Keys row i sees, and the fewest any row of [i0, i1) sees: along the rows the count rises, holds,
  // then falls, so its least over a range is at one of its ends.
  TA_HOST_DEVICE int visible_keys(int i) const {
    const int n = end_key(i) - begin_key(i);
    return n > 0 ? n : 0;
  }
  TA_HOST_DEVICE int fewest_visible_keys(int i0, int i1) const {
    const int a = visible_keys(i0), b = visible_keys(i1 - 1);
    return a < b ? a : b;
  }

  // Query range that sees at least one key of the key tile [j0, j1) (for backward loops over keys).
  TA_HOST_DEVICE int tile_begin_query(int j0) const {
    if (!has_right()) return 0;
    int b = j0 - shift() - right;  // smallest i with end_key(i) > j0
    return b < 0 ? 0 : (b > seqlen_q ? seqlen_q : b);
  }
  TA_HOST_DEVICE int tile_end_query(int j1) const {
    if (!has_left()) return seqlen_q;
    long long e = (long long)(j1 - 1) - shift() + left + 1;  // one past the largest i with begin_key(i) <= j1 - 1
    return e > seqlen_q ? seqlen_q : (e < 0 ? 0 : (int)e);
  }
};

}  // namespace tileattn
