#pragma once
// Building blocks of the tiled CPU attention: tile geometry, loading strided fp32/fp16/bf16 rows
// into dense fp32 tiles (one conversion per element per tile), and the few fp32 loops the
// forward and backward are written in. Every loop's innermost dimension is contiguous and
// free of reductions, so the compiler vectorises it without reassociating floating point.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "common/key_rows.hpp"
#include "common/mask.hpp"
#include "common/online_softmax.hpp"
#include "common/philox.hpp"
#include "common/score_mod.hpp"
#include "cpu/convert.hpp"
#include "tileattn/problem.hpp"

namespace tileattn::cpu {

// Query rows and key columns per tile. 64 x 64 keeps a head-dim-256 working set (Q, K^T, V,
// accumulator, scores: ~270 KiB) inside a typical per-core L2.
constexpr int64_t kTileQ = 64;
constexpr int64_t kTileK = 64;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Where the rows of one sequence live, and its mask. Query rows of sequence b start at
// b * batch_stride (fixed length) or at cu_seqlens_q[b] * seq_stride (varlen); key rows are
// wherever its KeySpan says (a packed range, part of a cache row, or pages).
struct Sequence {
  int64_t len_q = 0, len_k = 0;
  int64_t row0_q = 0;  // first query row in the dense (rows, heads) numbering (varlen token)
  int64_t b = 0;
  KeyLayout keys;
  KeySpan key;
  Mask mask;
};

inline Sequence sequence(const AttentionProblem& p, int64_t b) {
  Sequence s;
  s.b = b;
  s.keys = key_layout(p);
  s.key = key_span(s.keys, int(b));
  s.len_k = s.key.len;
  if (p.is_varlen()) {
    s.row0_q = p.cu_seqlens_q[b];
    s.len_q = p.cu_seqlens_q[b + 1] - s.row0_q;
  } else {
    s.row0_q = b * p.seqlen_q;
    s.len_q = p.seqlen_q;
  }
  // A window side wider than both sequences masks nothing; clamping keeps Mask's int math exact.
  const int64_t reach = s.len_q + s.len_k;
  s.mask = Mask{int(s.len_q), int(s.len_k), int(std::min(p.window_left, reach)),
                int(p.causal ? 0 : std::min(p.window_right, reach))};
  return s;
}

// The longest sequence: tile counts per (batch, head) are sized by it.
inline void max_lengths(const AttentionProblem& p, int64_t& max_q, int64_t& max_k) {
  max_q = max_k = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    const Sequence s = sequence(p, b);
    max_q = std::max(max_q, s.len_q);
    max_k = std::max(max_k, s.len_k);
  }
}

// Element offset of (row i of sequence s, head h) in tensor t.
inline int64_t row_offset(const AttentionProblem& p, const TensorView& t, const Sequence& s, bool query_side,
                          int64_t i, int64_t h) {
  if (!query_side) return key_offset(s.keys, s.key, int(i), t.batch_stride, t.seq_stride) + h * t.head_stride;
  const int64_t row = p.is_varlen() ? s.row0_q * t.seq_stride : s.b * t.batch_stride;
  return row + i * t.seq_stride + h * t.head_stride;
}

// Index of L (and of the backward's D) for row i of sequence s, head h.
inline int64_t lse_index(const AttentionProblem& p, const Sequence& s, int64_t i, int64_t h) {
  if (p.is_varlen()) return h * p.total_q + s.row0_q + i;
  return (s.b * p.heads_q + h) * p.seqlen_q + i;
}

// dst[r * ld + d] = src row r (rows i0.., head h), widened to fp32.
inline void load_rows(const AttentionProblem& p, const TensorView& t, const Sequence& s, bool query_side, int64_t h,
                      int64_t i0, int64_t rows, int64_t dim, float* dst, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t base = row_offset(p, t, s, query_side, i0 + r, h);
    float* out = dst + r * ld;
    if (p.dtype == DType::f32) {
      const float* in = static_cast<const float*>(t.data) + base;
      std::copy(in, in + dim, out);
    } else {
      load_elements(t.data, base, p.dtype, dim, out);
    }
  }
}

