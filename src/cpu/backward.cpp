// Tiled CPU backward. P is recomputed from the saved L, and the softmax gradient's D comes from
// rowsum(O * dO), or from P and dP where that is cheap or needed (tile_row_terms,
// use_consistent_delta), so nothing quadratic is stored. Every output element is
// written by one task in a fixed order: race-free and bitwise deterministic.
//
// dK and dV of a key tile accumulate locally over the query tiles that see it and over every
// query head of the GQA group. dQ needs a sum over key tiles, which are spread across tasks, so
// there are two schedules:
//  - fused, when (batch, kv head) pairs alone keep every thread busy: one task per pair walks its
//    key tiles in order and adds dS K into a task-owned dQ accumulator (5 tile products);
//  - split, otherwise: tasks per (batch, kv head, key tile) produce dK, dV; then tasks per
//    (batch, query head, query tile) recompute S and dP for dQ (7 tile products, full parallelism).
// Both add the same dS K terms in increasing key order, so they agree bitwise.
// Each tile product is summed in fp32 (dK and dV: over at most kWidenTiles query tiles) and the
// tiles in double: dV of an early key sums P dO over every query row and GQA head that sees it,
// and a plain fp32 sum of such long runs broke the 2x-of-naive rule (dV error 5.6e-6 against
// torch's 1.3e-6; 8 query heads over 2 kv heads, 33 rows, causal, head dim 40).
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/delta_rule.hpp"
#include "cpu/aligned.hpp"
#include "cpu/cpu_backend.hpp"
#include "cpu/parallel.hpp"
#include "cpu/row_panels.hpp"
#include "cpu/tile_ops.hpp"

namespace tileattn::cpu {
namespace {

// The fused schedule needs this many (batch, kv head) tasks per thread to balance its uneven
// (causal, varlen) tasks; below it the split schedule's finer tasks win.
constexpr int64_t kFusedTasksPerThread = 2;

// dK and dV of a key tile sum over query tiles in fp32 for this many tiles (each product's terms in
// runs of kGemmChunk, the runs added in order), then into double: widening every tile's products
// (vcvtps2pd, vaddpd) was ~7% of a backward.
constexpr int64_t kWidenTiles = 4;

// Up to this headdim_qk, dS = P (dP - D) is formed in double from a double D and rounded once, and
// dQ = dS K, dK = dS^T Q sum in double (gemm_wide). There scale >= 1/sqrt(8) and the scores are
// sums of a few terms, so dQ and dK reach the tens (headdim_v 256), and fp32's roundings of
// dP - D, of D itself (the same way across a row, which dQ adds up) and of the products' runs put
// them past the 2x rule in ~1 case in 1,000: BackwardAccuracy.Fp32SmallHeaddimQkLargeHeaddimV
// failed 4% of its runs. The products are a few percent of the work there; at headdim 64 the
// double dS alone cost ~3% of a backward, and fp32 holds the rule.
constexpr int64_t kNarrowHeaddim = 8;
static_assert(kNarrowHeaddim <= 8, "gemm_wide holds a row of B in eight doubles");

// Per (row, head), in L's layout: D (in double: kNarrowHeaddim), and (compute_delta_consistent
// only) 1 / rowsum(P), by which every P of the row is multiplied, so that the weights sum to 1 as
// a softmax's do: the P recomputed from the stored fp32 L carry L's rounding (up to ~|L| 2^-24) as
// one factor per row, which a D formed from those same P would otherwise turn into an error of D
// itself.
// from_tile: every sequence's keys fit one key tile, and each pass forms D and the factor from
// that tile's own P and dP instead (tile_row_terms); delta and norm stay empty.
struct RowTerms {
  std::vector<double> delta;
  std::vector<float> norm;
  bool from_tile = false;
};

// Where the backward reads Q and dO rows: in place, or from per-call panels (row_panels.hpp).
struct QueryRows {
  const RowPanels& q;
  const RowPanels& dout;
};

struct BackwardScratch {
  AlignedVector<float> q, dout, lse;         // query tile: Q, dO rows where copied, L (less its ALiBi offset)
  AlignedVector<double> delta;               // the tile's rows' D
  AlignedVector<double> dlse;                // the tile's rows' dL (problem.hpp), 0 without one
  RowsView qv{}, dov{};                      // the tile's Q and dO rows, wherever they are
  float slope = 0.0f;                        // ALiBi slope of the tile's head
  int64_t head = 0;                          // the tile's query head (dropout's stream)
  bool tile_terms = false;                   // RowTerms::from_tile
  AlignedVector<float> norm;                 // factor on each row's P (RowTerms)
  AlignedVector<float> kt, vt, k;            // key tile: K^T, V^T, K rows
  AlignedVector<float> p, ds, th;            // kTileQ x kTileK: P, dP then dS, tanh of capped scores
  AlignedVector<float> part;                 // one tile product
  AlignedVector<float> part_dk, part_dv;     // dK / scale and dV of up to kWidenTiles query tiles
  std::vector<uint8_t> keep;                 // dropout's keep mask of the tile (row-major like p)
  AlignedVector<double> wide, wide2;         // dQ, or dK and dV, summed over tiles
};

// wide[m x n] += part[m x n]: the tile's fp32 products into the double sum over tiles.
void add_wide(double* wide, int64_t ldw, const float* part, int64_t ldp, int64_t m, int64_t n) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < n; ++c) wide[r * ldw + c] += double(part[r * ldp + c]);
}

