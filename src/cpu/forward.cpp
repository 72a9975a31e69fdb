// Tiled CPU forward and softmax(X) @ V: one task per (batch, head, query tile); each task walks
// the key tiles its mask leaves non-empty with an online softmax, so no score matrix larger than
// one tile exists and every output element is written by exactly one task.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/cpu_backend.hpp"
#include "cpu/parallel.hpp"
#include "cpu/tile_ops.hpp"

namespace tileattn::cpu {
namespace {

// Score tiles are key-major (s[j * kTileQ + i], query i across the columns): each query's max and
// sum then run across contiguous query lanes, one vector operation per key, where a query-major
// tile needs a serial reduction along every row; and S^T = K Q^T reads K rows as they lie in
// memory, so only Q is transposed (once per task) instead of every K tile for every query tile.
static_assert(kTileQ % kLanes == 0, "the query columns of a score tile are whole vectors");

// Running state of kTileQ queries: max m and sum l (natural units), unnormalised output acc
// (rows x dv).
struct OnlineRows {
  float m[kTileQ], l[kTileQ];
  std::vector<float> acc;
  void reset(int64_t rows, int64_t dv) {
    std::fill(m, m + kTileQ, -INFINITY);
    std::fill(l, l + kTileQ, 0.0f);
    acc.assign(size_t(rows * dv), 0.0f);
  }
};

// One online-softmax step over a key-major tile of scores s (n keys x kTileQ queries; masked
// entries -inf; columns from `rows` on finite and ignored): rescales the running state to the
// new max and replaces s by the weights (weight_lanes), which the caller then multiplies into V.
// Each query's sum adds its keys in order, as a scalar loop would.
void online_step(float* s, int64_t rows, int64_t n, int64_t dv, OnlineRows& st) {
  const int64_t vecs = ceil_div(rows, kLanes);  // only the columns the products filled
  float m_new[kTileQ], ref[kTileQ];
  for (int64_t c = 0; c < vecs; ++c) {
    f32xN mx = load_lanes(st.m + c * kLanes);
    for (int64_t j = 0; j < n; ++j) {
      const f32xN x = load_lanes(s + j * kTileQ + c * kLanes);
      mx = x > mx ? x : mx;
    }
    store_lanes(m_new + c * kLanes, mx);
  }
  for (int64_t i = 0; i < vecs * kLanes; ++i) ref[i] = safe_row_max(m_new[i]);
  f32xN sum[kTileQ / kLanes];
  for (int64_t c = 0; c < vecs; ++c) sum[c] = f32xN{};
  for (int64_t j = 0; j < n; ++j) {
    float* sj = s + j * kTileQ;
    for (int64_t c = 0; c < vecs; ++c) {
      const f32xN e = weight_lanes(load_lanes(sj + c * kLanes), load_lanes(ref + c * kLanes));
      store_lanes(sj + c * kLanes, e);
      sum[c] += e;
    }
  }
  float tile_sum[kTileQ];
  for (int64_t c = 0; c < vecs; ++c) store_lanes(tile_sum + c * kLanes, sum[c]);
  for (int64_t i = 0; i < rows; ++i) {
    const float alpha = st.m[i] == -INFINITY ? 0.0f : exp2f((st.m[i] - m_new[i]) * kLog2e);
    st.l[i] = st.l[i] * alpha + tile_sum[i];
    st.m[i] = m_new[i];
    if (alpha != 1.0f) {
      float* ai = &st.acc[size_t(i * dv)];
      for (int64_t d = 0; d < dv; ++d) ai[d] *= alpha;
    }
  }
}

// L = m + ln(l), rounded once: the backward's weights are exp2((s - L) * log2(e)), so L's error
// reaches every weight of the row.
float finish_lse_rounded_once(float m, float row_sum, float offset) {
  if (!(row_sum > 0.0f)) return -INFINITY;
  return float(double(m) + std::log(double(row_sum)) + double(offset));
}

struct ForwardScratch {
  std::vector<float> qt, k, v, s;
  std::vector<uint8_t> keep;  // dropout's keep mask of one tile, key-major like s
  OnlineRows rows;
};

void forward_tile(const AttentionProblem& p, const ScoreTransform& transform, int64_t b, int64_t h, int64_t tile,
                  ForwardScratch& w) {
  const Sequence s = sequence(p, b);
  const int64_t i0 = tile * kTileQ;
  if (i0 >= s.len_q) return;
  const int64_t rows = std::min(kTileQ, s.len_q - i0), i1 = i0 + rows;
  const int64_t dqk = p.headdim_qk, dv = p.headdim_v, hk = h / (p.heads_q / p.heads_kv);
  // Products and the softmax step run over whole vectors of queries: `cols` columns, those past
  // `rows` zero so that their padding scores are finite (a short tile then costs its own size,
  // not a full tile's: a seqlen-1 call spent most of its time clearing 64 columns).
  const int64_t cols = ceil_div(rows, kLanes) * kLanes;
  w.qt.resize(size_t(dqk * kTileQ));
  w.k.resize(size_t(kTileK * dqk));
  w.v.resize(size_t(kTileK * dv));
  w.s.resize(size_t(kTileK * kTileQ));
  w.rows.reset(rows, dv);
  load_rows_transposed(p, p.q, s, true, h, i0, rows, dqk, w.qt.data(), kTileQ);
  for (int64_t d = 0; d < dqk; ++d) std::fill(&w.qt[size_t(d * kTileQ + rows)], &w.qt[size_t(d * kTileQ + cols)], 0.0f);

  const int64_t key_begin = s.mask.tile_begin_key(int(i0)), key_end = s.mask.tile_end_key(int(i1));
  const float slope = transform.mod.slope(b, h);
  const int64_t shift = s.len_k - s.len_q;
  const int64_t full_begin = s.mask.full_begin_key(int(i1)), full_end = s.mask.full_end_key(int(i0));
  for (int64_t j0 = key_begin; j0 < key_end; j0 += kTileK) {
    const int64_t n = std::min(kTileK, key_end - j0);
    const RowsView k = view_rows(p, p.k, s, false, hk, j0, n, dqk, w.k.data());
    const RowsView v = view_rows(p, p.v, s, false, hk, j0, n, dv, w.v.data());
    // S^T = K Q^T; only tiles straddling the mask edge pay for masking.
    gemm(k.data, k.ld, 1, w.qt.data(), kTileQ, w.s.data(), kTileQ, n, cols, dqk);
    for (int64_t j = 0; j < n; ++j) transform.apply(&w.s[size_t(j * kTileQ)], rows, nullptr);
    if (transform.mod.has_alibi())
      for (int64_t j = 0; j < n; ++j)
        ScoreTransform::add_alibi(&w.s[size_t(j * kTileQ)], rows, slope, i0 + shift - (j0 + j), 1);
    if (j0 < full_begin || j0 + n > full_end) {
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t lo = std::clamp<int64_t>(s.mask.begin_key(int(i0 + i)) - j0, 0, n);
        const int64_t hi = std::clamp<int64_t>(s.mask.end_key(int(i0 + i)) - j0, lo, n);
        for (int64_t j = 0; j < lo; ++j) w.s[size_t(j * kTileQ + i)] = -INFINITY;
        for (int64_t j = hi; j < n; ++j) w.s[size_t(j * kTileQ + i)] = -INFINITY;
      }
    }
    online_step(w.s.data(), rows, n, dv, w.rows);
    // Dropout acts on the weights after the row sums took them whole (L is the undropped LSE);
    // 1 / (1 - p) is folded into the final 1 / l.
    if (transform.dropout.on) {
      w.keep.resize(size_t(kTileK * kTileQ));
      dropout_keep_tile(transform.dropout, b, h, i0, rows, j0, n, w.keep.data(), 1, kTileQ);
      for (int64_t j = 0; j < n; ++j)
        for (int64_t i = 0; i < rows; ++i)
          if (!w.keep[size_t(j * kTileQ + i)]) w.s[size_t(j * kTileQ + i)] = 0.0f;
    }
    // O += P V, P read through its transpose
    gemm_accumulate(w.s.data(), 1, kTileQ, v.data, v.ld, w.rows.acc.data(), dv, rows, dv, n);
  }