// Rows i0.. of head h as an fp32 row-major operand: fp32 tensors whose rows are dense (row
// stride = dim, as in SDPA's (B, H, N, D) layout) are read in place; other dtypes, and rows
// strided apart, are copied into `scratch` (ld = dim). Rows heads * dim apart (flash-attn's
// (B, N, H, D) layout) often lie a multiple of 4 KiB apart, so the tile's rows share a few L1
// sets: read in place, P V ran at ~25 GFLOP/s against ~75 from a dense copy (one AVX2 core).
struct RowsView {
  const float* data;
  int64_t ld;
};
// Paged keys are not one strided block: they are copied like other dtypes.
inline bool rows_in_place(const AttentionProblem& p, const TensorView& t, bool query_side, int64_t dim) {
  return p.dtype == DType::f32 && t.seq_stride == dim && (query_side || !p.is_paged());
}
inline RowsView view_rows(const AttentionProblem& p, const TensorView& t, const Sequence& s, bool query_side,
                          int64_t h, int64_t i0, int64_t rows, int64_t dim, float* scratch) {
  if (rows_in_place(p, t, query_side, dim))
    return {static_cast<const float*>(t.data) + row_offset(p, t, s, query_side, i0, h), t.seq_stride};
  load_rows(p, t, s, query_side, h, i0, rows, dim, scratch, dim);
  return {scratch, dim};
}

// Elements [index, index + n) of an array of `dtype`, widened into dst[0], dst[stride], ...: a
// row into a column; fp32 element by element, other dtypes through load_elements (a vector loop)
// a chunk at a time.
inline void load_elements_strided(const void* base, int64_t index, DType dtype, int64_t n, float* dst,
                                  int64_t stride) {
  if (dtype == DType::f32) {  // straight from the row: the chunk copy was an inlined `rep movsq`, slow to start
    const float* in = static_cast<const float*>(base) + index;
    for (int64_t i = 0; i < n; ++i) dst[i * stride] = in[i];
    return;
  }
  float chunk[64];
  for (int64_t i0 = 0; i0 < n; i0 += 64) {
    const int64_t m = std::min<int64_t>(64, n - i0);
    load_elements(base, index + i0, dtype, m, chunk);
    for (int64_t i = 0; i < m; ++i) dst[(i0 + i) * stride] = chunk[i];
  }
}

// dst[d * ld + r] = src row r: the transposed tile, so products against it run over rows.
// fp32 rows go through 8 x 8 register transposes where AVX is on: element by element, with the
// dtype switch in the loop, the transposes of K and V were ~15% of a backward.
inline void load_rows_transposed(const AttentionProblem& p, const TensorView& t, const Sequence& s, bool query_side,
                                 int64_t h, int64_t i0, int64_t rows, int64_t dim, float* dst, int64_t ld) {
  int64_t r0 = 0;
#if defined(__AVX__)
  if (p.dtype == DType::f32) {
    const float* in = static_cast<const float*>(t.data);
    for (; r0 + 8 <= rows; r0 += 8) {
      const float* src[8];
      for (int r = 0; r < 8; ++r) src[r] = in + row_offset(p, t, s, query_side, i0 + r0 + r, h);
      int64_t d0 = 0;
      for (; d0 + 8 <= dim; d0 += 8) {
        __m256 x[8], y[8];
        for (int r = 0; r < 8; ++r) x[r] = _mm256_loadu_ps(src[r] + d0);
        for (int r = 0; r < 8; r += 2) {  // pairs of rows interleaved
          y[r] = _mm256_unpacklo_ps(x[r], x[r + 1]);
          y[r + 1] = _mm256_unpackhi_ps(x[r], x[r + 1]);
        }
        for (int r = 0; r < 8; r += 4) {  // then quads
          x[r] = _mm256_shuffle_ps(y[r], y[r + 2], 0x44);
          x[r + 1] = _mm256_shuffle_ps(y[r], y[r + 2], 0xEE);
          x[r + 2] = _mm256_shuffle_ps(y[r + 1], y[r + 3], 0x44);
          x[r + 3] = _mm256_shuffle_ps(y[r + 1], y[r + 3], 0xEE);
        }
        for (int c = 0; c < 4; ++c) {  // then the two 128-bit halves
          _mm256_storeu_ps(dst + (d0 + c) * ld + r0, _mm256_permute2f128_ps(x[c], x[c + 4], 0x20));
          _mm256_storeu_ps(dst + (d0 + c + 4) * ld + r0, _mm256_permute2f128_ps(x[c], x[c + 4], 0x31));
        }
      }
      for (; d0 < dim; ++d0)
        for (int r = 0; r < 8; ++r) dst[d0 * ld + r0 + r] = src[r][d0];
    }
  }
#endif
  for (int64_t r = r0; r < rows; ++r)
    load_elements_strided(t.data, row_offset(p, t, s, query_side, i0 + r, h), p.dtype, dim, dst + r, ld);
}