void size_scratch(BackwardScratch& w, int64_t dqk, int64_t dv) {
  w.q.resize(size_t(kTileQ * dqk));
  w.dout.resize(size_t(kTileQ * dv));
  w.lse.resize(size_t(kTileQ));
  w.delta.resize(size_t(kTileQ));
  w.dlse.resize(size_t(kTileQ));
  w.norm.resize(size_t(kTileQ));
  w.kt.resize(size_t(dqk * kTileK));
  w.vt.resize(size_t(dv * kTileK));
  w.k.resize(size_t(kTileK * dqk));
  w.p.resize(size_t(kTileQ * kTileK));
  w.ds.resize(size_t(kTileQ * kTileK));
  w.part.resize(size_t(std::max(kTileQ, kTileK) * std::max(dqk, dv)));
  w.part_dk.resize(size_t(kTileK * dqk));
  w.part_dv.resize(size_t(kTileK * dv));
  w.th.resize(size_t(kTileQ * kTileK));
  w.keep.resize(size_t(kTileQ * kTileK));
}

// L of row i, head h without what ALiBi's causal form adds to it (ScoreMod::lse_offset), so that
// the weights are exp2((s - L) log2 e) with the scores the forward used.
float row_lse(const AttentionProblem& p, const ScoreTransform& transform, const Sequence& s, int64_t i, int64_t h,
              float slope) {
  const float l = p.lse[lse_index(p, s, i, h)];
  if (!transform.mod.alibi_lse_offset || l == -INFINITY) return l;
  return float(double(l) - double(transform.mod.lse_offset(slope, int(i), int(s.len_q), int(s.len_k))));
}

// Loads the query-side tile: Q, dO, L, D, and the head's ALiBi slope.
void load_query_tile(const AttentionProblem& p, const ScoreTransform& transform, const RowTerms& terms,
                     const QueryRows& in, const Sequence& s, int64_t h, int64_t i0, int64_t rows, BackwardScratch& w) {
  w.slope = transform.mod.slope(s.b, h);
  w.head = h;
  w.qv = in.q.rows(p, s, h, i0, rows, w.q.data());
  w.dov = in.dout.rows(p, s, h, i0, rows, w.dout.data());
  w.tile_terms = terms.from_tile;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t li = lse_index(p, s, i0 + i, h);
    w.lse[size_t(i)] = row_lse(p, transform, s, i0 + i, h, w.slope);
    w.delta[size_t(i)] = terms.from_tile ? 0.0 : terms.delta[size_t(li)];
    w.dlse[size_t(i)] = p.dlse != nullptr ? double(p.dlse[li]) : 0.0;
    w.norm[size_t(i)] = terms.norm.empty() ? 1.0f : terms.norm[size_t(li)];
  }
}

