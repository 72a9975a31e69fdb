// Tiled CPU forward and softmax(X) @ V: one task per (batch, head, query tile); each task walks
// the key tiles its mask leaves non-empty with an online softmax, so no score matrix larger than
// one tile exists and every output element is written by exactly one task.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "cpu/aligned.hpp"
#include "cpu/cpu_backend.hpp"
#include "cpu/kv_append.hpp"
#include "cpu/parallel.hpp"
#include "cpu/row_panels.hpp"
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
  AlignedVector<float> acc;
  void reset(int64_t rows, int64_t dv) {
    std::fill(m, m + kTileQ, -INFINITY);
    std::fill(l, l + kTileQ, 0.0f);
    acc.assign(size_t(rows * dv), 0.0f);
  }
};

// One online-softmax step over a key-major tile of scores s (n keys x kTileQ queries; masked
// entries -inf; columns from `rows` on finite and ignored): scales the scores by `scale` (1 where
// the caller already did), rescales the running state to the new max and replaces s by the weights
// (weight_lanes), which the caller then multiplies into V. Each query's sum adds its keys in
// order, as a scalar loop would.
void online_step(float* s, int64_t rows, int64_t n, int64_t dv, float scale, OnlineRows& st) {
  const int64_t vecs = ceil_div(rows, kLanes);  // only the columns the products filled
  float m_new[kTileQ], tile_sum[kTileQ];
  const f32xN scale_lanes = broadcast_lanes(scale);
  // One column of kLanes queries at a time, down the keys: its max, then its weights and their
  // sum, with the column's max and sum in one register each. Walking the keys outermost instead
  // kept all eight columns' sums live beside exp2's constants, and GCC spilled them. The max is
  // taken over the raw products: rounding is monotonic and scale > 0, so scale * max is the max of
  // the scaled scores, and the scores are scaled once, in the second pass. There the product is
  // kept rounded on its own (GCC contracts vector a * b - c into an FMA, which would change the
  // weights' rounding against the backward's, scaled_weights_row).
  const auto scores = [&](f32xN v) {
    f32xN x = v * scale_lanes;
    asm("" : "+x"(x));  // no contraction across this point
    return x;
  };
  for (int64_t c = 0; c < vecs; ++c) {
    float* col = s + c * kLanes;
    f32xN raw = f32xN{} - INFINITY;
    for (int64_t j = 0; j < n; ++j) {
      const f32xN x = load_lanes(col + j * kTileQ);
      raw = x > raw ? x : raw;
    }
    const f32xN old_max = load_lanes(st.m + c * kLanes), mx = scores(raw);
    store_lanes(m_new + c * kLanes, mx > old_max ? mx : old_max);
    float ref[kLanes];
    for (int l = 0; l < kLanes; ++l) ref[l] = safe_row_max(m_new[c * kLanes + l]);
    const f32xN ref_lanes = load_lanes(ref);
    f32xN sum = f32xN{};
    for (int64_t j = 0; j < n; ++j) {
      const f32xN e = weight_lanes(scores(load_lanes(col + j * kTileQ)), ref_lanes);
      store_lanes(col + j * kTileQ, e);
      sum += e;
    }
    store_lanes(tile_sum + c * kLanes, sum);
  }
  for (int64_t i = 0; i < rows; ++i) {
    // Past the first tiles the max rarely moves: alpha is then exactly 1 (exp2f(0)), without libm.
    const float alpha = st.m[i] == -INFINITY      ? 0.0f
                        : st.m[i] == m_new[i] ? 1.0f
                                              : exp2f((st.m[i] - m_new[i]) * kLog2e);
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

struct SoftmaxMatmulScratch {
  AlignedVector<float> v, s;
  OnlineRows rows;
};

// Query tiles one task carries through a single walk over the key tiles, so that each K and V
// tile is read once per group rather than once per query tile (and, where RowPanels does not hold
// them, copied once per group: with flash-attn's layout those copies, each row on a 4 KiB page of
// its own, measured ~13% of a forward at one tile per task).
constexpr int64_t kGroupTiles = 4;

// One query tile of a task: its transposed Q, running softmax state and key range.
struct QueryTile {
  AlignedVector<float> qt;
  OnlineRows rows;
};

struct ForwardScratch {
  AlignedVector<float> k, v, s;
  std::vector<uint8_t> keep;  // dropout's keep mask of one tile, key-major like s
  QueryTile tiles[kGroupTiles];
};

// Query tiles [tile0, tile0 + count) of (sequence b, heads [h, h + heads)). A tile holds
// kTileQ / heads positions of each of its heads, head-major (row r: head h + r / positions,
// position r % positions): with GQA the heads of a kv group then share every K and V tile and
// every product over it, as the GPU's decode packing does (heads > 1 only without ALiBi and
// dropout, whose slope and mask are per head). Each query tile sees the key tiles of its mask on
// the grid of multiples of kTileK, in increasing order, whatever the group: the keys a window hides
// in the first or last tile are masked (-inf, weight 0).
void forward_tiles(const AttentionProblem& p, const ScoreTransform& transform, const RowPanels& k_rows,
                   const RowPanels& v_rows, int64_t b, int64_t h, int64_t heads, int64_t tile0, int64_t count,
                   ForwardScratch& w) {
  const Sequence s = sequence(p, b);
  const int64_t dqk = p.headdim_qk, dv = p.headdim_v, hk = h / (p.heads_q / p.heads_kv);
  const int64_t positions = kTileQ / heads;  // per head and tile
  count = std::min(count, ceil_div(s.len_q, positions) - tile0);
  if (count <= 0) return;
  const float slope = transform.mod.slope(b, h);
  const int64_t shift = s.len_k - s.len_q;
  // The scale folds into the softmax step's max pass unless the cap or ALiBi needs it first.
  const bool scale_in_step = !(transform.softcap > 0.0f) && !transform.mod.has_alibi();
  w.k.resize(size_t(kTileK * dqk));
  w.v.resize(size_t(kTileK * dv));
  w.s.resize(size_t(kTileK * kTileQ));
  // Tile t: positions [i0, i0 + n_pos) of each head, rows = heads * n_pos.
  auto tile_rows = [&](int64_t t, int64_t& i0, int64_t& n_pos) {
    i0 = (tile0 + t) * positions, n_pos = std::min(positions, s.len_q - i0);
    return heads * n_pos;
  };

  int64_t begin[kGroupTiles], end[kGroupTiles], group_begin = s.len_k, group_end = 0;
  for (int64_t t = 0; t < count; ++t) {
    int64_t i0, n_pos;
    const int64_t rows = tile_rows(t, i0, n_pos);
    // Products and the softmax step run over whole vectors of queries: `cols` columns, those past
    // `rows` zero so that their padding scores are finite (a short tile then costs its own size,
    // not a full tile's: a seqlen-1 call spent most of its time clearing 64 columns).
    const int64_t cols = ceil_div(rows, kLanes) * kLanes;
    QueryTile& q = w.tiles[t];
    q.qt.resize(size_t(dqk * kTileQ));
    q.rows.reset(rows, dv);
    // Each row's last vector is zeroed before the loads fill its first `rows` columns (a fill of
    // the padding alone was a library call per row: a sixth of a one-key call's time).
    float* const qt = q.qt.data();  // once: each vector store may alias the vector's own pointer
    for (int64_t d = 0; d < dqk; ++d) store_lanes(qt + d * kTileQ + cols - kLanes, f32xN{});
    for (int64_t e = 0; e < heads; ++e) load_rows_transposed(p, p.q, s, true, h + e, i0, n_pos, dqk, qt + e * n_pos, kTileQ);
    begin[t] = s.mask.tile_begin_key(int(i0));
    end[t] = s.mask.tile_end_key(int(i0 + n_pos));
    if (begin[t] < end[t]) {
      group_begin = std::min(group_begin, begin[t] / kTileK * kTileK);
      group_end = std::max(group_end, end[t]);
    }
  }

  for (int64_t j0 = group_begin; j0 < group_end; j0 += kTileK) {
    const int64_t n = std::min(kTileK, group_end - j0);
    const RowsView k = k_rows.rows(p, s, hk, j0, n, w.k.data());
    const RowsView v = v_rows.rows(p, s, hk, j0, n, w.v.data());
    for (int64_t t = 0; t < count; ++t) {
      if (j0 + n <= begin[t] || j0 >= end[t]) continue;  // no key of this tile is visible
      QueryTile& q = w.tiles[t];
      int64_t i0, n_pos;
      const int64_t rows = tile_rows(t, i0, n_pos), i1 = i0 + n_pos;
      const int64_t cols = ceil_div(rows, kLanes) * kLanes;
      // S^T = K Q^T; only tiles straddling the mask edge pay for masking.
      gemm(k.data, k.ld, 1, q.qt.data(), kTileQ, w.s.data(), kTileQ, n, cols, dqk);
      if (!scale_in_step) {
        for (int64_t j = 0; j < n; ++j) transform.apply(&w.s[size_t(j * kTileQ)], rows, nullptr);
        if (transform.mod.has_alibi())
          for (int64_t j = 0; j < n; ++j)
            ScoreTransform::add_alibi(&w.s[size_t(j * kTileQ)], rows, slope, i0 + shift - (j0 + j), 1);
      }
      if (j0 < s.mask.full_begin_key(int(i1)) || j0 + n > s.mask.full_end_key(int(i0))) {
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t i = i0 + r % n_pos;
          const int64_t lo = std::clamp<int64_t>(s.mask.begin_key(int(i)) - j0, 0, n);
          const int64_t hi = std::clamp<int64_t>(s.mask.end_key(int(i)) - j0, lo, n);
          for (int64_t j = 0; j < lo; ++j) w.s[size_t(j * kTileQ + r)] = -INFINITY;
          for (int64_t j = hi; j < n; ++j) w.s[size_t(j * kTileQ + r)] = -INFINITY;
        }
      }
      online_step(w.s.data(), rows, n, dv, scale_in_step ? transform.scale : 1.0f, q.rows);
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
      gemm_accumulate(w.s.data(), 1, kTileQ, v.data, v.ld, q.rows.acc.data(), dv, rows, dv, n);
    }
  }

  for (int64_t t = 0; t < count; ++t) {
    QueryTile& q = w.tiles[t];
    int64_t i0, n_pos;
    const int64_t rows = tile_rows(t, i0, n_pos);
    float* inv = q.rows.l;  // l is finished: reuse it for 1/l
    for (int64_t r = 0; r < rows; ++r) {
      const float offset = transform.mod.lse_offset(slope, int(i0 + r % n_pos), int(s.len_q), int(s.len_k));
      p.lse[lse_index(p, s, i0 + r % n_pos, h + r / n_pos)] = finish_lse_rounded_once(q.rows.m[r], inv[r], offset);
      inv[r] = inverse_row_sum(inv[r]) * transform.dropout.scale;
    }
    for (int64_t e = 0; e < heads; ++e)
      store_rows(p, p.o, s, true, h + e, i0, n_pos, dv, q.rows.acc.data() + e * n_pos * dv, dv, inv + e * n_pos);
  }
}

// Query heads per tile: a kv group's heads share their tiles where the problem allows it (no
// per-head slope or mask) and their rows fit one tile (max_q * heads <= kTileQ: decoding); halved
// while the tasks would leave threads idle (the keys are not split across tasks).
int64_t packed_heads(const AttentionProblem& p, const ScoreTransform& transform, int64_t max_q, int threads) {
  int64_t heads = p.heads_q / p.heads_kv;
  if (heads == 1 || transform.mod.has_alibi() || transform.dropout.on || max_q * heads > kTileQ) return 1;
  while (heads > 1 && p.batch * (p.heads_q / heads) < 2 * int64_t(threads) && heads % 2 == 0) heads /= 2;
  return heads;
}

// Query tiles per task: kGroupTiles where that still leaves every thread several tasks (uneven
// under causal masks), fewer otherwise.
int64_t group_tiles(int64_t heads_tasks, int64_t tiles, int threads) {
  int64_t g = kGroupTiles;
  while (g > 1 && heads_tasks * ceil_div(tiles, g) < 8 * int64_t(threads)) g /= 2;
  return g;
}

}  // namespace

