// The tile products of the CPU backend (declared in tile_ops.hpp).
//
// They live in their own translation unit on purpose: inlined into the forward's tile loop, GCC
// allocated the register block differently at each call site and the same kernel ran anywhere
// from ~30 to ~85 GFLOP/s on one AVX2 core (Zen 3, 64 x 64 x 64 tiles); out of line, every
// caller gets the fast one, and a call costs nothing next to a tile.
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "cpu/gemm_kernels.hpp"
#include "cpu/tile_products.hpp"
#include "cpu/tile_ops.hpp"

namespace tileattn::cpu {
namespace {

static_assert(tile_products::kChunk == kGemmChunk);

// The build target's lanes. Register block, measured best: AVX2 4 x 16 (6 x 16 ran ~5% slower on
// Zen 3, with the block's six row addresses and a 4-row edge for 64-row tiles), SSE 2 x 16.
struct TargetLanes {
  using vec = f32xN;
  static constexpr int kLanes = cpu::kLanes;
  static constexpr int kRows = kLanes == 8 ? 4 : 2;
  static constexpr int kVecs = 16 / kLanes;
  static constexpr bool kMaskedTail = false;
  static vec zero() { return f32xN{}; }
  static vec load(const float* p) { return load_lanes(p); }
  static void store(float* p, vec v) { store_lanes(p, v); }
  static vec broadcast(float x) { return broadcast_lanes(x); }
  static vec fma(vec a, vec b, vec c) { return fma_lanes(a, b, c); }
  static vec add(vec a, vec b) { return a + b; }
};

// The columns the vector strips leave, one scalar lane per element, each summed as a lane sums its.
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

template <bool Overwrite>
void target_product(const float* a, int64_t a_row, int64_t a_col, const float* b, int64_t ldb, float* c, int64_t ldc,
                    int64_t m, int64_t n, int64_t k) {
  tile_products::Kernels<TargetLanes>::product<Overwrite>(a, a_row, a_col, b, ldb, c, ldc, m, n, k, [&](int64_t j) {
    gemm_edge(a, a_row, a_col, b + j, ldb, c + j, ldc, m, n - j, k, Overwrite);
  });
}

// AVX-512 where the CPU has it, unless TILEATTN_CPU_KERNELS=target asks for the build target's.
GemmKernels initial_kernels() {
  const char* forced = std::getenv("TILEATTN_CPU_KERNELS");
  const bool target_only = forced && std::strcmp(forced, "target") == 0;
  return !target_only && avx512_products_available() ? GemmKernels::avx512 : GemmKernels::target;
}
std::atomic<GemmKernels>& kernels_in_use() {
  static std::atomic<GemmKernels> kernels{initial_kernels()};
  return kernels;
}

}  // namespace

GemmKernels gemm_kernels() { return kernels_in_use().load(std::memory_order_relaxed); }

bool use_gemm_kernels(GemmKernels kernels) {
  if (kernels == GemmKernels::avx512 && !avx512_products_available()) return false;
  kernels_in_use().store(kernels, std::memory_order_relaxed);
  return true;
}

void gemm_accumulate(const float* a, int64_t a_row, int64_t a_col, const float* b, int64_t ldb, float* c,
                     int64_t ldc, int64_t m, int64_t n, int64_t k) {
  if (gemm_kernels() == GemmKernels::avx512) return avx512_product(false, a, a_row, a_col, b, ldb, c, ldc, m, n, k);
  target_product<false>(a, a_row, a_col, b, ldb, c, ldc, m, n, k);
}

void gemm(const float* a, int64_t a_row, int64_t a_col, const float* b, int64_t ldb, float* c, int64_t ldc, int64_t m,
          int64_t n, int64_t k) {
  if (gemm_kernels() == GemmKernels::avx512) return avx512_product(true, a, a_row, a_col, b, ldb, c, ldc, m, n, k);
  target_product<true>(a, a_row, a_col, b, ldb, c, ldc, m, n, k);
}

}  // namespace tileattn::cpu
