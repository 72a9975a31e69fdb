#pragma once
// Tensor-core products for fp32 inputs (sm_80+).
//
// exact mode multiplies in fp64 (DMMA): a product of two fp32 values is exact in fp64 and the
// sums keep 53 bits, so each 8-wide product tile is rounded to fp32 once, where a plain fp32
// loop rounds after every FMA. (Split TF32 with truncated halves, 3 products, keeps only 22 of
// the 24 mantissa bits per operand: it measured 3-5x the error of a naive fp32 loop. The Hopper
// exact kernels split with both halves rounded to nearest, split_tf32.)
// fast mode is one TF32 product (mma m16n8k8 .tf32): about 2^-11 relative per operand.
//
// Fragment layout used throughout (g = lane / 4, t = lane % 4). The k index inside an 8-wide
// step is permuted so that a lane's two k values are adjacent in memory (one 64-bit load) and
// coincide with the column pair the accumulator holds:
//   A (16 x 8):  a[0] = (row g, k 2t)  a[1] = (row g+8, k 2t)  a[2] = (row g, k 2t+1)  a[3] = (row g+8, k 2t+1)
//   B (8 x 8):   b[0] = (k 2t, col g)  b[1] = (k 2t+1, col g)
//   C (16 x 8):  c[0] = (g, 2t)  c[1] = (g, 2t+1)  c[2] = (g+8, 2t)  c[3] = (g+8, 2t+1)
// A C tile is therefore an A fragment of the next product without any lane exchange, and the
// fp64 shapes (k = 4, one k value t per lane) take the 2t half and the 2t+1 half in turn.
#include <cstdint>

namespace tileattn::cuda::fp32 {

__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

// x rounded to TF32 (ties away from zero) as fp32 bits, low 13 bits zero: what cvt.rna.tf32.f32
// computes, in two integer operations instead of its four (it also guards inf and NaN, which
// here may come out as inf or zero: every caller either forms the remainder x - hi, which then
// carries the NaN, or has the NaN in its row sum as well).
__device__ __forceinline__ uint32_t tf32_bits(float x) { return (__float_as_uint(x) + 0x1000u) & 0xffffe000u; }
__device__ __forceinline__ float tf32_rn(float x) { return __uint_as_float(tf32_bits(x)); }

// a / b rounded to nearest, as the divide gives it, from inv = 1 / b rounded to nearest: the
// product a inv is within an ulp of the quotient and one correction from its exact residual
// rounds it correctly (Markstein), in two FMAs and a multiply with no branch to a slow path.
// Outside the correction's range (a quotient that underflows, b near the largest float) it may
// miss by an ulp; the callers divide numerators of at most 1 by row sums of at least 1.
__device__ __forceinline__ float divide_by(float a, float b, float inv) {
  const float q = a * inv;
  return fmaf(fmaf(-b, q, a), inv, q);
}

// x = hi + rest for split TF32 products (a b ~ a_lo b_hi + a_hi b_lo + a_hi b_hi, with lo the
// rest rounded the same way): hi is x rounded to TF32, to nearest, and rest = x - hi exactly, so
// that hi + lo leaves about 2^-22 of x over, unbiased (the tensor core would truncate fp32 bits,
// which biases every product one way).
__device__ __forceinline__ void split_tf32(float x, float& hi, float& rest) {
  hi = tf32_rn(x);
  rest = x - hi;
}

// The same on the four values of a 16-byte chunk.
__device__ __forceinline__ float4 tf32_rn(float4 x) {
  return make_float4(tf32_rn(x.x), tf32_rn(x.y), tf32_rn(x.z), tf32_rn(x.w));
}
__device__ __forceinline__ void split_tf32(float4 x, float4& hi, float4& rest) {
  split_tf32(x.x, hi.x, rest.x), split_tf32(x.y, hi.y, rest.y);
  split_tf32(x.z, hi.z, rest.z), split_tf32(x.w, hi.w, rest.w);
}

// c += a * b, TF32 operands (as rounded by to_tf32), fp32 accumulation.
__device__ __forceinline__ void mma_16x8x8_tf32(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// c += a * b in fp64.
__device__ __forceinline__ void mma_16x8x8_f64(double (&c)[4], const double (&a)[4], const double (&b)[2]) {
#if __CUDA_ARCH__ >= 900
#pragma unroll
  for (int h = 0; h < 2; ++h)
    asm volatile(
        "mma.sync.aligned.m16n8k4.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
        : "+d"(c[0]), "+d"(c[1]), "+d"(c[2]), "+d"(c[3])
        : "d"(a[2 * h]), "d"(a[2 * h + 1]), "d"(b[h]));
#else
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int m = 0; m < 2; ++m)
      asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};\n"
                   : "+d"(c[2 * m]), "+d"(c[2 * m + 1])
                   : "d"(a[2 * h + m]), "d"(b[h]));
#endif
}

}  // namespace tileattn::cuda::fp32
