// The tile products on 16-lane AVX-512 registers: 32 of them hold a 4 x 64 block of C (16
// accumulators), so each B row is loaded once per four rows and each broadcast of A feeds four
// FMAs, against the 4 x 16 block AVX2's 16 registers allow. Compiled for AVX-512 on x86-64
// (CMakeLists.txt) whatever the backend's -march; gemm.cpp calls it only where the CPU has it.
// The last columns of a strip go through masked loads and stores, so no element takes a scalar
// lane. Same bits as the build target's kernels (tile_products.hpp's rounding).
#include "cpu/gemm_kernels.hpp"

#if defined(__x86_64__) && defined(__AVX512F__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include "cpu/tile_products.hpp"

namespace tileattn::cpu {
namespace {

struct Avx512Lanes {
  using vec = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kRows = 4;  // 4 rows of 4 vectors: the best block measured on Zen 4 (docs/perf-log.md)
  static constexpr int kVecs = 4;
  static constexpr bool kMaskedTail = true;
  static vec zero() { return _mm512_setzero_ps(); }
  static vec load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, vec v) { _mm512_storeu_ps(p, v); }
  static vec broadcast(float x) { return _mm512_set1_ps(x); }
  static vec fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
  static vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
  static __mmask16 first(int n) { return __mmask16((1u << n) - 1u); }
  static vec load_first(const float* p, int n) { return _mm512_maskz_loadu_ps(first(n), p); }
  static void store_first(float* p, vec v, int n) { _mm512_mask_storeu_ps(p, first(n), v); }
};

using Kernels = tile_products::Kernels<Avx512Lanes>;
constexpr auto kNoEdge = [](int64_t) {};  // masked tails leave no columns

}  // namespace

bool avx512_products_available() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}

void avx512_product(bool overwrite, const float* a, int64_t a_row, int64_t a_col, const float* b, int64_t ldb,
                    float* c, int64_t ldc, int64_t m, int64_t n, int64_t k) {
  if (overwrite)
    Kernels::product<true>(a, a_row, a_col, b, ldb, c, ldc, m, n, k, kNoEdge);
  else
    Kernels::product<false>(a, a_row, a_col, b, ldb, c, ldc, m, n, k, kNoEdge);
}

}  // namespace tileattn::cpu

#else  // not built for AVX-512: gemm.cpp never calls the product

namespace tileattn::cpu {
bool avx512_products_available() { return false; }
void avx512_product(bool, const float*, int64_t, int64_t, const float*, int64_t, float*, int64_t, int64_t, int64_t,
                    int64_t) {}
}  // namespace tileattn::cpu

#endif