// From the loaded Q/dO tile (rows) and K^T/V^T tile (n keys from j0) computes
// P = exp2((S - L) log2(e)) into w.p and dP into w.ds; rows that see no key get P = dP = 0.
void probabilities_and_dp(const AttentionProblem& p, const ScoreTransform& transform, const Sequence& s, int64_t i0,
                          int64_t rows, int64_t j0, int64_t n, BackwardScratch& w) {
  const int64_t dqk = p.headdim_qk, dv = p.headdim_v;
  const bool capped = transform.softcap > 0.0f;
  const bool boundary = j0 < s.mask.full_begin_key(int(i0 + rows)) || j0 + n > s.mask.full_end_key(int(i0));
  // S = Q K^T;  dP = dO V^T
  gemm(w.qv.data, w.qv.ld, 1, w.kt.data(), kTileK, w.p.data(), kTileK, rows, n, dqk);
  gemm(w.dov.data, w.dov.ld, 1, w.vt.data(), kTileK, w.ds.data(), kTileK, rows, n, dv);
  for (int64_t i = 0; i < rows; ++i) {
    float* pi = &w.p[size_t(i * kTileK)];
    const float lse = w.lse[size_t(i)];
    if (lse == -INFINITY) {  // the row sees no key: P = 0, and exp2(-inf - -inf) would be NaN
      std::fill(pi, pi + n, 0.0f);
      std::fill(&w.ds[size_t(i * kTileK)], &w.ds[size_t(i * kTileK)] + n, 0.0f);
      continue;
    }
    const float norm = w.norm[size_t(i)];
    if (!capped && !transform.mod.has_alibi()) {  // one pass; masking before the scale gives the same -inf
      if (boundary) mask_row(s.mask, i0 + i, j0, n, pi);
      scaled_weights_row(pi, n, transform.scale, lse, norm);
      continue;
    }
    transform.apply(pi, n, capped ? &w.th[size_t(i * kTileK)] : nullptr);
    if (transform.mod.has_alibi()) ScoreTransform::add_alibi(pi, n, w.slope, i0 + i + s.len_k - s.len_q - j0, -1);
    if (boundary) mask_row(s.mask, i0 + i, j0, n, pi);
    weights_row(pi, n, lse);
    if (norm != 1.0f)
      for (int64_t j = 0; j < n; ++j) pi[j] *= norm;
  }
  // Dropout: dP of the dropped output is (dO V^T) * M / (1 - p); P stays undropped here (dS needs
  // it), and the keep mask stays in w.keep for dV's P * M / (1 - p) (drop_probabilities).
  const Dropout& d = transform.dropout;
  if (d.on) {
    dropout_keep_tile(d, s.b, w.head, i0, rows, j0, n, w.keep.data(), kTileK, 1);
    for (int64_t i = 0; i < rows; ++i) {
      float* dpi = &w.ds[size_t(i * kTileK)];
      const uint8_t* ki = &w.keep[size_t(i * kTileK)];
      for (int64_t j = 0; j < n; ++j) dpi[j] = ki[j] ? dpi[j] * d.scale : 0.0f;
    }
  }
}

// P -> P * M / (1 - p) in w.p, from the mask probabilities_and_dp left in w.keep (dropout only).
void drop_probabilities(const ScoreTransform& transform, int64_t rows, int64_t n, BackwardScratch& w) {
  const Dropout& d = transform.dropout;
  for (int64_t i = 0; i < rows; ++i) {
    float* pi = &w.p[size_t(i * kTileK)];
    const uint8_t* ki = &w.keep[size_t(i * kTileK)];
    for (int64_t j = 0; j < n; ++j) pi[j] = ki[j] ? pi[j] * d.scale : 0.0f;
  }
}

// RowTerms::from_tile: the tile holds every key its rows see, so D = rowsum(P * dP) / rowsum(P)
// and the factor 1 / rowsum(P) on P come from the tile itself, as compute_delta_consistent forms
// them over a row's tiles, at no extra pass. Each product is exact in double and the keys are
// added in order, so every pass over the tile gets the same D (masked keys add exact zeros).
void tile_row_terms(int64_t rows, int64_t n, BackwardScratch& w) {
  for (int64_t i = 0; i < rows; ++i) {
    float* pi = &w.p[size_t(i * kTileK)];
    const float* dpi = &w.ds[size_t(i * kTileK)];
    double sum = 0.0, weight = 0.0;
    for (int64_t j = 0; j < n; ++j) {
      sum += double(pi[j]) * double(dpi[j]);
      weight += double(pi[j]);
    }
    w.delta[size_t(i)] = weight > 0.0 ? sum / weight : 0.0;
    const float norm = weight > 0.0 ? float(1.0 / weight) : 1.0f;
    for (int64_t j = 0; j < n; ++j) pi[j] *= norm;
  }
}

