#pragma once
// What the sm90 backward kernels read: the backward's parameters plus one tensor map per tiled
// input, each with boxes of one 128-byte panel x kBwdBoxRows rows (a tile of R rows is
// R / kBwdBoxRows boxes per panel; fp32's exact passes: kBwdExactBoxRows).
#include <cuda.h>

#include "cuda/common/bwd_params.hpp"

namespace tileattn::cuda {

struct BwdSm90Params {
  bwd::BwdParams bwd;
  CUtensorMap q, k, v, dout;  // (dim, rows, heads, batch); varlen: (dim, total rows, heads, 1)
};

// Rows of one TMA box in the backward's tensor maps.
constexpr int kBwdBoxRows = 64;
// fp32's exact passes stream steps of this many rows (bwd_kernel_exact_sm90.cuh).
constexpr int kBwdExactBoxRows = 32;

}  // namespace tileattn::cuda