// Varlen buffers may hold rows before the first sequence (cu_seqlens[0] > 0) and after the last
// (cu_seqlens[batch] < total): no sequence covers them, so they are outputs of nothing, and they
// get the values of a row that sees no key (zeros; L = -inf) rather than whatever the buffer held.
// The rows [begin, end) the sequences cover.
struct CoveredRows {
  int64_t begin, end;
};
inline CoveredRows covered_rows(const AttentionProblem& p, bool query_side) {
  const int32_t* cu = query_side ? p.cu_seqlens_q : p.cu_seqlens_k;
  return {cu[0], cu[p.batch]};
}

// Zeros the rows of every head of a varlen tensor of `total` rows that `covered` leaves out.
inline void zero_uncovered_rows(const AttentionProblem& p, const TensorView& t, CoveredRows covered, int64_t total,
                                int64_t heads, int64_t dim) {
  for (int64_t r = 0; r < total; ++r) {
    if (r == covered.begin) r = std::max(r, covered.end);
    if (r >= total) break;
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t base = r * t.seq_stride + h * t.head_stride;
      for (int64_t d = 0; d < dim; ++d) store_element(t.data, base + d, p.dtype, 0.0f);
    }
  }
}

// Stores rows of src (ld; fp32, or double sums rounded to fp32 first) times a per-row factor
// (row_factor, or none) and a common one into tensor t, rounded to its dtype.
template <class Src>
inline void store_rows(const AttentionProblem& p, const TensorView& t, const Sequence& s, bool query_side, int64_t h,
                       int64_t i0, int64_t rows, int64_t dim, const Src* src, int64_t ld, const float* row_factor,
                       float factor = 1.0f) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t base = row_offset(p, t, s, query_side, i0 + r, h);
    const float f = row_factor ? row_factor[r] * factor : factor;
    const Src* in = src + r * ld;
    if (p.dtype == DType::f32) {  // the same values, in a loop free of the dtype switch, so it vectorises
      float* out = static_cast<float*>(t.data) + base;  // (the backward's dQ store was ~3% of it, scalar)
      for (int64_t d = 0; d < dim; ++d) out[d] = float(in[d]) * f;
    } else {
      for (int64_t d = 0; d < dim; ++d) store_element(t.data, base + d, p.dtype, float(in[d]) * f);
    }
  }
}

// SIMD lanes follow the build's target: 8 where AVX is enabled, else 4 (SSE, NEON). GCC/Clang
// vector types, because auto-vectorisation of the scalar loops measured slower than no blocking.
#if defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
using f32xN = float __attribute__((vector_size(4 * kLanes)));
using i32xN = int32_t __attribute__((vector_size(4 * kLanes)));

