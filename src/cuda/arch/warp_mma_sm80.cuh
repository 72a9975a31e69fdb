#pragma once
// Warp-level matrix products for the backward kernels, over tiles in shared memory.
//
// Every product works on the m16n8 accumulator fragment of mma.sync: lane l holds
// rows l/4 and l/4 + 8, columns 2*(l%4) and 2*(l%4) + 1 of each 16x8 tile, in fp32. The
// fp16/bf16 path runs m16n8k16 on tensor cores with ldmatrix feeding the operands; the fp32
// path runs on tensor cores too (mma_fp32.cuh): in fp64 (exact: every product exact, the call's
// sums in 53 bits, rounded to fp32 once) or as one TF32 product (the fp32 fast mode).
//
// Operand layouts in shared memory are given from the product's point of view:
//   A (m x k) is "row-major" when stored [m][k], "col-major" when stored [k][m];
//   B (k x n) is "row-major" when stored [k][n], "col-major" when stored [n][k].
// ldmatrix reads 8x8 blocks of 16-bit values; its .trans form serves the layouts in which the
// fragment's contiguous pair runs across the stored rows.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "cuda/arch/mma_fp32.cuh"
#include "cuda/arch/ptx_sm80.cuh"

namespace tileattn::cuda::bwd {

// How fp32 tiles multiply: on fp64 tensor cores (exact mode) or as one TF32 product (fast mode).
enum class Fp32Math { fp64, tf32 };

// Conversions, cp.async, ldmatrix, mma.sync and exp2 come from cuda/common/ptx.cuh.

// Two adjacent values (a at the lower address).
template <class T>
__device__ __forceinline__ void store2(T* p, float a, float b) {
  if constexpr (std::is_same_v<T, __half>) {
    *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b);  // one paired conversion
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
  } else {
    *reinterpret_cast<float2*>(p) = make_float2(a, b);
  }
}

template <int MT, int NT>
__device__ __forceinline__ void zero(float (&acc)[MT][NT][4]) {
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
}

// dst = src, element by element, converted.
template <class To, class From, int MT, int NT>
__device__ __forceinline__ void convert(To (&dst)[MT][NT][4], const From (&src)[MT][NT][4]) {
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) dst[i][j][e] = To(src[i][j][e]);
}

