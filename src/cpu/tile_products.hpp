#pragma once
// The register-blocked tile products (tile_ops.hpp's gemm and gemm_accumulate), written once over
// a SIMD width: gemm.cpp instantiates them for the build's target, gemm_avx512.cpp for AVX-512,
// and gemm.cpp picks one per process (gemm_kernels.hpp). Each instantiating file passes a lane
// type of its own in an anonymous namespace, so every instantiation has internal linkage: the two
// objects, compiled for different instruction sets, share no out-of-line function the linker
// could merge (an AVX-512 copy taken for the build target's callers would fault on a CPU without
// it). For the same reason this header calls nothing of the backend's and includes only <cstdint>.
//
// A lane type V provides: `vec`, `kLanes`, `kRows` and `kVecs` (the register block: kRows rows of
// kVecs vectors), `zero()`, `load(p)`, `store(p, v)`, `broadcast(x)`, `fma(a, b, c)` (one
// rounding), `add(a, b)`, and `kMaskedTail`: with it, `load_first(p, n)` (zeros past n) and
// `store_first(p, v, n)` take a last strip of fewer than kLanes columns; without it the caller's
// scalar `edge` does.
//
// Rounding (tile_ops.hpp): every element of C sums its k terms in runs of kGemmChunk, each run
// from zero by fma in order, and adds the runs into C in order; so a lane of any width and the
// scalar edge give the same bits, and so do the two instruction sets.
#include <cstdint>

namespace tileattn::cpu::tile_products {

constexpr int64_t kChunk = 16;  // tile_ops.hpp's kGemmChunk (static_assert in gemm.cpp)

template <class V>
struct Kernels {
  using vec = typename V::vec;