inline f32xN load_lanes(const float* p) {
  f32xN v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store_lanes(float* p, f32xN v) { std::memcpy(p, &v, sizeof v); }
// x in every lane. x - 0 is x for every x, so it folds to a plain broadcast (x + 0 does not:
// -0 + 0 is +0, and it cost an add before each broadcast in the products).
inline f32xN broadcast_lanes(float x) { return x - f32xN{}; }

// a * b + c with one rounding where the target has FMA, spelled out rather than left to the
// compiler's contraction, so that a vector lane and the scalar loops (edges, dot_chunked) round
// identically.
inline f32xN fma_lanes(f32xN a, f32xN b, f32xN c) {
#if defined(__FMA__) && defined(__AVX__)
  return __builtin_ia32_vfmaddps256(a, b, c);
#elif defined(__FMA__)
  return __builtin_ia32_vfmaddps(a, b, c);
#else
  return a * b + c;
#endif
}
inline float fma_scalar(float a, float b, float c) {
#if defined(__FMA__)
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

// Products sum their k terms in runs of kGemmChunk, each run from zero, and add the runs into C
// in order: the rounding error of a length-k sum then grows with kGemmChunk + k / kGemmChunk
// rather than with k. With headdim_v 256, a plain running sum made dP = dO V^T 2-3x less
// accurate than a BLAS product, enough to break the 2x-of-naive rule for dQ and dK.
constexpr int64_t kGemmChunk = 16;

// C[m x n] += A[m x k] B[k x n] for the small tile products. A is read through two strides
// (row, column) so that a transposed operand (dS^T) costs nothing; B and C are row-major. Each
// element of C gets its k terms in runs of kGemmChunk (see above), whatever its place in the
// tiling (src/cpu/gemm.cpp).
void gemm_accumulate(const float* a, int64_t a_row, int64_t a_col, const float* b, int64_t ldb, float* c,
                     int64_t ldc, int64_t m, int64_t n, int64_t k);

// c plus the k terms x(d) y(d) in runs of kGemmChunk, as one element of the products sums them
// (above), one scalar lane. Four runs' FMA chains go at once: each starts from zero, so they are
// independent, and they still join c in order (a one-key backward spent half its time in these
// chains one after another; docs/perf-log.md).
template <class X, class Y>
[[gnu::always_inline]] inline float add_chunked(float c, X x, Y y, int64_t k) {
  constexpr int64_t kRuns = 4;
  int64_t d0 = 0;
  for (; d0 + kRuns * kGemmChunk <= k; d0 += kRuns * kGemmChunk) {
    float run[kRuns] = {};
    for (int64_t t = 0; t < kGemmChunk; ++t)
      for (int64_t r = 0; r < kRuns; ++r) {
        const int64_t d = d0 + r * kGemmChunk + t;
        run[r] = fma_scalar(x(d), y(d), run[r]);
      }
    for (int64_t r = 0; r < kRuns; ++r) c += run[r];
  }
  for (; d0 < k; d0 += kGemmChunk) {
    const int64_t d1 = std::min(k, d0 + kGemmChunk);
    float run = 0.0f;
    for (int64_t d = d0; d < d1; ++d) run = fma_scalar(x(d), y(d), run);
    c += run;
  }
  return c;
}

// x . y rounded exactly as an element of gemm(x as a 1 x k row, y as a k x 1 column) is: the
// backward forms D = dO . O with it so that D and dP = dO V^T share their rounding (with one
// visible key O is V, and dP - D must then be exactly 0, as in a naive implementation).
inline float dot_chunked(const float* x, const float* y, int64_t k) {
  return add_chunked(0.0f, [x](int64_t d) { return x[d]; }, [y](int64_t d) { return y[d]; }, k);
}

// C = A B (overwrites the m x n block of C; the same values as zeroing C, then gemm_accumulate).
// It and gemm_accumulate run the build target's lanes or AVX-512's, one instance per process
// (gemm_kernels.hpp).
void gemm(const float* a, int64_t a_row, int64_t a_col, const float* b, int64_t ldb, float* c, int64_t ldc,
          int64_t m, int64_t n, int64_t k);

// x rounded to an integer, ties either way (exp2_lanes needs only |x - result| <= 1/2): one
// instruction with SSE 4.1 or AVX; else floor(x + 1/2) from conversions, which truncate toward zero.
inline f32xN round_lanes(f32xN x) {
#if defined(__AVX__)
  return __builtin_ia32_roundps256(x, 0x08);  // nearest, no exceptions
#elif defined(__SSE4_1__)
  return __builtin_ia32_roundps(x, 0x08);
#else
  const f32xN t = x + 0.5f, n = __builtin_convertvector(__builtin_convertvector(t, i32xN), f32xN);
  return n > t ? n - 1.0f : n;
#endif
}

// x[j] = 2^(x[j] - sub) for a row, kLanes at a time (libm's scalar exp2f measured ~10% of
// the whole backward). 2^x = 2^n * 2^f with n = round(x), |f| <= 1/2, and 2^f a degree-6 fit
// (relative error < 1e-7 in fp32, about 1.6 ulp). x < -126 gives exactly 0, so masked (-inf)
// scores weigh nothing; x is never above ~0 here (scores minus their max or their LSE).
// x clamped to [lo, hi], a NaN lane kept: maxps and minps return their second operand where
// either is NaN, so with x second they are the two comparisons and selects GCC makes of the
// ternary form (vcmpps + vblendvps each), in one instruction each.
inline f32xN clamp_lanes(f32xN x, float lo, float hi) {
#if defined(__AVX__)
  return __builtin_ia32_minps256(f32xN{} + hi, __builtin_ia32_maxps256(f32xN{} + lo, x));
#elif defined(__SSE__)
  return __builtin_ia32_minps(f32xN{} + hi, __builtin_ia32_maxps(f32xN{} + lo, x));
#else
  x = x < lo ? f32xN{} + lo : x;
  return x > hi ? f32xN{} + hi : x;
#endif
}

inline f32xN exp2_lanes(f32xN x) {
  const i32xN dead = x < -126.0f;  // all-ones lanes, also for -inf
  x = clamp_lanes(x, -126.0f, 127.0f);
  const f32xN whole = round_lanes(x);
  const i32xN n = __builtin_convertvector(whole, i32xN);  // exact: whole is an integer
  const f32xN f = x - whole;                              // exact (Sterbenz), |f| <= 1/2
  f32xN p = f * 1.508394634583965e-4f + 1.3395515270531178e-3f;
  p = p * f + 9.61942970752716e-3f;
  p = p * f + 5.5503424257040024e-2f;
  p = p * f + 2.402263879776001e-1f;
  p = p * f + 6.931471824645996e-1f;
  p = p * f + 1.0f;
  i32xN bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits = (bits + (n << 23)) & ~dead;
  std::memcpy(&p, &bits, sizeof p);
  return p;
}

inline void exp2_row(float* x, int64_t n, float sub) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) store_lanes(x + j, exp2_lanes(load_lanes(x + j) - sub));
  if (j < n) {  // the tail through the same lanes, so every element gets the same rounding
    float tail[kLanes];
    std::fill(tail, tail + kLanes, -INFINITY);
    std::copy(x + j, x + n, tail);
    const f32xN r = exp2_lanes(load_lanes(tail) - sub);
    std::memcpy(x + j, &r, size_t(n - j) * sizeof(float));
  }
}

