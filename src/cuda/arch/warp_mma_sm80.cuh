#pragma once
// Warp-level matrix products for the backward kernels, over tiles in shared memory.
//
// Every product works on the m16n8 accumulator fragment of mma.sync: lane l holds
// rows l/4 and l/4 + 8, columns 2*(l%4) and 2*(l%4) + 1 of each 16x8 tile, in fp32. The
// fp16/bf16 path runs m16n8k16 on tensor cores with ldmatrix feeding the operands; the fp32
// path computes the same fragments with scalar FMA so that its products stay exact fp32.
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

#include "cuda/arch/ptx_sm80.cuh"

namespace tileattn::cuda::bwd {

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
// read 16 columns at a time). kWideSum (fp32 only): runs of 8 products are summed in fp32 and
// the runs in double, for the products whose rounding does not cancel downstream (S and dP of
// the fp32 backward, see the callers).
template <class T, int MT, int NT, int K, bool ARowMajor, bool BRowMajor, bool kWideSum = false>
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
    const int row = lane >> 2, col = (lane & 3) * 2;
    auto step = [&](int k, auto& sum) {  // sum += column k of A times row k of B (fp32 or double)
      using S = std::remove_reference_t<decltype(sum[0][0][0])>;
      float a[MT][2], b[NT][2];
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int m = i * 16 + row + h * 8;
          a[i][h] = ARowMajor ? A[m * lda + k] : A[k * lda + m];
        }
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int n = j * 8 + col + h;
          b[j][h] = BRowMajor ? B[k * ldb + n] : B[n * ldb + k];
        }
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          sum[i][j][0] = fma(S(a[i][0]), S(b[j][0]), sum[i][j][0]);
          sum[i][j][1] = fma(S(a[i][0]), S(b[j][1]), sum[i][j][1]);
          sum[i][j][2] = fma(S(a[i][1]), S(b[j][0]), sum[i][j][2]);
          sum[i][j][3] = fma(S(a[i][1]), S(b[j][1]), sum[i][j][3]);
        }
    };
    if constexpr (!kWideSum) {
#pragma unroll 4
      for (int k = 0; k < K; ++k) step(k, acc);
    } else {
      // Short fp32 runs keep their partial sums small; one conversion and one double add per
      // 8 fused multiply-adds. H100 (docs/perf.md): with S and dP summed so, 30 repeats of the
      // fp32 backward tests stayed within 0.74 of the 2x bound; the fp32 backward (B2 H8 N4k
      // d128 causal) took 12.2 ms against 10.7 with plain fp32 sums and 18.7 with whole double
      // sums of S and dP.
      static_assert(K % 8 == 0, "warp_gemm: wide sums take runs of 8 products");
      double wide[MT][NT][4];
      convert(wide, acc);
#pragma unroll 1
      for (int k0 = 0; k0 < K; k0 += 8) {
        float run[MT][NT][4];
        zero(run);
#pragma unroll
        for (int k = k0; k < k0 + 8; ++k) step(k, run);
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
          for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) wide[i][j][e] += double(run[i][j][e]);
      }
      convert(acc, wide);
    }
  }
}

}  // namespace tileattn::cuda::bwd
