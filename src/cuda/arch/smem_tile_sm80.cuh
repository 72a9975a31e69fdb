#pragma once
// A (rows x cols) tile of 16-bit elements in shared memory, row-major in 16-byte chunks whose
// order inside each row is XOR-swizzled with the row index, so that the 8 row addresses of one
// ldmatrix (and of one cp.async wave) fall in 8 different bank groups:
//  - chunks per row a multiple of 8 (row = 0 mod 128 bytes): chunk ^= row % 8;
//  - otherwise (32, 96: rows of 64 or 192 bytes, alternating bank halves): chunk ^= (row / 2) % 4,
//    which stays inside each aligned group of 4 chunks.
#include <cstdint>

#include "common/key_rows.hpp"
#include "cuda/arch/ptx_sm80.cuh"

namespace tileattn::cuda {

template <int kRows_, int kCols_>
struct SmemTile {
  static constexpr int kRows = kRows_;
  static constexpr int kCols = kCols_;
  static_assert(kCols % 32 == 0, "tile width must be a multiple of 32 elements");
  static constexpr int kChunks = kCols / 8;  // 16-byte chunks per row
  static constexpr int kElements = kRows * kCols;

  // Element offset of (row, col); col must be a multiple of 8 (chunk granularity).
  __device__ __forceinline__ static int offset(int row, int col) {
    // Unsigned bit operations let the compiler see that rows 8 apart share a swizzle.
    const unsigned chunk = unsigned(col) / 8, r = unsigned(row);
    const int swizzled = int((kChunks % 8 == 0) ? (chunk ^ (r & 7u)) : (chunk ^ ((r >> 1) & 3u)));
    return row * kCols + swizzled * 8;
  }