  // One run of `terms` (<= kChunk) terms into an MR x (kLanes * NV) block of C; with Tail, the last
  // vector holds `tail` < kLanes columns. Register blocking: the block's partial sums stay in
  // registers for the whole run, and each B row is loaded once per MR rows. The run's sum is added
  // into C, or with `Store` stored as sum + 0, the value adding it to a zeroed C gives, without
  // reading C. A's element (r, d) is a[r * a_row + d * a_col]; the pointers step by one term at a
  // time rather than the loop being unrolled over the whole run: unrolled, every term's address
  // was a register of its own and GCC spilled them (a 64 x 64 x 64 product went from ~76 to ~83
  // GFLOP/s on one Zen 3 core with the partial unroll).
  template <int MR, int NV, bool Store, bool Tail>
  [[gnu::always_inline]] static inline void run(const float* a, int64_t a_row, int64_t a_col, const float* b,
                                                int64_t ldb, float* c, int64_t ldc, int64_t terms, int tail) {
    vec acc[MR][NV];
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v) acc[r][v] = V::zero();
#pragma GCC unroll 4
    for (int64_t d = 0; d < terms; ++d) {
      vec bd[NV];
      for (int v = 0; v < NV; ++v)
        bd[v] = Tail && v == NV - 1 ? load_part(b + V::kLanes * v, tail) : V::load(b + V::kLanes * v);
      for (int r = 0; r < MR; ++r) {
        const vec x = V::broadcast(a[r * a_row]);
        for (int v = 0; v < NV; ++v) acc[r][v] = V::fma(x, bd[v], acc[r][v]);
      }
      a += a_col;
      b += ldb;
    }
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v) {
        float* cv = c + r * ldc + V::kLanes * v;
        if (Tail && v == NV - 1) {
          store_part(cv, V::add(Store ? V::zero() : load_part(cv, tail), acc[r][v]), tail);
        } else {
          V::store(cv, V::add(Store ? V::zero() : V::load(cv), acc[r][v]));
        }
      }
  }

  // The first `count` lanes of a vector (zeros after), where V has masks; only tail strips use them.
  [[gnu::always_inline]] static inline vec load_part([[maybe_unused]] const float* p, [[maybe_unused]] int count) {
    if constexpr (V::kMaskedTail) return V::load_first(p, count);
    return V::zero();
  }
  [[gnu::always_inline]] static inline void store_part([[maybe_unused]] float* p, [[maybe_unused]] vec v,
                                                      [[maybe_unused]] int count) {
    if constexpr (V::kMaskedTail) V::store_first(p, v, count);
  }

  // Every run of k for one block of C, in order; with `Overwrite` the first one is stored.
  template <int MR, int NV, bool Overwrite, bool Tail>
  [[gnu::always_inline]] static inline void block(const float* a, int64_t a_row, int64_t a_col, const float* b,
                                                  int64_t ldb, float* c, int64_t ldc, int64_t k, int tail) {
    int64_t d0 = 0;
    if (Overwrite) {
      d0 = k < kChunk ? k : kChunk;
      run<MR, NV, true, Tail>(a, a_row, a_col, b, ldb, c, ldc, d0, tail);
    }
    for (; d0 < k; d0 += kChunk)
      run<MR, NV, false, Tail>(a + d0 * a_col, a_row, a_col, b + d0 * ldb, ldb, c, ldc,
                               k - d0 < kChunk ? k - d0 : kChunk, tail);
  }

  // One column strip of NV vectors, rows [i, m) in blocks of MR rows, then of fewer (halving).
  template <int MR, int NV, bool Overwrite, bool Tail>
  [[gnu::always_inline]] static inline void strip(const float* a, int64_t a_row, int64_t a_col, const float* b,
                                                  int64_t ldb, float* c, int64_t ldc, int64_t i, int64_t m, int64_t k,
                                                  int tail) {
    for (; i + MR <= m; i += MR)
      block<MR, NV, Overwrite, Tail>(a + i * a_row, a_row, a_col, b, ldb, c + i * ldc, ldc, k, tail);
    if constexpr (MR > 1) {
      if (i < m) strip<MR / 2, NV, Overwrite, Tail>(a, a_row, a_col, b, ldb, c, ldc, i, m, k, tail);
    }
  }

  // Column strips outermost: a strip of B (k x kVecs vectors) stays in L1 while every row block
  // passes over it, and A is read once per strip. Then strips of one vector, then the last
  // columns: masked where V has masks, else edge(j) for columns [j, n) of every row.
  template <bool Overwrite, class Edge>
  [[gnu::always_inline]] static inline void columns(const float* a, int64_t a_row, int64_t a_col, const float* b,
                                                    int64_t ldb, float* c, int64_t ldc, int64_t m, int64_t n,
                                                    int64_t k, Edge edge) {
    constexpr int kCols = V::kLanes * V::kVecs;
    int64_t j = 0;
    for (; j + kCols <= n; j += kCols)
      strip<V::kRows, V::kVecs, Overwrite, false>(a, a_row, a_col, b + j, ldb, c + j, ldc, 0, m, k, 0);
    for (; V::kVecs > 1 && j + V::kLanes <= n; j += V::kLanes)
      strip<V::kRows, 1, Overwrite, false>(a, a_row, a_col, b + j, ldb, c + j, ldc, 0, m, k, 0);
    if (j == n) return;
    if constexpr (V::kMaskedTail) {
      strip<V::kRows, 1, Overwrite, true>(a, a_row, a_col, b + j, ldb, c + j, ldc, 0, m, k, int(n - j));
    } else {
      edge(j);
    }
  }

  // Every call site reads A either along its rows (a_col = 1) or down its columns (a_row = 1):
  // with that stride a constant, the block's addresses are one base plus fixed offsets.
  template <bool Overwrite, class Edge>
  static void product(const float* a, int64_t a_row, int64_t a_col, const float* b, int64_t ldb, float* c,
                      int64_t ldc, int64_t m, int64_t n, int64_t k, Edge edge) {
    if (a_col == 1)
      columns<Overwrite>(a, a_row, 1, b, ldb, c, ldc, m, n, k, edge);
    else if (a_row == 1)
      columns<Overwrite>(a, 1, a_col, b, ldb, c, ldc, m, n, k, edge);
    else
      columns<Overwrite>(a, a_row, a_col, b, ldb, c, ldc, m, n, k, edge);
  }
};

}  // namespace tileattn::cpu::tile_products