// probabilities_and_dp, then dS = P * (dP - D + dL) (through the cap derivative) into w.ds; in
// double up to kNarrowHeaddim. dL (problem.hpp's dlse) joins D here, where D is final.
void probabilities_and_ds(const AttentionProblem& p, const ScoreTransform& transform, const Sequence& s, int64_t i0,
                          int64_t rows, int64_t j0, int64_t n, BackwardScratch& w) {
  probabilities_and_dp(p, transform, s, i0, rows, j0, n, w);
  if (w.tile_terms) tile_row_terms(rows, n, w);
  const bool narrow = p.headdim_qk <= kNarrowHeaddim;
  for (int64_t i = 0; i < rows; ++i) {
    const float* pi = &w.p[size_t(i * kTileK)];
    float* dsi = &w.ds[size_t(i * kTileK)];
    const double delta = w.delta[size_t(i)] - w.dlse[size_t(i)];
    if (narrow) {
      for (int64_t j = 0; j < n; ++j) dsi[j] = float(double(pi[j]) * (double(dsi[j]) - delta));
    } else {
      const float d = float(delta);
      for (int64_t j = 0; j < n; ++j) dsi[j] = pi[j] * (dsi[j] - d);
    }
    if (transform.softcap > 0.0f) {
      const float* thi = &w.th[size_t(i * kTileK)];
      for (int64_t j = 0; j < n; ++j) dsi[j] *= softcap_grad(thi[j] * transform.softcap, transform.softcap);
    }
  }
}

// The first key tile a query tile's passes visit: on the fused schedule's grid (multiples of
// kTileK), so that every pass sums the same runs of keys; the masked keys a window leaves in the
// first tile add exact zeros.
int64_t first_key_tile(const Sequence& s, int64_t i0) { return s.mask.tile_begin_key(int(i0)) / kTileK * kTileK; }

// D = rowsum(O * dO) per (row, head), in L's layout. dS = P (dP - D) cancels D against dP, so D is
// rounded exactly as an element of dP = dO V^T is (dot_chunked): with one visible key
// O = V, and dS is then exactly 0, as in a naive implementation (D = rowsum(P * dP) there); a D
// rounded differently from dP left dP - D at a few ulp of |dP| and dQ, dK at ~1e-5 instead of 0.
void compute_delta(const AttentionProblem& p, int threads, int64_t tiles, std::vector<double>& delta) {
  parallel_for(p.batch * p.heads_q * tiles, threads, [&](int64_t task) {
    const int64_t tile = task % tiles, bh = task / tiles, b = bh / p.heads_q, h = bh % p.heads_q;
    const Sequence s = sequence(p, b);
    const int64_t i0 = tile * kTileQ;
    if (i0 >= s.len_q) return;
    const int64_t rows = std::min(kTileQ, s.len_q - i0), dv = p.headdim_v;
    thread_local std::vector<float> o, dout;
    o.resize(size_t(rows * dv));
    dout.resize(size_t(rows * dv));
    load_rows(p, p.o, s, true, h, i0, rows, dv, o.data(), dv);
    load_rows(p, p.dout, s, true, h, i0, rows, dv, dout.data(), dv);
    for (int64_t i = 0; i < rows; ++i)
      delta[size_t(lse_index(p, s, i0 + i, h))] = dot_chunked(&dout[size_t(i * dv)], &o[size_t(i * dv)], dv);
  });
}

