#pragma once
// Which instance of the tile products (tile_ops.hpp's gemm and gemm_accumulate) a process runs:
// the build target's lanes, or AVX-512's where the CPU has it (gemm_avx512.cpp; the default there,
// TILEATTN_CPU_KERNELS=target keeps the build target's). Both give the same bits
// (tile_products.hpp's rounding), so results do not depend on the CPU. Declarations only: the
// AVX-512 file includes this, and nothing compiled for the build target may be compiled there.
#include <cstdint>

namespace tileattn::cpu {

enum class GemmKernels { target, avx512 };

GemmKernels gemm_kernels();
// Switches the instance for the process, for tests and comparisons; returns false, changing
// nothing, where AVX-512 is asked of a build or CPU without it.
bool use_gemm_kernels(GemmKernels kernels);

// True where this build has the AVX-512 instance and the CPU (and its OS) runs it.
bool avx512_products_available();

// gemm (overwrite) or gemm_accumulate on 16-lane registers; only where available.
void avx512_product(bool overwrite, const float* a, int64_t a_row, int64_t a_col, const float* b, int64_t ldb,
                    float* c, int64_t ldc, int64_t m, int64_t n, int64_t k);

}  // namespace tileattn::cpu
