#pragma once
// A register array reduced as a balanced tree: log2(n) dependent steps instead of n - 1, so that
// a row's sum or max does not wait out a chain of dependent adds after its last element lands.

namespace tileattn::cuda {

// v[0] op v[1] op ... ; the order differs from a left fold (for sums, the rounding too).
template <int kN, class Op>
__device__ __forceinline__ float tree_reduce(const float (&v)[kN], Op op) {
  static_assert(kN >= 1, "tree_reduce: at least one value");
  if constexpr (kN == 1) {
    return v[0];
  } else {
    constexpr int kHalf = (kN + 1) / 2;
    float half[kHalf];
#pragma unroll
    for (int j = 0; j < kHalf; ++j) half[j] = j + kHalf < kN ? op(v[j], v[j + kHalf]) : v[j];
    return tree_reduce(half, op);
  }
}

}  // namespace tileattn::cuda