  float* inv = w.rows.l;  // l is finished: reuse it for 1/l
  for (int64_t i = 0; i < rows; ++i) {
    const float offset = transform.mod.lse_offset(slope, int(i0 + i), int(s.len_q), int(s.len_k));
    p.lse[lse_index(p, s, i0 + i, h)] = finish_lse_rounded_once(w.rows.m[i], inv[i], offset);
    inv[i] = inverse_row_sum(inv[i]) * transform.dropout.scale;
  }
  store_rows(p, p.o, s, true, h, i0, rows, dv, w.rows.acc.data(), dv, inv);
}

}  // namespace

void forward(const AttentionProblem& p) {
  int64_t max_q, max_k;
  max_lengths(p, max_q, max_k);
  const int64_t tiles = ceil_div(max_q, kTileQ);
  const ScoreTransform transform = ScoreTransform::from(p);
  const double flops = 2.0 * double(p.batch * p.heads_q) * double(max_q) * double(max_k) * double(p.headdim_qk + p.headdim_v);
  parallel_for(p.batch * p.heads_q * tiles, threads_for(p.num_threads, flops), [&](int64_t task) {
    thread_local ForwardScratch scratch;
    const int64_t tile = task % tiles, bh = task / tiles;
    forward_tile(p, transform, bh / p.heads_q, bh % p.heads_q, tile, scratch);
  });
  if (p.is_varlen()) {
    const int64_t r0 = first_uncovered_row(p, true);
    zero_rows(p, p.o, r0, p.total_q, p.heads_q, p.headdim_v);
    for (int64_t h = 0; h < p.heads_q; ++h) std::fill(p.lse + h * p.total_q + r0, p.lse + (h + 1) * p.total_q, -INFINITY);
  }
}