  // The swizzle repeats every kPeriod steps of 16 columns and every 8 rows (16 in the (row/2)
  // mode), so the ldmatrix address of a lane for (row + 16 i, 16 s + col) is one of kPeriod
  // per-lane registers plus a compile-time offset: precomputing those few registers keeps the
  // unrolled loops from holding one address register per (i, s).
  static constexpr int kPeriod = kChunks % 8 == 0 ? 4 : 2;
  struct LaneAddresses {
    uint32_t base[kPeriod];
  };
  // row, col: this lane's ldmatrix row and column (col a multiple of 8, below 16).
  __device__ __forceinline__ static LaneAddresses lane_addresses(const void* tile, int row, int col) {
    LaneAddresses a;
#pragma unroll
    for (int s = 0; s < kPeriod; ++s) a.base[s] = smem_address(tile) + 2 * offset(row, 16 * s + col);
    return a;
  }
  // Byte address for (row + row_add, 16 * step + col); row_add a multiple of 16 (constants fold
  // into the instruction).
  __device__ __forceinline__ static uint32_t address(const LaneAddresses& a, int step, int row_add) {
    return a.base[step % kPeriod] + (step / kPeriod) * kPeriod * 32 + row_add * kCols * 2;
  }
};

// Copies the (rows_valid x cols_valid) corner of a global tile into `tile` and zero-fills the rest
// of it, so padded head dims and rows past the sequence end contribute nothing (and never NaN).
// `vectorized`: cp.async in 16-byte chunks (aligned data, cols_valid % 8 == 0); otherwise plain
// element loads, which the caller's __syncthreads publishes like the asynchronous ones.
//
// Threads form (kThreads / kSlots) rows x kSlots chunk slots, kSlots the power of two >= chunks
// per row (slots past the row end idle): each thread then walks one column of chunks with a
// running pointer, and (when a pass spans a multiple of 8 rows) its shared-memory offsets differ
// by compile-time constants.
template <class Tile, int kThreads, class T>
__device__ __forceinline__ void load_tile(T* tile, const T* global, int64_t row_stride, int rows_valid, int cols_valid,
                                          bool vectorized) {
  constexpr int kSlots = Tile::kChunks <= 4 ? 4 : Tile::kChunks <= 8 ? 8 : Tile::kChunks <= 16 ? 16 : 32;
  constexpr int kRowsPerPass = kThreads / kSlots;
  static_assert(Tile::kChunks <= 32 && Tile::kRows % kRowsPerPass == 0, "passes must cover the tile");
  const int slot = int(threadIdx.x) % kSlots, row0 = int(threadIdx.x) / kSlots;
  if (slot >= Tile::kChunks) return;
  const int col = slot * 8;
  const T* src = global + int64_t(row0) * row_stride + col;
  const int64_t pass_stride = int64_t(kRowsPerPass) * row_stride;
  if (vectorized) {
    const bool col_inside = col < cols_valid;
#pragma unroll
    for (int i = 0; i < Tile::kRows / kRowsPerPass; ++i) {
      const int row = row0 + i * kRowsPerPass;
      const bool inside = col_inside && row < rows_valid;
      cp_async_16(smem_address(tile + Tile::offset(row, col)), inside ? src : global, inside ? 16 : 0);
      src += pass_stride;
    }
  } else {
    for (int i = 0; i < Tile::kRows / kRowsPerPass; ++i) {
      const int row = row0 + i * kRowsPerPass;
      T* dst = tile + Tile::offset(row, col);
#pragma unroll
      for (int e = 0; e < 8; ++e) dst[e] = (row < rows_valid && col + e < cols_valid) ? src[e] : T(0.0f);
      src += pass_stride;
    }
  }
}

// load_tile for rows that are not one strided block (a paged cache whose pages are shorter than
// the tile): `row_address(row)` gives each valid row's start. Same thread layout and zero fill.
template <class Tile, int kThreads, class T, class RowAddress>
__device__ __forceinline__ void load_tile_rows(T* tile, RowAddress row_address, int rows_valid, int cols_valid,
                                               bool vectorized) {
  constexpr int kSlots = Tile::kChunks <= 4 ? 4 : Tile::kChunks <= 8 ? 8 : Tile::kChunks <= 16 ? 16 : 32;
  constexpr int kRowsPerPass = kThreads / kSlots;
  static_assert(Tile::kChunks <= 32 && Tile::kRows % kRowsPerPass == 0, "passes must cover the tile");
  const int slot = int(threadIdx.x) % kSlots, row0 = int(threadIdx.x) / kSlots;
  if (slot >= Tile::kChunks) return;
  const int col = slot * 8;
#pragma unroll
  for (int i = 0; i < Tile::kRows / kRowsPerPass; ++i) {
    const int row = row0 + i * kRowsPerPass;
    const bool inside = row < rows_valid;
    const T* src = inside ? row_address(row) + col : nullptr;
    if (vectorized) {
      const bool copy = inside && col < cols_valid;
      cp_async_16(smem_address(tile + Tile::offset(row, col)), copy ? src : row_address(0), copy ? 16 : 0);
    } else {
      T* dst = tile + Tile::offset(row, col);
#pragma unroll
      for (int e = 0; e < 8; ++e) dst[e] = (inside && col + e < cols_valid) ? src[e] : T(0.0f);
    }
  }
}

// One warp's share of a tile: rows [first_row, first_row + kRows) (first_row a multiple of 8)
// from one strided block (e.g. one page), zero-filled past rows_valid / cols_valid like
// load_tile. The warp's lanes form (32 / kSlots) rows x kSlots chunk slots and walk the rows
// with a running pointer.
template <class Tile, int kRows, class T>
__device__ __forceinline__ void load_warp_rows(T* tile, int first_row, const T* global, int64_t row_stride,
                                               int rows_valid, int cols_valid, bool vectorized) {
  constexpr int kSlots = Tile::kChunks <= 4 ? 4 : Tile::kChunks <= 8 ? 8 : Tile::kChunks <= 16 ? 16 : 32;
  constexpr int kRowsPerPass = 32 / kSlots;
  static_assert(kRows % kRowsPerPass == 0, "passes must cover the rows");
  const int lane = int(threadIdx.x) % 32, slot = lane % kSlots, row0 = lane / kSlots;
  if (slot >= Tile::kChunks) return;
  const int col = slot * 8;
  const T* src = global + int64_t(row0) * row_stride + col;
  const int64_t pass_stride = int64_t(kRowsPerPass) * row_stride;
  if (vectorized && rows_valid >= kRows && cols_valid >= Tile::kCols) {
    // Whole pages take a loop without tests. The swizzle repeats every 8 rows (first_row leaves it
    // as it is), so a pass's shared address is one of kPeriod registers plus a constant.
    constexpr int kPasses = kRows / kRowsPerPass;
    constexpr int kPeriod = 8 / kRowsPerPass < kPasses ? 8 / kRowsPerPass : kPasses;
    uint32_t base[kPeriod];
#pragma unroll
    for (int s = 0; s < kPeriod; ++s)
      base[s] = smem_address(tile + first_row * Tile::kCols + Tile::offset(row0 + s * kRowsPerPass, col));
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      cp_async_16(base[i % kPeriod] + (i / kPeriod) * 8 * Tile::kCols * int(sizeof(T)), src, 16);
      src += pass_stride;
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < kRows / kRowsPerPass; ++i) {
    const int row = row0 + i * kRowsPerPass;
    const bool inside = row < rows_valid;
    if (vectorized) {
      const bool copy = inside && col < cols_valid;
      cp_async_16(smem_address(tile + Tile::offset(first_row + row, col)), copy ? src : global, copy ? 16 : 0);
    } else {
      T* dst = tile + Tile::offset(first_row + row, col);
#pragma unroll
      for (int e = 0; e < 8; ++e) dst[e] = (inside && col + e < cols_valid) ? src[e] : T(0.0f);
    }
    src += pass_stride;
  }
}

// A page id read a tile before the copies it addresses. Volatile so the compiler issues the read
// here rather than sinking it next to its use, where the copies would wait on it.
__device__ __forceinline__ int load_page_id(const int32_t* id) {
  int page;
  asm volatile("ld.global.nc.b32 %0, [%1];\n" : "=r"(page) : "l"(id));
  return page;
}

// load_tile for the rows [key0, key0 + rows) of a paged cache whose pages are shorter than the
// tile: row r lies at row r % page_size of page pages[r / page_size] (clamped to num_pages).
// fetch() reads the page ids of the rows this thread copies, all at once so the reads overlap;
// a caller can issue it a tile ahead, and share one fetch between K and V (the same rows).
template <class Tile, int kThreads>
struct PagedRows {
  static constexpr int kSlots = Tile::kChunks <= 4 ? 4 : Tile::kChunks <= 8 ? 8 : Tile::kChunks <= 16 ? 16 : 32;
  static constexpr int kRowsPerPass = kThreads / kSlots;
  static constexpr int kPasses = Tile::kRows / kRowsPerPass;
  static_assert(Tile::kChunks <= 32 && Tile::kRows % kRowsPerPass == 0, "passes must cover the tile");
  int page[kPasses];

