#pragma once
// Where sequence b of a variable-length batch lies in its packed buffer, for every kernel.
//
// Validation checks cu_seqlens on the host wherever it can read them; during CUDA-graph capture
// it cannot (reading device memory would synchronise), so kernels never use the offsets raw:
// offsets that validation accepts pass through unchanged, and any others are clamped so that a
// sequence stays inside its buffer of `total` rows and within the grid's `max_len`.
#include <cstdint>

#include "host_device.hpp"

namespace tileattn {

struct SeqRange {
  int begin;  // first row in the packed buffer
  int len;
};

TA_HOST_DEVICE SeqRange varlen_range(const int32_t* cu, int b, int64_t total, int max_len) {
  int64_t lo = cu[b], hi = cu[b + 1];
  lo = lo < 0 ? 0 : (lo > total ? total : lo);
  hi = hi < lo ? lo : (hi > total ? total : hi);
  const int64_t len = hi - lo < max_len ? hi - lo : max_len;
  return {int(lo), int(len)};
}

}  // namespace tileattn