// acc (16*MT x 8*NT) += A (16*MT x K) * B (K x 8*NT). A and B point at the warp's first
// row/column; lda/ldb are the stored row lengths in elements. For 16-bit types NT is even (B is
// read 16 columns at a time). fp32 (K a multiple of 8) multiplies as kMath says.
template <class T, int MT, int NT, int K, bool ARowMajor, bool BRowMajor, Fp32Math kMath = Fp32Math::fp64>
__device__ __forceinline__ void warp_gemm(float (&acc)[MT][NT][4], const T* A, int lda, const T* B, int ldb) {
  const int lane = threadIdx.x & 31;
  if constexpr (sizeof(T) == 2) {
    static_assert(K % 16 == 0 && NT % 2 == 0, "tensor-core warp tiles are whole 16x16 steps");
    const int r = lane & 7, q = lane >> 3;
    // Per-lane offsets of the 8x8 blocks each ldmatrix.x4 gathers (see the file comment).
    const int a_off = ARowMajor ? (lane & 15) * lda + (lane >> 4) * 8 : (r + (q >> 1) * 8) * lda + (q & 1) * 8;
    const int b_off = BRowMajor ? (r + (q & 1) * 8) * ldb + (q >> 1) * 8 : (r + (q >> 1) * 8) * ldb + (q & 1) * 8;
#pragma unroll
    for (int ks = 0; ks < K / 16; ++ks) {
      uint32_t a[MT][4];
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        const T* pa = ARowMajor ? A + i * 16 * lda + ks * 16 : A + ks * 16 * lda + i * 16;
        if constexpr (ARowMajor)
          ldmatrix_x4(a[i], smem_address(pa + a_off));
        else
          ldmatrix_x4_trans(a[i], smem_address(pa + a_off));
      }
#pragma unroll
      for (int j = 0; j < NT / 2; ++j) {
        uint32_t b[4];
        const T* pb = BRowMajor ? B + ks * 16 * ldb + j * 16 : B + j * 16 * ldb + ks * 16;
        if constexpr (BRowMajor)
          ldmatrix_x4_trans(b, smem_address(pb + b_off));
        else
          ldmatrix_x4(b, smem_address(pb + b_off));
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          mma_m16n8k16<T>(acc[i][2 * j], a[i], b[0], b[1]);
          mma_m16n8k16<T>(acc[i][2 * j + 1], a[i], b[2], b[3]);
        }
      }
    }
  } else {
    static_assert(K % 8 == 0, "fp32 tensor-core warp tiles are whole 8-wide steps");
    // Fragments in mma_fp32.cuh's layout: the lane's two k values of a step are 2t and 2t + 1,
    // adjacent in memory, so [m][k] and [n][k] operands load as one float2.
    const int g = lane >> 2, t2 = (lane & 3) * 2;
    auto load_a = [&](int i, int k0, float (&a)[4]) {
      const int m = i * 16 + g;
      if constexpr (ARowMajor) {
        const float2 x0 = *reinterpret_cast<const float2*>(A + m * lda + k0 + t2);
        const float2 x1 = *reinterpret_cast<const float2*>(A + (m + 8) * lda + k0 + t2);
        a[0] = x0.x, a[1] = x1.x, a[2] = x0.y, a[3] = x1.y;
      } else {
        const T* col = A + (k0 + t2) * lda + m;
        a[0] = col[0], a[1] = col[8], a[2] = col[lda], a[3] = col[lda + 8];
      }
    };
    auto load_b = [&](int j, int k0, float (&b)[2]) {
      const int n = j * 8 + g;
      if constexpr (BRowMajor) {
        b[0] = B[(k0 + t2) * ldb + n], b[1] = B[(k0 + t2 + 1) * ldb + n];
      } else {
        const float2 x = *reinterpret_cast<const float2*>(B + n * ldb + k0 + t2);
        b[0] = x.x, b[1] = x.y;
      }
    };
    if constexpr (kMath == Fp32Math::tf32) {
      // The tensor core reads the top 19 bits of each fp32 operand (truncation to TF32).
#pragma unroll
      for (int k0 = 0; k0 < K; k0 += 8) {
        float a[MT][4], b[NT][2];
#pragma unroll
        for (int i = 0; i < MT; ++i) load_a(i, k0, a[i]);
#pragma unroll
        for (int j = 0; j < NT; ++j) load_b(j, k0, b[j]);
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            const uint32_t au[4] = {__float_as_uint(a[i][0]), __float_as_uint(a[i][1]), __float_as_uint(a[i][2]),
                                    __float_as_uint(a[i][3])};
            const uint32_t bu[2] = {__float_as_uint(b[j][0]), __float_as_uint(b[j][1])};
            fp32::mma_16x8x8_tf32(acc[i][j], au, bu);
          }
      }
    } else {
      // Each fp32 product is exact in fp64 and the call's sum keeps 53 bits: one rounding per call.
      double wide[MT][NT][4];
      convert(wide, acc);
#pragma unroll 2
      for (int k0 = 0; k0 < K; k0 += 8) {
        float a[MT][4], b[NT][2];
#pragma unroll
        for (int i = 0; i < MT; ++i) load_a(i, k0, a[i]);
#pragma unroll
        for (int j = 0; j < NT; ++j) load_b(j, k0, b[j]);
        double ad[MT][4], bd[NT][2];
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) ad[i][e] = a[i][e];
#pragma unroll
        for (int j = 0; j < NT; ++j) bd[j][0] = b[j][0], bd[j][1] = b[j][1];
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
          for (int j = 0; j < NT; ++j) fp32::mma_16x8x8_f64(wide[i][j], ad[i], bd[j]);
      }
      convert(acc, wide);
    }
  }
}

}  // namespace tileattn::cuda::bwd
