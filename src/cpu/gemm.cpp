// The tile products of the CPU backend (declared in tile_ops.hpp).
//
// They live in their own translation unit on purpose: inlined into the forward's tile loop, GCC
// allocated the register block differently at each call site and the same kernel ran anywhere
// from ~30 to ~85 GFLOP/s on one AVX2 core (Zen 3, 64 x 64 x 64 tiles); out of line, every
// caller gets the fast one, and a call costs nothing next to a tile.
#include <algorithm>

#include "cpu/tile_ops.hpp"

namespace tileattn::cpu {
namespace {

// Rows of a register block, measured best: AVX2 4 x 16 (6 x 16 ran ~5% slower on Zen 3, with the
// block's six row addresses and a 4-row edge for 64-row tiles), SSE 2 x 16.
constexpr int kGemmRows = kLanes == 8 ? 4 : 2;
constexpr int kGemmVecs = 16 / kLanes;
constexpr int kGemmCols = kLanes * kGemmVecs;

// One run of `terms` (<= kGemmChunk) terms into an MR x (kLanes * NV) block of C. Register
// blocking: the block's partial sums stay in registers for the whole run, and each B row is loaded
// once per MR rows. The run's sum is added into C, or with `Store` stored as sum + 0, the value
// adding it to a zeroed C gives, without reading C.
// A's element (r, d) is a[r * a_row + d * a_col]; the pointers step by one term at a time rather
// than the loop being unrolled over the whole run: unrolled, every term's address was a register
// of its own and GCC spilled them (a 64 x 64 x 64 product went from ~76 to ~83 GFLOP/s on one Zen 3
// core with the partial unroll).
template <int MR, int NV, bool Store>
[[gnu::always_inline]] inline void gemm_run(const float* a, int64_t a_row, int64_t a_col, const float* b, int64_t ldb,
                                            float* c, int64_t ldc, int64_t terms) {
  f32xN acc[MR][NV] = {};
#pragma GCC unroll 4
  for (int64_t d = 0; d < terms; ++d) {
    f32xN bd[NV];
    for (int v = 0; v < NV; ++v) bd[v] = load_lanes(b + kLanes * v);
    for (int r = 0; r < MR; ++r) {
      const f32xN x = broadcast_lanes(a[r * a_row]);
      for (int v = 0; v < NV; ++v) acc[r][v] = fma_lanes(x, bd[v], acc[r][v]);
    }
    a += a_col;
    b += ldb;
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) {
      float* cv = c + r * ldc + kLanes * v;
      store_lanes(cv, (Store ? f32xN{} : load_lanes(cv)) + acc[r][v]);
    }
}

// Every run of k for one block of C, in order; with `Overwrite` the first one is stored.
template <int MR, int NV, bool Overwrite>
[[gnu::always_inline]] inline void gemm_block(const float* a, int64_t a_row, int64_t a_col, const float* b,
                                              int64_t ldb, float* c, int64_t ldc, int64_t k) {
  int64_t d0 = 0;
  if (Overwrite) {
    d0 = std::min(k, kGemmChunk);
    gemm_run<MR, NV, true>(a, a_row, a_col, b, ldb, c, ldc, d0);
  }
  for (; d0 < k; d0 += kGemmChunk)
    gemm_run<MR, NV, false>(a + d0 * a_col, a_row, a_col, b + d0 * ldb, ldb, c, ldc, std::min(kGemmChunk, k - d0));
}

// The rows and columns the blocks leave, one scalar lane per element, each summed as the blocks
// sum theirs.
void gemm_edge(const float* a, int64_t a_row, int64_t a_col, const float* b, int64_t ldb, float* c, int64_t ldc,
               int64_t m, int64_t n, int64_t k, bool overwrite) {
  for (int64_t r = 0; r < m; ++r) {
    const float* ar = a + r * a_row;
    for (int64_t j = 0; j < n; ++j) {
      float& cj = c[r * ldc + j];
      cj = add_chunked(overwrite ? 0.0f : cj, [ar, a_col](int64_t d) { return ar[d * a_col]; },
                       [bj = b + j, ldb](int64_t d) { return bj[d * ldb]; }, k);
    }
  }
}

// Rows [i, m) in blocks of MR rows, then of fewer: 16 columns per block, then 8, then the edge.
template <int MR, bool Overwrite>
[[gnu::always_inline]] inline void gemm_rows(const float* a, int64_t a_row, int64_t a_col, const float* b, int64_t ldb,
                                             float* c, int64_t ldc, int64_t i, int64_t m, int64_t n, int64_t k) {
  for (; i + MR <= m; i += MR) {
    const float* ai = a + i * a_row;
    float* ci = c + i * ldc;
    int64_t j = 0;
    for (; j + kGemmCols <= n; j += kGemmCols)
      gemm_block<MR, kGemmVecs, Overwrite>(ai, a_row, a_col, b + j, ldb, ci + j, ldc, k);
    if (kGemmVecs > 1 && j + kLanes <= n) {
      gemm_block<MR, 1, Overwrite>(ai, a_row, a_col, b + j, ldb, ci + j, ldc, k);
      j += kLanes;
    }
    if (j < n) gemm_edge(ai, a_row, a_col, b + j, ldb, ci + j, ldc, MR, n - j, k, Overwrite);
  }
  if constexpr (MR > 1) {
    constexpr int kNext = MR / 2;  // 4, 2, 1
    if (i < m) gemm_rows<kNext, Overwrite>(a, a_row, a_col, b, ldb, c, ldc, i, m, n, k);
  }
}

template <bool Overwrite>
[[gnu::always_inline]] inline void gemm_tiles(const float* a, int64_t a_row, int64_t a_col, const float* b,
                                              int64_t ldb, float* c, int64_t ldc, int64_t m, int64_t n, int64_t k) {
  if (k == 0) {
    if (Overwrite) gemm_edge(a, a_row, a_col, b, ldb, c, ldc, m, n, k, true);
    return;
  }
  gemm_rows<kGemmRows, Overwrite>(a, a_row, a_col, b, ldb, c, ldc, 0, m, n, k);
}

// Every call site reads A either along its rows (a_col = 1) or down its columns (a_row = 1):
// with that stride a constant, the block's addresses are one base plus fixed offsets.
template <bool Overwrite>
void gemm_strided(const float* a, int64_t a_row, int64_t a_col, const float* b, int64_t ldb, float* c, int64_t ldc,
                  int64_t m, int64_t n, int64_t k) {
  if (a_col == 1)
    gemm_tiles<Overwrite>(a, a_row, 1, b, ldb, c, ldc, m, n, k);
  else if (a_row == 1)
    gemm_tiles<Overwrite>(a, 1, a_col, b, ldb, c, ldc, m, n, k);
  else
    gemm_tiles<Overwrite>(a, a_row, a_col, b, ldb, c, ldc, m, n, k);
}

}  // namespace

void gemm_accumulate(const float* a, int64_t a_row, int64_t a_col, const float* b, int64_t ldb, float* c,
                     int64_t ldc, int64_t m, int64_t n, int64_t k) {
  gemm_strided<false>(a, a_row, a_col, b, ldb, c, ldc, m, n, k);
}

void gemm(const float* a, int64_t a_row, int64_t a_col, const float* b, int64_t ldb, float* c, int64_t ldc, int64_t m,
          int64_t n, int64_t k) {
  gemm_strided<true>(a, a_row, a_col, b, ldb, c, ldc, m, n, k);
}

}  // namespace tileattn::cpu
