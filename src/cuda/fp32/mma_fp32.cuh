#pragma once
// TF32 tensor-core products for fp32 inputs (sm_80+): mma.sync m16n8k8 with fp32 accumulation.
//
// exact mode splits each operand x into hi = tf32(x) and lo = tf32(x - hi) (22 of fp32's 24
// mantissa bits) and sums lo*hi + hi*lo + hi*hi; the dropped lo*lo term is below 2^-22 of the
// product, so a dot product carries about the error of a plain fp32 FMA loop. fast mode keeps
// hi*hi only (about 2^-11 relative per operand).
//
// Fragment layout used throughout (g = lane / 4, t = lane % 4). The k index inside an 8-wide
// step is permuted so that a lane's two k values are adjacent in memory (one 64-bit load) and
// coincide with the column pair the accumulator holds:
//   A (16 x 8):  a[0] = (row g, k 2t)  a[1] = (row g+8, k 2t)  a[2] = (row g, k 2t+1)  a[3] = (row g+8, k 2t+1)
//   B (8 x 8):   b[0] = (k 2t, col g)  b[1] = (k 2t+1, col g)
//   C (16 x 8):  c[0] = (g, 2t)  c[1] = (g, 2t+1)  c[2] = (g+8, 2t)  c[3] = (g+8, 2t+1)
// A C tile is therefore an A fragment of the next product without any lane exchange.
#include <cstdint>

namespace tileattn::cuda::fp32 {

__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

template <int N>
struct Tf32Frag {
  uint32_t hi[N];
  uint32_t lo[N];  // unused (and optimised away) in fast mode
};

template <bool kExact, int N>
__device__ __forceinline__ Tf32Frag<N> split(const float (&x)[N]) {
  Tf32Frag<N> f;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    f.hi[i] = to_tf32(x[i]);
    f.lo[i] = kExact ? to_tf32(x[i] - __uint_as_float(f.hi[i])) : 0u;
  }
  return f;
}

__device__ __forceinline__ void mma_m16n8k8_tf32(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// c += a * b in the precision of the mode.
template <bool kExact>
__device__ __forceinline__ void mma_fp32(float (&c)[4], const Tf32Frag<4>& a, const Tf32Frag<2>& b) {
  if constexpr (kExact) {
    mma_m16n8k8_tf32(c, a.lo, b.hi);
    mma_m16n8k8_tf32(c, a.hi, b.lo);
  }
  mma_m16n8k8_tf32(c, a.hi, b.hi);
}

}  // namespace tileattn::cuda::fp32
