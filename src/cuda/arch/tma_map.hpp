#pragma once
// Tensor maps (the copy engine's description of a global tensor) for the tiles the sm90 kernels
// load: (dim, rows, heads, batch) with the last dimension contiguous, boxes of one 128-byte row
// (64 16-bit or 32 fp32 elements) x box_rows rows, written to shared memory with the 128-byte
// swizzle the wgmma descriptors read.
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

// make_tile_map for a tensor that TMA stores to: its rows must also be whole 16-byte units. A
// store writes the last 16-byte unit of a shorter row whole, past the row's end (H100: without
// this rule the forward sweep's padded_dv17, O rows of 34 bytes in a padded buffer, fails with
// "O written outside its view"); loads of such rows are correct.
bool make_store_map(CUtensorMap* map, DType dtype, const void* base, const TileMapShape& shape);

// Shape of one attention tensor (Q, K, V, O, dO: rows of `seqlen`, or of `total` for varlen,
// which become one sequence) in boxes of box_rows rows.
TileMapShape attention_map_shape(const AttentionProblem& problem, const TensorView& t, int64_t dim, int64_t seqlen,
                                 int64_t total, int64_t heads, int box_rows);

}  // namespace tileattn::cuda::sm90