void softmax_matmul(const SoftmaxMatmulProblem& p) {
  const int64_t tiles = ceil_div(p.d1, kTileQ);
  const double flops = 2.0 * double(p.batch) * double(p.d1) * double(p.d2) * double(p.d3);
  parallel_for(p.batch * tiles, threads_for(p.num_threads, flops), [&](int64_t task) {
    thread_local ForwardScratch w;
    const int64_t b = task / tiles, r0 = (task % tiles) * kTileQ;
    const int64_t rows = std::min(kTileQ, p.d1 - r0), dv = p.d3;
    w.s.assign(size_t(kTileK * kTileQ), 0.0f);  // columns past `rows` stay finite
    w.v.resize(size_t(kTileK * dv));
    w.rows.reset(rows, dv);
    for (int64_t c0 = 0; c0 < p.d2; c0 += kTileK) {
      const int64_t n = std::min(kTileK, p.d2 - c0);
      // Each element of X is read once, straight into the key-major score tile.
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < n; ++j)
          w.s[size_t(j * kTileQ + i)] =
              load_element(p.x, b * p.x_batch_stride + (r0 + i) * p.x_row_stride + c0 + j, p.dtype);
      for (int64_t j = 0; j < n; ++j)
        for (int64_t d = 0; d < dv; ++d)
          w.v[size_t(j * dv + d)] = load_element(p.v, b * p.v_batch_stride + (c0 + j) * p.v_row_stride + d, p.dtype);
      online_step(w.s.data(), rows, n, dv, w.rows);
      gemm_accumulate(w.s.data(), 1, kTileQ, w.v.data(), dv, w.rows.acc.data(), dv, rows, dv, n);
    }
    for (int64_t i = 0; i < rows; ++i) {
      const float inv = inverse_row_sum(w.rows.l[i]);
      for (int64_t d = 0; d < dv; ++d)
        store_element(p.out, b * p.out_batch_stride + (r0 + i) * p.out_row_stride + d, p.dtype,
                      w.rows.acc[size_t(i * dv + d)] * inv);
    }
  });
}

}  // namespace tileattn::cpu