void forward(const AttentionProblem& problem) {
  std::vector<std::byte> rotated_q;
  const AttentionProblem p = append_kv(problem, rotated_q);
  int64_t max_q, max_k;
  max_lengths(p, max_q, max_k);
  const ScoreTransform transform = ScoreTransform::from(p);
  const double flops = 2.0 * double(p.batch * p.heads_q) * double(max_q) * double(max_k) * double(p.headdim_qk + p.headdim_v);
  const int threads = threads_for(p.num_threads, flops);
  const int64_t heads = packed_heads(p, transform, max_q, threads), head_tasks = p.heads_q / heads;
  const int64_t tiles = ceil_div(max_q, kTileQ / heads);
  const int64_t group = group_tiles(p.batch * head_tasks, tiles, threads), groups = ceil_div(tiles, group);
  // Each key tile is read by every group of query tiles of every tile of heads of its kv head.
  const int64_t readers = groups * (p.heads_q / p.heads_kv / heads);
  const RowPanels k_rows(p, p.k, false, p.heads_kv, p.headdim_qk, readers, threads);
  const RowPanels v_rows(p, p.v, false, p.heads_kv, p.headdim_v, readers, threads);
  parallel_for(p.batch * head_tasks * groups, threads, [&](int64_t task) {
    thread_local ForwardScratch scratch;
    const int64_t g = task % groups, bh = task / groups;
    forward_tiles(p, transform, k_rows, v_rows, bh / head_tasks, bh % head_tasks * heads, heads, g * group, group,
                  scratch);
  });
  if (p.is_varlen()) {
    const CoveredRows covered = covered_rows(p, true);
    zero_uncovered_rows(p, p.o, covered, p.total_q, p.heads_q, p.headdim_v);
    for (int64_t h = 0; h < p.heads_q; ++h) {
      float* lse = p.lse + h * p.total_q;
      std::fill(lse, lse + covered.begin, -INFINITY);
      std::fill(lse + covered.end, lse + p.total_q, -INFINITY);
    }
  }
}