// D = rowsum(P * dP) per (row, head) from the very P and dP the gradient passes compute, summed
// over the key tiles in order (in double): what a naive implementation does, so that dS sums to
// ~0 over each row whatever the rounding of P and dP. rowsum(O * dO) equals it only up to O's own
// rounding (a few ulp per element in fp32, the dtype's unit roundoff in fp16/bf16) summed over
// headdim_v coherently into every dS of the row: with headdim_qk <= 4, or 16-bit O, that broke
// the 2x rule. It costs one more pass of S and dP (~40% of a backward with headdim_qk =
// headdim_v), so it runs where that rounding mattered (use_consistent_delta).
void compute_delta_consistent(const AttentionProblem& p, const ScoreTransform& transform, const QueryRows& in,
                              int64_t tiles, int threads, RowTerms& terms) {
  parallel_for(p.batch * p.heads_q * tiles, threads, [&](int64_t task) {
    thread_local BackwardScratch w;
    const int64_t tile = task % tiles, bh = task / tiles, b = bh / p.heads_q, h = bh % p.heads_q;
    const Sequence s = sequence(p, b);
    const int64_t i0 = tile * kTileQ;
    if (i0 >= s.len_q) return;
    const int64_t rows = std::min(kTileQ, s.len_q - i0), i1 = i0 + rows;
    const int64_t dqk = p.headdim_qk, dv = p.headdim_v, hk = h / (p.heads_q / p.heads_kv);
    size_scratch(w, dqk, dv);
    w.qv = in.q.rows(p, s, h, i0, rows, w.q.data());
    w.dov = in.dout.rows(p, s, h, i0, rows, w.dout.data());
    w.slope = transform.mod.slope(b, h);
    w.head = h;
    for (int64_t i = 0; i < rows; ++i) w.lse[size_t(i)] = row_lse(p, transform, s, i0 + i, h, w.slope);
    std::fill(w.norm.begin(), w.norm.end(), 1.0f);
    f64x4 sum_lanes[kTileQ] = {}, weight_sum_lanes[kTileQ] = {};
    const int64_t key_end = s.mask.tile_end_key(int(i1));
    for (int64_t j0 = first_key_tile(s, i0); j0 < key_end; j0 += kTileK) {
      const int64_t n = std::min(kTileK, key_end - j0);
      load_rows_transposed(p, p.k, s, false, hk, j0, n, dqk, w.kt.data(), kTileK);
      load_rows_transposed(p, p.v, s, false, hk, j0, n, dv, w.vt.data(), kTileK);
      probabilities_and_dp(p, transform, s, i0, rows, j0, n, w);
      add_row_products(w.p.data(), w.ds.data(), kTileK, rows, n, sum_lanes, weight_sum_lanes);
    }
    double sums[kTileQ], weights[kTileQ];
    for (int64_t i = 0; i < rows; ++i) {
      sums[i] = (sum_lanes[i][0] + sum_lanes[i][1]) + (sum_lanes[i][2] + sum_lanes[i][3]);
      weights[i] = (weight_sum_lanes[i][0] + weight_sum_lanes[i][1]) + (weight_sum_lanes[i][2] + weight_sum_lanes[i][3]);
    }
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t li = lse_index(p, s, i0 + i, h);
      terms.delta[size_t(li)] = weights[i] > 0.0 ? sums[i] / weights[i] : 0.0;
      terms.norm[size_t(li)] = weights[i] > 0.0 ? float(1.0 / weights[i]) : 1.0f;
    }
  });
}

// Where rowsum(O * dO) is not accurate enough for D (compute_delta_consistent): the shared rule
// (common/delta_rule.hpp), and on the CPU also O rounded to 16 bits, and ALiBi's causal form: L is
// stored plus slope * (i + sk - sq), so its rounding (and that of every P) grows with the row, past
// the 2x rule in fp32 (measured 1.5x the bound at slope 0.5, 120 rows); the per-row factor removes
// it. Never with partial_keys: a part's keys are not the row's whole softmax, so P must keep the
// given L and D the given O (problem.hpp).
bool use_consistent_delta(const AttentionProblem& p, const ScoreTransform& transform) {
  if (p.partial_keys) return false;
  return p.dtype != DType::f32 || transform.mod.alibi_lse_offset || delta_from_p_and_dp(p);
}

// dQ (rows x dqk, in double) += dS K of the tile: the fused and split schedules' one way, so that
// they agree bitwise.
void add_dq(BackwardScratch& w, int64_t rows, int64_t n, int64_t dqk, double* dq) {
  if (dqk <= kNarrowHeaddim) return gemm_wide(w.ds.data(), kTileK, 1, w.k.data(), dqk, dq, dqk, rows, dqk, n);
  gemm(w.ds.data(), kTileK, 1, w.k.data(), dqk, w.part.data(), dqk, rows, dqk, n);
  add_wide(dq, dqk, w.part.data(), dqk, rows, dqk);
}