// Turns raw dot products q.k into scores in natural units: s = scale * qk, or with soft-capping
// s = softcap * tanh(scale * qk / softcap). `tanh_out` (optional) keeps tanh for the backward's
// cap derivative. Constants are computed once per call.
//
// Weights are exp2((s - ref) * log2(e)) with ref the row's max (forward) or its LSE (backward):
// the one rounding of s is shared by both passes and the difference is taken before the
// conversion to log2 units. Scores kept as s * log2(e) instead rounded |s2| (up to ~15 in peaky
// rows) and the LSE once more, several ulp of the exponent in every weight; through
// dS = P (dP - D) that was 2-3x a naive fp32 implementation's dQ and dK error with head dims 1-4.
// It also makes the weight of a row's only visible key exactly 1 in both passes (s - max = 0,
// and the LSE is then s itself), so that dS = P (dP - D) is exactly 0 there, as in a naive
// implementation.
struct ScoreTransform {
  float scale = 1.0f;
  float qk_to_tanh = 0.0f;  // cap: scale / softcap
  float softcap = 0.0f;
  ScoreMod mod;             // the problem's one preparation; ALiBi is read from it
  Dropout dropout;          // off unless dropout_p > 0

  static ScoreTransform from(const AttentionProblem& p) {
    ScoreTransform t;
    t.mod = score_mod(p);
    t.dropout = make_dropout(p.dropout_p, p.dropout_seed, p.dropout_offset, p.heads_q, p.dropout_rng_state);
    t.scale = t.mod.scale;
    t.softcap = t.mod.softcap;
    t.qk_to_tanh = t.mod.softcap_pre;
    return t;
  }

