#pragma once
// Building blocks of the tiled CPU attention: tile geometry, loading strided fp32/fp16/bf16 rows
// into dense fp32 tiles (one conversion per element per tile), and the few fp32 loops the
// forward and backward are written in. Every loop's innermost dimension is contiguous and
// free of reductions, so the compiler vectorises it without reassociating floating point.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/mask.hpp"
#include "common/online_softmax.hpp"
#include "cpu/convert.hpp"
#include "tileattn/problem.hpp"

namespace tileattn::cpu {

// Query rows and key columns per tile. 64 x 64 keeps a head-dim-256 working set (Q, K^T, V,
// accumulator, scores: ~270 KiB) inside a typical per-core L2.
constexpr int64_t kTileQ = 64;
constexpr int64_t kTileK = 64;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Where the rows of one sequence live, and its mask. Fixed length: rows of sequence b start at
// b * batch_stride; varlen: at cu_seqlens[b] * seq_stride (batch_stride unused).
struct Sequence {
  int64_t len_q = 0, len_k = 0;
  int64_t row0_q = 0, row0_k = 0;  // first row in the dense (rows, heads) numbering (varlen token)
  int64_t b = 0;
  Mask mask;
};

inline Sequence sequence(const AttentionProblem& p, int64_t b) {
  Sequence s;
  s.b = b;
  if (p.is_varlen()) {
    s.row0_q = p.cu_seqlens_q[b];
    s.row0_k = p.cu_seqlens_k[b];
    s.len_q = p.cu_seqlens_q[b + 1] - s.row0_q;
    s.len_k = p.cu_seqlens_k[b + 1] - s.row0_k;
  } else {
    s.row0_q = b * p.seqlen_q;
    s.row0_k = b * p.seqlen_k;
    s.len_q = p.seqlen_q;
    s.len_k = p.seqlen_k;
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
  const int64_t row = p.is_varlen() ? (query_side ? s.row0_q : s.row0_k) * t.seq_stride : s.b * t.batch_stride;
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
      for (int64_t d = 0; d < dim; ++d) out[d] = load_element(t.data, base + d, p.dtype);
    }
  }
}

// dst[d * ld + r] = src row r: the transposed tile, so products against it run over rows.
inline void load_rows_transposed(const AttentionProblem& p, const TensorView& t, const Sequence& s, bool query_side,
                                 int64_t h, int64_t i0, int64_t rows, int64_t dim, float* dst, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t base = row_offset(p, t, s, query_side, i0 + r, h);
    for (int64_t d = 0; d < dim; ++d) dst[d * ld + r] = load_element(t.data, base + d, p.dtype);
  }
}

// Stores rows of fp32 src (ld) times a per-row factor into tensor t, rounded to its dtype.
inline void store_rows(const AttentionProblem& p, const TensorView& t, const Sequence& s, bool query_side, int64_t h,
                       int64_t i0, int64_t rows, int64_t dim, const float* src, int64_t ld, const float* row_factor) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t base = row_offset(p, t, s, query_side, i0 + r, h);
    const float f = row_factor ? row_factor[r] : 1.0f;
    for (int64_t d = 0; d < dim; ++d) store_element(t.data, base + d, p.dtype, src[r * ld + d] * f);
  }
}

// C[i, 0:n] (+)= sum_d A[i, d] * Bt[d, 0:n] for i < m: A rows (lda), Bt a transposed tile (ldb).
inline void matmul_rows_by_transposed(const float* a, int64_t lda, const float* bt, int64_t ldb, float* c, int64_t ldc,
                                      int64_t m, int64_t n, int64_t k, bool accumulate) {
  for (int64_t i = 0; i < m; ++i) {
    float* ci = c + i * ldc;
    if (!accumulate) std::fill(ci, ci + n, 0.0f);
    const float* ai = a + i * lda;
    for (int64_t d = 0; d < k; ++d) {
      const float x = ai[d];
      const float* bd = bt + d * ldb;
      for (int64_t j = 0; j < n; ++j) ci[j] += x * bd[j];
    }
  }
}

// C[i, 0:n] += sum_j W[i, j] * B[j, 0:n] for i < m: W (ldw) times the rows of B (ldb).
inline void accumulate_weighted_rows(const float* w, int64_t ldw, const float* b, int64_t ldb, float* c, int64_t ldc,
                                     int64_t m, int64_t n, int64_t k) {
  for (int64_t i = 0; i < m; ++i) {
    float* ci = c + i * ldc;
    const float* wi = w + i * ldw;
    for (int64_t j = 0; j < k; ++j) {
      const float x = wi[j];
      if (x == 0.0f) continue;  // masked and underflowed weights: common under windows
      const float* bj = b + j * ldb;
      for (int64_t d = 0; d < n; ++d) ci[d] += x * bj[d];
    }
  }
}

// C[j, 0:n] += sum_i W[i, j] * B[i, 0:n] for j < m: the transpose of W (ldw, k x m) times B.
inline void accumulate_weighted_rows_transposed(const float* w, int64_t ldw, const float* b, int64_t ldb, float* c,
                                                int64_t ldc, int64_t m, int64_t n, int64_t k) {
  for (int64_t i = 0; i < k; ++i) {
    const float* wi = w + i * ldw;
    const float* bi = b + i * ldb;
    for (int64_t j = 0; j < m; ++j) {
      const float x = wi[j];
      if (x == 0.0f) continue;
      float* cj = c + j * ldc;
      for (int64_t d = 0; d < n; ++d) cj[d] += x * bi[d];
    }
  }
}

// Turns raw dot products q.k into log2-domain scores: s2 = scale * log2(e) * qk, or with
// soft-capping s2 = log2(e) * softcap * tanh(scale * qk / softcap). `tanh_out` (optional)
// keeps tanh for the backward's cap derivative. Constants are computed once per call.
struct ScoreTransform {
  float qk_to_log2 = 0.0f;   // no cap: scale * log2(e)
  float qk_to_tanh = 0.0f;   // cap: scale / softcap
  float tanh_to_log2 = 0.0f; // cap: softcap * log2(e)
  float softcap = 0.0f;

  static ScoreTransform from(const AttentionProblem& p) {
    ScoreTransform t;
    const float scale = *p.softmax_scale;
    t.softcap = p.softcap;
    if (p.softcap > 0.0f) {
      t.qk_to_tanh = scale / p.softcap;
      t.tanh_to_log2 = p.softcap * kLog2e;
    } else {
      t.qk_to_log2 = scale * kLog2e;
    }
    return t;
  }

  void apply(float* s, int64_t n, float* tanh_out) const {
    if (softcap > 0.0f) {
      for (int64_t j = 0; j < n; ++j) {
        const float th = tanhf(s[j] * qk_to_tanh);
        if (tanh_out) tanh_out[j] = th;
        s[j] = th * tanh_to_log2;
      }
    } else {
      for (int64_t j = 0; j < n; ++j) s[j] *= qk_to_log2;
    }
  }
};

// Sets the scores of keys row i cannot see to -inf, for a key tile [j0, j0 + n) that is not
// entirely visible to the query tile (only boundary tiles pay for this).
inline void mask_row(const Mask& mask, int64_t i, int64_t j0, int64_t n, float* s) {
  const int64_t lo = std::clamp<int64_t>(mask.begin_key(int(i)) - j0, 0, n);
  const int64_t hi = std::clamp<int64_t>(mask.end_key(int(i)) - j0, lo, n);
  std::fill(s, s + lo, -INFINITY);
  std::fill(s + hi, s + n, -INFINITY);
}

}  // namespace tileattn::cpu