// dK, dV of one key tile, summed over the GQA group's query heads and the query tiles that see
// the key tile. With `dq_accum` ((group head, row, dqk) of this sequence) also adds dS K.
void key_tile(const AttentionProblem& p, const ScoreTransform& transform, const RowTerms& terms,
              const QueryRows& in, const Sequence& s, int64_t hk, int64_t j0, BackwardScratch& w, double* dq_accum) {
  const int64_t n = std::min(kTileK, s.len_k - j0), j1 = j0 + n;
  const int64_t dqk = p.headdim_qk, dv = p.headdim_v, group = p.heads_q / p.heads_kv;
  size_scratch(w, dqk, dv);
  // Only the tile's n rows: zeroing whole 64-row tiles of doubles cost more than a one-key call's
  // products (64 KiB a key tile at one key).
  w.wide.assign(size_t(n * dqk), 0.0);  // dK / scale
  w.wide2.assign(size_t(n * dv), 0.0);  // dV
  load_rows_transposed(p, p.k, s, false, hk, j0, n, dqk, w.kt.data(), kTileK);
  load_rows_transposed(p, p.v, s, false, hk, j0, n, dv, w.vt.data(), kTileK);
  if (dq_accum) load_rows(p, p.k, s, false, hk, j0, n, dqk, w.k.data(), dqk);

  const int64_t query_begin = s.mask.tile_begin_query(int(j0)), query_end = s.mask.tile_end_query(int(j1));
  int64_t pending = 0;  // query tiles in part_dk / part_dv, not yet in the double sums
  const bool narrow = dqk <= kNarrowHeaddim;
  auto widen = [&] {
    add_wide(w.wide2.data(), dv, w.part_dv.data(), dv, n, dv);
    if (!narrow) add_wide(w.wide.data(), dqk, w.part_dk.data(), dqk, n, dqk);
    pending = 0;
  };
  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = hk * group + g;
    for (int64_t i0 = query_begin; i0 < query_end; i0 += kTileQ) {
      const int64_t rows = std::min(kTileQ, query_end - i0);
      load_query_tile(p, transform, terms, in, s, h, i0, rows, w);
      probabilities_and_ds(p, transform, s, i0, rows, j0, n, w);
      if (transform.dropout.on) drop_probabilities(transform, rows, n, w);
      // dV += P^T dO (P dropped);  dK += dS^T Q;  dQ += dS K
      const auto product = pending == 0 ? gemm : gemm_accumulate;
      product(w.p.data(), 1, kTileK, w.dov.data, w.dov.ld, w.part_dv.data(), dv, n, dv, rows);
      if (narrow)
        gemm_wide(w.ds.data(), 1, kTileK, w.qv.data, w.qv.ld, w.wide.data(), dqk, n, dqk, rows);
      else
        product(w.ds.data(), 1, kTileK, w.qv.data, w.qv.ld, w.part_dk.data(), dqk, n, dqk, rows);
      if (++pending == kWidenTiles) widen();
      if (dq_accum) add_dq(w, rows, n, dqk, dq_accum + (g * s.len_q + i0) * dqk);
    }
  }
  if (pending > 0) widen();
  store_rows(p, p.dk, s, false, hk, j0, n, dqk, w.wide.data(), dqk, nullptr, *p.softmax_scale);
  store_rows(p, p.dv, s, false, hk, j0, n, dv, w.wide2.data(), dv, nullptr);
}

// Fused schedule: every key tile of one (sequence, kv head), then dQ of the group's heads.
// The accumulator is allocated per task, not kept per thread: it scales with the sequence.
void kv_head_fused(const AttentionProblem& p, const ScoreTransform& transform, const RowTerms& terms,
                   const QueryRows& in, int64_t b, int64_t hk, BackwardScratch& w) {
  const Sequence s = sequence(p, b);
  const int64_t dqk = p.headdim_qk, group = p.heads_q / p.heads_kv;
  std::vector<double> dq_accum(size_t(group * s.len_q * dqk), 0.0);
  for (int64_t j0 = 0; j0 < s.len_k; j0 += kTileK) key_tile(p, transform, terms, in, s, hk, j0, w, dq_accum.data());
  for (int64_t g = 0; g < group; ++g)
    store_rows(p, p.dq, s, true, hk * group + g, 0, s.len_q, dqk, dq_accum.data() + g * s.len_q * dqk, dqk, nullptr,
               *p.softmax_scale);
}

