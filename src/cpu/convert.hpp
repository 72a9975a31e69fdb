#pragma once
// fp16 / bf16 <-> fp32 on the host, bit-exact with the hardware conversions: round to nearest
// even, overflow to inf, subnormals kept, NaN stays NaN (quiet). Used by the CPU backend and by
// the tests, so both see the same rounded values.
#include <algorithm>
#include <bit>
#include <cstdint>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "tileattn/problem.hpp"

namespace tileattn::cpu {

inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    const float v = float(mant) * 0x1p-24f;  // exact: mant < 2^10
    return sign ? -v : v;
  }
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t float_to_half(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return sign | 0x7e00u;  // NaN
  if (ax >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 (halfway past 65504) rounds to inf
  if (ax >= 0x38800000u) {                       // normal in fp16: >= 2^-14
    // Rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest even; a carry
    // out of the mantissa correctly bumps the exponent.
    const uint32_t rounded = ax + 0xfffu + ((ax >> 13) & 1u);
    return sign | uint16_t((rounded - 0x38000000u) >> 13);
  }
  if (ax <= 0x33000000u) return sign;  // <= 2^-25: rounds to zero (the tie goes to even 0)
  // Subnormal result: value / 2^-24 with the implicit bit restored, rounded to nearest even.
  const uint32_t e = ax >> 23;
  const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - e;  // 14..24
  uint32_t r = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t halfway = 1u << (shift - 1u);
  if (rem > halfway || (rem == halfway && (r & 1u))) ++r;  // r == 0x400 is the smallest normal
  return sign | uint16_t(r);
}

inline float bf16_to_float(uint16_t b) { return std::bit_cast<float>(uint32_t(b) << 16); }

inline uint16_t float_to_bf16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40u);  // NaN, quieted
  return uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);  // overflow carries into inf
}

// Element `index` of an array of `dtype`, widened to fp32 (exact for every dtype).
inline float load_element(const void* base, int64_t index, DType dtype) {
  switch (dtype) {
    case DType::f32: return static_cast<const float*>(base)[index];
    case DType::f16: return half_to_float(static_cast<const uint16_t*>(base)[index]);
    case DType::bf16: return bf16_to_float(static_cast<const uint16_t*>(base)[index]);
  }
  return 0.0f;
}

// Elements [index, index + n) of an array of `dtype`, widened into out: load_element's values, in
// loops free of the dtype switch, so that the bf16 one vectorises (a shift per element).
inline void load_elements(const void* base, int64_t index, DType dtype, int64_t n, float* out) {
  switch (dtype) {
    case DType::f32: {
      const float* in = static_cast<const float*>(base) + index;
      std::copy(in, in + n, out);
      return;
    }
    case DType::f16: {
      const uint16_t* in = static_cast<const uint16_t*>(base) + index;
      int64_t i = 0;
#if defined(__F16C__)
      // The hardware conversion is exact, as half_to_float is, for every value but a signalling
      // NaN's payload (which it quiets): half_to_float's branches kept this loop scalar.
      for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
#endif
      for (; i < n; ++i) out[i] = half_to_float(in[i]);
      return;
    }
    case DType::bf16: {
      const uint16_t* in = static_cast<const uint16_t*>(base) + index;
      for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(in[i]);
      return;
    }
  }
}

// Stores fp32 `value` into element `index`, rounded to nearest even for fp16/bf16.
inline void store_element(void* base, int64_t index, DType dtype, float value) {
  switch (dtype) {
    case DType::f32: static_cast<float*>(base)[index] = value; break;
    case DType::f16: static_cast<uint16_t*>(base)[index] = float_to_half(value); break;
    case DType::bf16: static_cast<uint16_t*>(base)[index] = float_to_bf16(value); break;
  }
}

inline int64_t dtype_size(DType dtype) { return dtype == DType::f32 ? 4 : 2; }

}  // namespace tileattn::cpu