  __device__ __forceinline__ void fetch(const KeyLayout& l, const int32_t* pages, int key0, int rows_valid) {
    const int row0 = int(threadIdx.x) / kSlots;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int row = row0 + i * kRowsPerPass;
      page[i] = row < rows_valid ? load_page_id(pages + l.page_of(key0 + row)) : 0;
    }
  }

  template <class T>
  __device__ __forceinline__ void load(T* tile, const T* base, const KeyLayout& l, int key0, int64_t page_stride,
                                       int64_t row_stride, int rows_valid, int cols_valid, bool vectorized) const {
    const int slot = int(threadIdx.x) % kSlots, row0 = int(threadIdx.x) / kSlots;
    if (slot >= Tile::kChunks) return;
    const int col = slot * 8;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int row = row0 + i * kRowsPerPass;
      const bool inside = row < rows_valid;
      const int64_t pg = clamp_to(page[i], 0, l.num_pages - 1);
      const T* src = inside ? base + pg * page_stride + int64_t(l.row_in_page(key0 + row)) * row_stride + col : base;
      if (vectorized) {
        const bool copy = inside && col < cols_valid;
        cp_async_16(smem_address(tile + Tile::offset(row, col)), src, copy ? 16 : 0);
      } else {
        T* dst = tile + Tile::offset(row, col);
#pragma unroll
        for (int e = 0; e < 8; ++e) dst[e] = (inside && col + e < cols_valid) ? src[e] : T(0.0f);
      }
    }
  }
};

template <class Tile, int kThreads, class T>
__device__ __forceinline__ void load_tile_paged(T* tile, const T* base, const KeyLayout& l, const int32_t* pages,
                                                int key0, int64_t page_stride, int64_t row_stride, int rows_valid,
                                                int cols_valid, bool vectorized) {
  PagedRows<Tile, kThreads> rows;
  rows.fetch(l, pages, key0, rows_valid);
  rows.load(tile, base, l, key0, page_stride, row_stride, rows_valid, cols_valid, vectorized);
}

}  // namespace tileattn::cuda
