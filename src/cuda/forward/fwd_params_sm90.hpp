#pragma once
// What the sm90 forward reads: the forward's parameters plus one tensor map per input, built on
// the host (cuda/arch/tma_map.hpp) and passed by value as a __grid_constant__ kernel parameter.
#include <cuda.h>

#include "cuda/common/fwd_params.hpp"

namespace tileattn::cuda {

struct FwdSm90Params {
  FwdParams fwd;
  CUtensorMap q, k, v;  // (dim, rows, heads, batch); varlen: (dim, total rows, heads, 1)
  CUtensorMap o;        // as q, in boxes of 64 rows (one consumer's); valid when o_by_tma
  bool o_by_tma;        // the copy engine can describe O
  int block_n;          // keys per step of the kernel instance the maps were made for
  int consumers;        // its consumer warpgroups, 64 query rows each

  int block_m() const { return 64 * consumers; }  // rows of a Q tile (and of Q's boxes)
};

}  // namespace tileattn::cuda
