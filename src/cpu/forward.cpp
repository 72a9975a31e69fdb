// Tiled CPU forward and softmax(X) @ V: one task per (batch, head, query tile); each task walks
// the key tiles its mask leaves non-empty with an online softmax, so no score matrix larger than
// one tile exists and every output element is written by exactly one task.
#include <cmath>
#include <vector>

#include "cpu/cpu_backend.hpp"
#include "cpu/parallel.hpp"
#include "cpu/tile_ops.hpp"

namespace tileattn::cpu {
namespace {

// Running state of kTileQ rows: log2-domain max m, sum l, unnormalised output acc.
struct OnlineRows {
  std::vector<float> m, l, acc;
  void reset(int64_t rows, int64_t dv) {
    m.assign(size_t(rows), -INFINITY);
    l.assign(size_t(rows), 0.0f);
    acc.assign(size_t(rows * dv), 0.0f);
  }
};

// One online-softmax step over a tile of log2-domain scores s (rows x n, ld kTileK), masked
// entries -inf: rescales the running state to the new max and replaces s by the weights
// exp2(s - max), which the caller then multiplies into V.
void online_step(float* s, int64_t rows, int64_t n, int64_t dv, OnlineRows& st) {
  for (int64_t i = 0; i < rows; ++i) {
    float* si = s + i * kTileK;
    float tile_max = -INFINITY;
    for (int64_t j = 0; j < n; ++j) tile_max = std::max(tile_max, si[j]);
    const float m_new = std::max(st.m[size_t(i)], tile_max);
    const float alpha = rescale_factor(st.m[size_t(i)], m_new);
    const float ref = safe_row_max(m_new);
    exp2_row(si, n, ref);
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) sum += si[j];
    st.l[size_t(i)] = st.l[size_t(i)] * alpha + sum;
    st.m[size_t(i)] = m_new;
    if (alpha != 1.0f) {
      float* ai = &st.acc[size_t(i * dv)];
      for (int64_t d = 0; d < dv; ++d) ai[d] *= alpha;
    }
  }
}

struct ForwardScratch {
  std::vector<float> q, kt, v, s;
  OnlineRows rows;
};

void forward_tile(const AttentionProblem& p, const ScoreTransform& transform, int64_t b, int64_t h, int64_t tile,
                  ForwardScratch& w) {
  const Sequence s = sequence(p, b);
  const int64_t i0 = tile * kTileQ;
  if (i0 >= s.len_q) return;
  const int64_t rows = std::min(kTileQ, s.len_q - i0), i1 = i0 + rows;
  const int64_t dqk = p.headdim_qk, dv = p.headdim_v, hk = h / (p.heads_q / p.heads_kv);
  w.q.resize(size_t(kTileQ * dqk));
  w.kt.resize(size_t(dqk * kTileK));
  w.v.resize(size_t(kTileK * dv));
  w.s.resize(size_t(kTileQ * kTileK));
  w.rows.reset(rows, dv);
  load_rows(p, p.q, s, true, h, i0, rows, dqk, w.q.data(), dqk);

  const int64_t key_begin = s.mask.tile_begin_key(int(i0)), key_end = s.mask.tile_end_key(int(i1));
  const int64_t full_begin = s.mask.full_begin_key(int(i1)), full_end = s.mask.full_end_key(int(i0));
  for (int64_t j0 = key_begin; j0 < key_end; j0 += kTileK) {
    const int64_t n = std::min(kTileK, key_end - j0);
    load_rows_transposed(p, p.k, s, false, hk, j0, n, dqk, w.kt.data(), kTileK);
    load_rows(p, p.v, s, false, hk, j0, n, dv, w.v.data(), dv);
    // S = Q K^T in the log2 domain; only tiles straddling the mask edge pay for masking.
    gemm(w.q.data(), dqk, 1, w.kt.data(), kTileK, w.s.data(), kTileK, rows, n, dqk);
    const bool boundary = j0 < full_begin || j0 + n > full_end;
    for (int64_t i = 0; i < rows; ++i) {
      transform.apply(&w.s[size_t(i * kTileK)], n, nullptr);
      if (boundary) mask_row(s.mask, i0 + i, j0, n, &w.s[size_t(i * kTileK)]);
    }
    online_step(w.s.data(), rows, n, dv, w.rows);
    // O += P V
    gemm_accumulate(w.s.data(), kTileK, 1, w.v.data(), dv, w.rows.acc.data(), dv, rows, dv, n);
  }

  std::vector<float>& inv = w.rows.l;  // l is finished: reuse it for 1/l
  for (int64_t i = 0; i < rows; ++i) {
    p.lse[lse_index(p, s, i0 + i, h)] = finish_lse(w.rows.m[size_t(i)], inv[size_t(i)]);
    inv[size_t(i)] = inverse_row_sum(inv[size_t(i)]);
  }
  store_rows(p, p.o, s, true, h, i0, rows, dv, w.rows.acc.data(), dv, inv.data());
}

}  // namespace

void forward(const AttentionProblem& p) {
  int64_t max_q, max_k;
  max_lengths(p, max_q, max_k);
  const int64_t tiles = ceil_div(max_q, kTileQ);
  const ScoreTransform transform = ScoreTransform::from(p);
  parallel_for(p.batch * p.heads_q * tiles, p.num_threads, [&](int64_t task) {
    thread_local ForwardScratch scratch;
    const int64_t tile = task % tiles, bh = task / tiles;
    forward_tile(p, transform, bh / p.heads_q, bh % p.heads_q, tile, scratch);
  });
}

void softmax_matmul(const SoftmaxMatmulProblem& p) {
  const int64_t tiles = ceil_div(p.d1, kTileQ);
  parallel_for(p.batch * tiles, p.num_threads, [&](int64_t task) {
    thread_local ForwardScratch w;
    const int64_t b = task / tiles, r0 = (task % tiles) * kTileQ;
    const int64_t rows = std::min(kTileQ, p.d1 - r0), dv = p.d3;
    w.s.resize(size_t(kTileQ * kTileK));
    w.v.resize(size_t(kTileK * dv));
    w.rows.reset(rows, dv);
    for (int64_t c0 = 0; c0 < p.d2; c0 += kTileK) {
      const int64_t n = std::min(kTileK, p.d2 - c0);
      // Each element of X is read once, straight into the log2-domain score tile.
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < n; ++j)
          w.s[size_t(i * kTileK + j)] =
              load_element(p.x, b * p.x_batch_stride + (r0 + i) * p.x_row_stride + c0 + j, p.dtype) * kLog2e;
      for (int64_t j = 0; j < n; ++j)
        for (int64_t d = 0; d < dv; ++d)
          w.v[size_t(j * dv + d)] = load_element(p.v, b * p.v_batch_stride + (c0 + j) * p.v_row_stride + d, p.dtype);
      online_step(w.s.data(), rows, n, dv, w.rows);
      gemm_accumulate(w.s.data(), kTileK, 1, w.v.data(), dv, w.rows.acc.data(), dv, rows, dv, n);
    }
    for (int64_t i = 0; i < rows; ++i) {
      const float inv = inverse_row_sum(w.rows.l[size_t(i)]);
      for (int64_t d = 0; d < dv; ++d)
        store_element(p.out, b * p.out_batch_stride + (r0 + i) * p.out_row_stride + d, p.dtype,
                      w.rows.acc[size_t(i * dv + d)] * inv);
    }
  });
}

}  // namespace tileattn::cpu
