#pragma once
// Head-dim buckets: a kernel family is compiled for a short list of head dims, and a problem runs
// on the smallest bucket that holds both of its head dims (Q/K and V are padded to it with zeros).
// Which buckets this build has, per family, is generated once by src/cuda/CMakeLists.txt from
// TILEATTN_HEADDIMS into "cuda/head_dims_built.hpp"; every dispatcher selects through
// `with_bucket` below, so there is one selection idiom and one list.
#include <type_traits>

namespace tileattn::cuda {

template <int... Ds>
struct HeadDims {
  static constexpr int count = sizeof...(Ds);
};

// Calls f(std::integral_constant<int, D>{}) for the smallest D in the list with headdim <= D and
// returns true; returns false (calling nothing) when no bucket holds headdim. The lists are
// ascending, so the first match is the smallest.
template <int... Ds, class F>
bool with_bucket(HeadDims<Ds...>, int headdim, F&& f) {
  return ((headdim <= Ds && (f(std::integral_constant<int, Ds>{}), true)) || ...);
}

// The bucket with_bucket would pick, or 0.
template <int... Ds>
constexpr int bucket_of(HeadDims<Ds...>, int headdim) {
  int found = 0;
  ((found == 0 && headdim <= Ds ? (found = Ds) : 0), ...);
  return found;
}

}  // namespace tileattn::cuda
