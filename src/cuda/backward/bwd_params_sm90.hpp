#pragma once
// What the sm90 backward kernels read: the backward's parameters plus one tensor map per tiled
// input, each with boxes of 64 columns x 64 rows (a tile of R rows is R / 64 boxes per panel).
#include <cuda.h>

#include "cuda/common/bwd_params.hpp"

namespace tileattn::cuda {

struct BwdSm90Params {
  bwd::BwdParams bwd;
  CUtensorMap q, k, v, dout;  // (dim, rows, heads, batch); varlen: (dim, total rows, heads, 1)
};

// Rows of one TMA box in the backward's tensor maps.
constexpr int kBwdBoxRows = 64;

}  // namespace tileattn::cuda
