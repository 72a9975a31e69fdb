#pragma once
// The one rule for wide memory accesses to a strided tensor: every row -- each (batch, seq, head)
// start -- sits on a multiple of `bytes` when the base does and every stride between rows is a
// whole number of `bytes` (the batch stride does not count for varlen, where rows are packed).
#include <cstdint>

#include "tileattn/problem.hpp"

namespace tileattn::cuda {

inline bool rows_aligned(const TensorView& t, int64_t element_bytes, int64_t bytes, bool varlen) {
  const int64_t n = bytes / element_bytes;  // elements per aligned unit
  return reinterpret_cast<uintptr_t>(t.data) % uintptr_t(bytes) == 0 && t.seq_stride % n == 0 &&
         t.head_stride % n == 0 && (varlen || t.batch_stride % n == 0);
}

}  // namespace tileattn::cuda