  // ALiBi along n scores whose distances |i + sk - sq - j| are |d0 + step * k| (step +1 down a
  // key-major column of queries, -1 along a row of keys): the bias is added after the cap, in
  // natural units, before masking. Only called when the problem has slopes.
  static void add_alibi(float* s, int64_t n, float slope, int64_t d0, int64_t step) {
    for (int64_t k = 0; k < n; ++k) {
      const int64_t d = d0 + step * k;
      s[k] += -slope * float(d < 0 ? -d : d);
    }
  }

  void apply(float* s, int64_t n, float* tanh_out) const {
    if (softcap > 0.0f) {
      for (int64_t j = 0; j < n; ++j) {
        const float th = tanhf(s[j] * qk_to_tanh);
        if (tanh_out) tanh_out[j] = th;
        s[j] = th * softcap;
      }
    } else {
      for (int64_t j = 0; j < n; ++j) s[j] *= scale;
    }
  }
};

// The weight exp2((s - ref) * log2(e)) of scores s; masked (-inf) scores weigh 0.
inline f32xN weight_lanes(f32xN s, f32xN ref) { return exp2_lanes((s - ref) * kLog2e); }

// x[j] = P = weight of score x[j] for one row whose LSE (natural log) is lse.
inline void weights_row(float* x, int64_t n, float lse) {
  const f32xN ref = f32xN{} + lse;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) store_lanes(x + j, weight_lanes(load_lanes(x + j), ref));
  if (j < n) {  // the tail through the same lanes, so every element gets the same rounding
    float tail[kLanes];
    std::fill(tail, tail + kLanes, -INFINITY);
    std::copy(x + j, x + n, tail);
    const f32xN r = weight_lanes(load_lanes(tail), ref);
    std::memcpy(x + j, &r, size_t(n - j) * sizeof(float));
  }
}

// weights_row of the scores scale * x[j], times norm, in one pass over the row: the same
// operations as scaling the row, weights_row, then multiplying by norm (x * 1 is x, so norm = 1
// needs no branch), for rows with neither cap nor ALiBi (masked entries may already be -inf).
inline void scaled_weights_row(float* x, int64_t n, float scale, float lse, float norm) {
  const f32xN ref = f32xN{} + lse, sc = broadcast_lanes(scale), nm = broadcast_lanes(norm);
  // s = scale * x rounded on its own, as the forward rounds it: fused into the subtraction of the
  // LSE (which the compiler does unasked), s - L differs by s's rounding, ~|s| * 2^-24, and with
  // scores in the hundreds that error in every weight put dV at 30x a naive fp32 backward's error.
  const auto scores = [&](f32xN v) {
    f32xN s = v * sc;
    asm("" : "+x"(s));  // no contraction across this point
    return s;
  };
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) store_lanes(x + j, weight_lanes(scores(load_lanes(x + j)), ref) * nm);
  if (j < n) {
    float tail[kLanes];
    std::fill(tail, tail + kLanes, -INFINITY);
    std::copy(x + j, x + n, tail);
    const f32xN r = weight_lanes(scores(load_lanes(tail)), ref) * nm;
    std::memcpy(x + j, &r, size_t(n - j) * sizeof(float));
  }
}

// sums[i] += sum_j double(x_ij) * double(y_ij) and weights[i] += sum_j double(x_ij) for the rows of
// two row-major tiles (ld), in lanes of four doubles (summed across lanes by the caller, in a
// fixed order): each product is exact in double, and a serial double sum per row was latency
// bound (~4% of a backward).
using f64x4 = double __attribute__((vector_size(32)));
inline void add_row_products(const float* x, const float* y, int64_t ld, int64_t rows, int64_t n, f64x4* sums,
                             f64x4* weights) {
  using f32x4 = float __attribute__((vector_size(16)));
  for (int64_t i = 0; i < rows; ++i) {
    const float* xi = x + i * ld;
    const float* yi = y + i * ld;
    f64x4 s = sums[i], w = weights[i];
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
      f32x4 a, b;
      std::memcpy(&a, xi + j, sizeof a);
      std::memcpy(&b, yi + j, sizeof b);
      const f64x4 ad = __builtin_convertvector(a, f64x4), bd = __builtin_convertvector(b, f64x4);
      s += ad * bd;
      w += ad;
    }
    for (int k = 0; j < n; ++j, ++k) {  // the tail into lanes 0.. in order
      s[k] += double(xi[j]) * double(yi[j]);
      w[k] += double(xi[j]);
    }
    sums[i] = s;
    weights[i] = w;
  }
}