void softmax_matmul(const SoftmaxMatmulProblem& p) {
  const int64_t tiles = ceil_div(p.d1, kTileQ);
  const double flops = 2.0 * double(p.batch) * double(p.d1) * double(p.d2) * double(p.d3);
  parallel_for(p.batch * tiles, threads_for(p.num_threads, flops), [&](int64_t task) {
    thread_local SoftmaxMatmulScratch w;
    const int64_t b = task / tiles, r0 = (task % tiles) * kTileQ;
    const int64_t rows = std::min(kTileQ, p.d1 - r0), dv = p.d3;
    w.s.assign(size_t(kTileK * kTileQ), 0.0f);  // columns past `rows` stay finite
    w.v.resize(size_t(kTileK * dv));
    w.rows.reset(rows, dv);
    for (int64_t c0 = 0; c0 < p.d2; c0 += kTileK) {
      const int64_t n = std::min(kTileK, p.d2 - c0);
      // Each element of X is read once, straight into the key-major score tile.
      for (int64_t i = 0; i < rows; ++i)
        load_elements_strided(p.x, b * p.x_batch_stride + (r0 + i) * p.x_row_stride + c0, p.dtype, n,
                              &w.s[size_t(i)], kTileQ);
      for (int64_t j = 0; j < n; ++j)
        load_elements(p.v, b * p.v_batch_stride + (c0 + j) * p.v_row_stride, p.dtype, dv, &w.v[size_t(j * dv)]);
      online_step(w.s.data(), rows, n, dv, 1.0f, w.rows);
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
