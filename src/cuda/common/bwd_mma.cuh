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

namespace tileattn::cuda::bwd {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- conversions -----------------------------------------------------------------------
template <class T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

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

// 2^x by the special-function unit (about 2 ulp; 2^-inf = 0). Enough for P rounded to 16 bits.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ---- asynchronous copies ---------------------------------------------------------------
// 16 bytes global -> shared; `valid == false` zero-fills the destination without reading.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---- tensor-core primitives ------------------------------------------------------------
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

template <class T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
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

// acc (16*MT x 8*NT) += A (16*MT x K) * B (K x 8*NT). A and B point at the warp's first
// row/column; lda/ldb are the stored row lengths in elements. For 16-bit types NT is even (B is
// read 16 columns at a time).
template <class T, int MT, int NT, int K, bool ARowMajor, bool BRowMajor>
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
          ldmatrix_x4(a[i], pa + a_off);
        else
          ldmatrix_x4_trans(a[i], pa + a_off);
      }
#pragma unroll
      for (int j = 0; j < NT / 2; ++j) {
        uint32_t b[4];
        const T* pb = BRowMajor ? B + ks * 16 * ldb + j * 16 : B + j * 16 * ldb + ks * 16;
        if constexpr (BRowMajor)
          ldmatrix_x4_trans(b, pb + b_off);
        else
          ldmatrix_x4(b, pb + b_off);
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          mma_16816<T>(acc[i][2 * j], a[i], b[0], b[1]);
          mma_16816<T>(acc[i][2 * j + 1], a[i], b[2], b[3]);
        }
      }
    }
  } else {
    const int row = lane >> 2, col = (lane & 3) * 2;
#pragma unroll 4
    for (int k = 0; k < K; ++k) {
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
          acc[i][j][0] = fmaf(a[i][0], b[j][0], acc[i][j][0]);
          acc[i][j][1] = fmaf(a[i][0], b[j][1], acc[i][j][1]);
          acc[i][j][2] = fmaf(a[i][1], b[j][0], acc[i][j][2]);
          acc[i][j][3] = fmaf(a[i][1], b[j][1], acc[i][j][3]);
        }
    }
  }
}

}  // namespace tileattn::cuda::bwd