// Split schedule, second pass: dQ of one query tile over the key tiles it sees.
void dq_tile(const AttentionProblem& p, const ScoreTransform& transform, const RowTerms& terms,
             const QueryRows& in, int64_t b, int64_t h, int64_t tile, BackwardScratch& w) {
  const Sequence s = sequence(p, b);
  const int64_t i0 = tile * kTileQ;
  if (i0 >= s.len_q) return;
  const int64_t rows = std::min(kTileQ, s.len_q - i0), i1 = i0 + rows;
  const int64_t dqk = p.headdim_qk, dv = p.headdim_v, hk = h / (p.heads_q / p.heads_kv);
  size_scratch(w, dqk, dv);
  w.wide.assign(size_t(rows * dqk), 0.0);  // dQ / scale
  load_query_tile(p, transform, terms, in, s, h, i0, rows, w);

  const int64_t key_begin = first_key_tile(s, i0), key_end = s.mask.tile_end_key(int(i1));
  for (int64_t j0 = key_begin; j0 < key_end; j0 += kTileK) {
    const int64_t n = std::min(kTileK, key_end - j0);
    load_rows_transposed(p, p.k, s, false, hk, j0, n, dqk, w.kt.data(), kTileK);
    load_rows_transposed(p, p.v, s, false, hk, j0, n, dv, w.vt.data(), kTileK);
    load_rows(p, p.k, s, false, hk, j0, n, dqk, w.k.data(), dqk);
    probabilities_and_ds(p, transform, s, i0, rows, j0, n, w);
    add_dq(w, rows, n, dqk, w.wide.data());
  }
  store_rows(p, p.dq, s, true, h, i0, rows, dqk, w.wide.data(), dqk, nullptr, *p.softmax_scale);
}

}  // namespace

void backward(const AttentionProblem& p) {
  if (p.is_varlen()) {
    zero_uncovered_rows(p, p.dq, covered_rows(p, true), p.total_q, p.heads_q, p.headdim_qk);
    const CoveredRows keys = covered_rows(p, false);
    zero_uncovered_rows(p, p.dk, keys, p.total_k, p.heads_kv, p.headdim_qk);
    zero_uncovered_rows(p, p.dv, keys, p.total_k, p.heads_kv, p.headdim_v);
  }
  int64_t max_q, max_k;
  max_lengths(p, max_q, max_k);
  const int64_t q_tiles = ceil_div(max_q, kTileQ), k_tiles = ceil_div(max_k, kTileK);
  const ScoreTransform transform = ScoreTransform::from(p);
  const int64_t rows_q = p.is_varlen() ? p.total_q : p.batch * p.seqlen_q;
  const double flops = 2.0 * double(p.batch * p.heads_q) * double(max_q) * double(max_k) *
                       double(3 * p.headdim_qk + 2 * p.headdim_v);
  const int threads = threads_for(p.num_threads, flops);
  // Every key tile reads each query tile of its kv head's query heads (the split schedule's dQ
  // pass, and D's consistent pass, once more).
  const RowPanels q_rows(p, p.q, true, p.heads_q, p.headdim_qk, k_tiles, threads);
  const RowPanels dout_rows(p, p.dout, true, p.heads_q, p.headdim_v, k_tiles, threads);
  const QueryRows in{q_rows, dout_rows};
  RowTerms terms;
  terms.from_tile = max_k <= kTileK && !p.partial_keys;
  if (terms.from_tile) {
    // D comes from each tile's own P and dP (tile_row_terms): nothing to do before the passes.
  } else if (use_consistent_delta(p, transform)) {
    terms.delta.resize(size_t(p.heads_q * rows_q));
    terms.norm.resize(terms.delta.size());
    compute_delta_consistent(p, transform, in, q_tiles, threads, terms);
  } else {
    terms.delta.resize(size_t(p.heads_q * rows_q));
    compute_delta(p, threads, q_tiles, terms.delta);
  }
  if (p.batch * p.heads_kv >= kFusedTasksPerThread * threads) {
    parallel_for(p.batch * p.heads_kv, threads, [&](int64_t task) {
      thread_local BackwardScratch scratch;
      kv_head_fused(p, transform, terms, in, task / p.heads_kv, task % p.heads_kv, scratch);
    });
    return;
  }
  parallel_for(p.batch * p.heads_kv * k_tiles, threads, [&](int64_t task) {
    thread_local BackwardScratch scratch;
    const int64_t tile = task % k_tiles, bh = task / k_tiles, b = bh / p.heads_kv;
    const Sequence s = sequence(p, b);
    if (tile * kTileK < s.len_k) key_tile(p, transform, terms, in, s, bh % p.heads_kv, tile * kTileK, scratch, nullptr);
  });
  parallel_for(p.batch * p.heads_q * q_tiles, threads, [&](int64_t task) {
    thread_local BackwardScratch scratch;
    const int64_t tile = task % q_tiles, bh = task / q_tiles;
    dq_tile(p, transform, terms, in, bh / p.heads_q, bh % p.heads_q, tile, scratch);
  });
}

}  // namespace tileattn::cpu
