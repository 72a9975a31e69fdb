#pragma once
// Tensor maps (the copy engine's description of a global tensor) for the tiles the sm90 kernels
// load: (dim, rows, heads, batch) with the last dimension contiguous, boxes of 64 elements x
// box_rows rows, written to shared memory with the 128-byte swizzle the wgmma descriptors read.
#include <cuda.h>

#include <cstdint>

#include "tileattn/problem.hpp"

namespace tileattn::cuda::sm90 {

struct TileMapShape {
  int64_t dim = 0, rows = 0, heads = 0, batch = 1;
  int64_t row_stride = 0, head_stride = 0, batch_stride = 0;  // in elements
  int box_rows = 0;
};

// False when the copy engine cannot describe the tensor (base not 16-byte aligned, a stride not
// a multiple of 16 bytes, sizes out of range): the caller then uses a kernel without TMA.
bool make_tile_map(CUtensorMap* map, DType dtype, const void* base, const TileMapShape& shape);

}  // namespace tileattn::cuda::sm90