// C[m x n] += A[m x k] B[k x n] for n <= 8 and k up to a tile's rows or keys, each element's k
// terms summed in double (each product exact), then added to the double C: the backward's dQ and
// dK where headdim_qk is that small (src/cpu/backward.cpp, kNarrowHeaddim). A row of B is two
// vectors of four doubles, and four rows of C go at once, so that eight sums are in flight rather
// than one.
inline void gemm_wide(const float* a, int64_t a_row, int64_t a_col, const float* b, int64_t ldb, double* c,
                      int64_t ldc, int64_t m, int64_t n, int64_t k) {
  constexpr int64_t kMaxK = std::max(kTileQ, kTileK), kRows = 4;
  f64x4 b_lo[kMaxK], b_hi[kMaxK];
  for (int64_t t = 0; t < k; ++t) {
    double row[8] = {};
    for (int64_t j = 0; j < n; ++j) row[j] = b[t * ldb + j];
    std::memcpy(&b_lo[t], row, sizeof(f64x4));
    std::memcpy(&b_hi[t], row + 4, sizeof(f64x4));
  }
  const auto store = [&](int64_t i, f64x4 lo, f64x4 hi) {
    double row[8];
    std::memcpy(row, &lo, sizeof lo);
    std::memcpy(row + 4, &hi, sizeof hi);
    for (int64_t j = 0; j < n; ++j) c[i * ldc + j] += row[j];
  };
  int64_t i = 0;
  for (; i + kRows <= m; i += kRows) {
    f64x4 lo[kRows] = {}, hi[kRows] = {};
    for (int64_t t = 0; t < k; ++t)
      for (int64_t r = 0; r < kRows; ++r) {
        const double x = a[(i + r) * a_row + t * a_col];
        lo[r] += x * b_lo[t];
        if (n > 4) hi[r] += x * b_hi[t];
      }
    for (int64_t r = 0; r < kRows; ++r) store(i + r, lo[r], hi[r]);
  }
  for (; i < m; ++i) {
    f64x4 lo = {}, hi = {};
    for (int64_t t = 0; t < k; ++t) {
      const double x = a[i * a_row + t * a_col];
      lo += x * b_lo[t];
      if (n > 4) hi += x * b_hi[t];
    }
    store(i, lo, hi);
  }
}

// keep[i * row_step + j * col_step] = 1 where element (query i0 + i, key j0 + j) of sequence b,
// head h is kept, else 0 (common/philox.hpp's rule): one Philox call per four aligned keys.
inline void dropout_keep_tile(const Dropout& d, int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t j0, int64_t n,
                              uint8_t* keep, int64_t row_step, int64_t col_step) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < n;) {
      const Philox4 r = d.draws(b, h, i0 + i, j0 + j);
      for (const int64_t end = std::min(n, j + 4 - ((j0 + j) & 3)); j < end; ++j)
        keep[i * row_step + j * col_step] = dropout_word(r, j0 + j) >= d.threshold;
    }
}

// Sets the scores of keys row i cannot see to -inf, for a key tile [j0, j0 + n) that is not
// entirely visible to the query tile (only boundary tiles pay for this).
inline void mask_row(const Mask& mask, int64_t i, int64_t j0, int64_t n, float* s) {
  const int64_t lo = std::clamp<int64_t>(mask.begin_key(int(i)) - j0, 0, n);
  const int64_t hi = std::clamp<int64_t>(mask.end_key(int(i)) - j0, lo, n);
  std::fill(s, s + lo, -INFINITY);
  std::fill(s + hi, s + n, -INFINITY);
}

}  // namespace tileattn::cpu
