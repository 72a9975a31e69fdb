// The float64 oracle. Deliberately the textbook algorithm: the full score matrix of one
// (sequence, head), an exact softmax, and the analytic gradient, with no tiling and no online
// rescaling, so that it shares no numerical shortcut with the implementations it judges.
#include "cpu/reference.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/key_rows.hpp"
#include "common/mask.hpp"
#include "common/philox.hpp"
#include "cpu/convert.hpp"
#include "cpu/parallel.hpp"

namespace tileattn::cpu {
namespace {

// Dense rows of each sequence: [q_begin, q_begin + q_len) of the (rows_q, heads, dim) arrays, and
// likewise for keys. Keys read from a cache (problem.hpp) are laid out back to back.
struct Sequences {
  std::vector<int64_t> q_begin, q_len, k_begin, k_len;
  int64_t rows_q = 0, rows_k = 0;
};

Sequences sequences(const AttentionProblem& p) {
  Sequences s;
  const KeyLayout keys = key_layout(p);
  for (int64_t b = 0; b < p.batch; ++b) {
    if (p.is_varlen()) {
      s.q_begin.push_back(p.cu_seqlens_q[b]);
      s.q_len.push_back(p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b]);
    } else {
      s.q_begin.push_back(b * p.seqlen_q);
      s.q_len.push_back(p.seqlen_q);
    }
    const int64_t len = key_span(keys, int(b)).len;
    s.k_begin.push_back(p.has_kv_cache() ? s.rows_k : p.is_varlen() ? p.cu_seqlens_k[b] : b * p.seqlen_k);
    s.k_len.push_back(len);
    if (p.has_kv_cache()) s.rows_k += len;
  }
  s.rows_q = p.is_varlen() ? p.total_q : p.batch * p.seqlen_q;
  if (!p.has_kv_cache()) s.rows_k = p.is_varlen() ? p.total_k : p.batch * p.seqlen_k;
  return s;
}

// Reads a strided tensor into dense (rows, heads, dim) float64; `source(b, i)` is the element
// offset of row i of sequence b (head 0).
template <class Source>
std::vector<double> gather(const AttentionProblem& p, const TensorView& t, const std::vector<int64_t>& begin,
                           const std::vector<int64_t>& len, int64_t rows, int64_t heads, int64_t dim, Source source) {
  std::vector<double> out(size_t(rows * heads * dim), 0.0);
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t i = 0; i < len[b]; ++i) {
      const int64_t row = begin[b] + i, src_row = source(b, i);
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t d = 0; d < dim; ++d)
          out[size_t((row * heads + h) * dim + d)] = load_element(t.data, src_row + h * t.head_stride + d, p.dtype);
    }
  return out;
}

// Query-side tensors (q, o, dout): fixed-length rows of batch entry b, or packed rows.
std::vector<double> gather_q(const AttentionProblem& p, const TensorView& t, const Sequences& s, int64_t heads,
                             int64_t dim) {
  return gather(p, t, s.q_begin, s.q_len, s.rows_q, heads, dim, [&](int64_t b, int64_t i) {
    return p.is_varlen() ? (s.q_begin[b] + i) * t.seq_stride : b * t.batch_stride + i * t.seq_stride;
  });
}

// Key-side tensors (k, v): wherever the problem's key layout puts them.
std::vector<double> gather_k(const AttentionProblem& p, const TensorView& t, const Sequences& s, int64_t dim) {
  const KeyLayout keys = key_layout(p);
  std::vector<KeySpan> spans;
  for (int64_t b = 0; b < p.batch; ++b) spans.push_back(key_span(keys, int(b)));
  return gather(p, t, s.k_begin, s.k_len, s.rows_k, p.heads_kv, dim, [&](int64_t b, int64_t i) {
    return key_offset(keys, spans[size_t(b)], int(i), t.batch_stride, t.seq_stride);
  });
}

// One pass over every (sequence, kv head); the query heads of a GQA group are handled by the
// same task, so each task owns its rows of every output and dK/dV sum without races.
// `given_o` (dense like dout), when set, supplies O for D = rowsum(dO * O) in place of the oracle's
// own P and dP; `given_lse` (L's layout) the L that P = exp(S - L) is taken from, unnormalised.
void run_oracle(const AttentionProblem& p, const std::vector<double>& q, const std::vector<double>& k,
                const std::vector<double>& v, const std::vector<double>* dout, ReferenceForward* fwd,
                ReferenceBackward* bwd, const std::vector<double>* given_o, const std::vector<double>* given_lse) {
  const Sequences seq = sequences(p);
  const int64_t hq = p.heads_q, hkv = p.heads_kv, group = hq / hkv;
  const int64_t dqk = p.headdim_qk, dv = p.headdim_v;
  const double scale = p.softmax_scale ? double(*p.softmax_scale) : 1.0 / std::sqrt(double(dqk));
  const double cap = p.softcap;
  // ALiBi's causal form (flash-attn's causal kernel adds slope * j): L carries slope * (i + sk - sq).
  const bool alibi_causal_form =
      p.alibi_slopes != nullptr && (p.causal || p.window_right == 0) && (p.window_left < 0 || p.window_left >= p.seqlen_k);
  if (fwd) {
    fwd->o.assign(size_t(seq.rows_q * hq * dv), 0.0);
    fwd->lse.assign(size_t(seq.rows_q * hq), -std::numeric_limits<double>::infinity());
  }
  if (bwd) {
    bwd->dq.assign(size_t(seq.rows_q * hq * dqk), 0.0);
    bwd->dk.assign(size_t(seq.rows_k * hkv * dqk), 0.0);
    bwd->dv.assign(size_t(seq.rows_k * hkv * dv), 0.0);
  }

  parallel_for(p.batch * hkv, 0, [&](int64_t task) {
    const int64_t b = task / hkv, hk = task % hkv;
    const int64_t sq = seq.q_len[b], sk = seq.k_len[b], q0 = seq.q_begin[b], k0 = seq.k_begin[b];
    // A window wider than both sequences masks nothing; clamping keeps Mask's int arithmetic exact.
    const int64_t reach = sq + sk;
    Mask mask{int(sq), int(sk), int(std::min(p.window_left, reach)),
              int(p.causal ? 0 : std::min(p.window_right, reach))};
    std::vector<double> pre(size_t(sq * sk)), prob(size_t(sq * sk));
    std::vector<char> seen(size_t(sq * sk));
    // Dropout's factor M / (1 - p) per element (1 without dropout), from philox.hpp's rule.
    std::vector<double> drop(size_t(sq * sk), 1.0);
    const bool dropout = p.dropout_p > 0.0f;
    const uint32_t threshold = dropout ? dropout_threshold(p.dropout_p) : 0;
    const double kept = dropout ? 1.0 / (1.0 - double(p.dropout_p)) : 1.0;
    const uint64_t* state = p.dropout_rng_state;  // host memory here
    const uint64_t seed = state ? state[0] : p.dropout_seed, offset = state ? state[1] : p.dropout_offset;
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      const double slope = p.alibi_slopes ? double(p.alibi_slopes[b * p.alibi_batch_stride + h]) : 0.0;
      auto qrow = [&](int64_t i) { return &q[size_t(((q0 + i) * hq + h) * dqk)]; };
      auto krow = [&](int64_t j) { return &k[size_t(((k0 + j) * hkv + hk) * dqk)]; };
      auto vrow = [&](int64_t j) { return &v[size_t(((k0 + j) * hkv + hk) * dv)]; };
      auto lse_row = [&](int64_t i) { return p.is_varlen() ? h * seq.rows_q + q0 + i : (b * hq + h) * p.seqlen_q + i; };
      if (dropout)
        for (int64_t i = 0; i < sq; ++i)
          for (int64_t j = 0; j < sk; ++j)
            drop[size_t(i * sk + j)] =
                dropout_keep(seed, offset, b, h, hq, i, j, threshold) ? kept : 0.0;
      for (int64_t i = 0; i < sq; ++i) {
        // S = softcap(scale * Q K^T) - slope |i + sk - sq - j|, then P = softmax over the visible keys.
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < sk; ++j) {
          const size_t ij = size_t(i * sk + j);
          seen[ij] = mask.visible(int(i), int(j));
          double s = 0.0;
          for (int64_t d = 0; d < dqk; ++d) s += qrow(i)[d] * krow(j)[d];
          s *= scale;
          pre[ij] = s;
          const double capped = cap > 0.0 ? cap * std::tanh(s / cap) : s;
          prob[ij] = capped - slope * std::abs(double(i + sk - sq - j));
          if (seen[ij]) m = std::max(m, capped);
        }
        const int64_t lse_index = lse_row(i);
        const double alibi_offset = alibi_causal_form ? slope * double(i + sk - sq) : 0.0;
        // With a given L, P = exp(S - L) unnormalised; a row whose L is -inf sees no key (P = 0).
        const double shift = given_lse ? (*given_lse)[size_t(lse_index)] - alibi_offset : m;
        double sum = 0.0;
        for (int64_t j = 0; j < sk; ++j) {
          const size_t ij = size_t(i * sk + j);
          prob[ij] = seen[ij] && std::isfinite(shift) ? std::exp(prob[ij] - shift) : 0.0;
          sum += prob[ij];
        }
        if (!given_lse)
          for (int64_t j = 0; j < sk; ++j) prob[size_t(i * sk + j)] = sum > 0.0 ? prob[size_t(i * sk + j)] / sum : 0.0;
        if (fwd) {
          fwd->lse[size_t(lse_index)] = sum > 0.0 ? m + std::log(sum) + alibi_offset
                                                  : -std::numeric_limits<double>::infinity();
          double* o = &fwd->o[size_t(((q0 + i) * hq + h) * dv)];
          for (int64_t j = 0; j < sk; ++j) {
            const double pij = prob[size_t(i * sk + j)] * drop[size_t(i * sk + j)];
            if (pij != 0.0)
              for (int64_t d = 0; d < dv; ++d) o[d] += pij * vrow(j)[d];
          }
        }
      }
      if (!bwd) continue;
      // With dropout's factor F = M / (1 - p): dV = (P F)^T dO;  dP = (dO V^T) F;
      // dS = P * (dP - rowsum(P * dP) + dL), dL the loss's gradient with respect to L (dlse);
      // through the cap,
      // d(capped)/d(pre) = 1 - tanh^2(pre / cap);  dQ = scale dPre K;  dK = scale dPre^T Q.
      for (int64_t i = 0; i < sq; ++i) {
        const double* go = &(*dout)[size_t(((q0 + i) * hq + h) * dv)];
        std::vector<double> dp(size_t(sk), 0.0);
        double rowsum = 0.0;
        for (int64_t j = 0; j < sk; ++j) {
          const double pij = prob[size_t(i * sk + j)];
          if (pij == 0.0) continue;
          const double f = drop[size_t(i * sk + j)];
          double s = 0.0;
          for (int64_t d = 0; d < dv; ++d) s += go[d] * vrow(j)[d];
          dp[size_t(j)] = s * f;
          rowsum += pij * s * f;
          double* gv = &bwd->dv[size_t(((k0 + j) * hkv + hk) * dv)];
          for (int64_t d = 0; d < dv; ++d) gv[d] += pij * f * go[d];
        }
        if (given_o) {
          const double* o = &(*given_o)[size_t(((q0 + i) * hq + h) * dv)];
          rowsum = 0.0;
          for (int64_t d = 0; d < dv; ++d) rowsum += go[d] * o[d];
        }
        if (p.dlse != nullptr) rowsum -= double(p.dlse[lse_row(i)]);
        double* gq = &bwd->dq[size_t(((q0 + i) * hq + h) * dqk)];
        for (int64_t j = 0; j < sk; ++j) {
          const size_t ij = size_t(i * sk + j);
          if (prob[ij] == 0.0) continue;
          double ds = prob[ij] * (dp[size_t(j)] - rowsum);
          if (cap > 0.0) {
            const double t = std::tanh(pre[ij] / cap);
            ds *= 1.0 - t * t;
          }
          ds *= scale;
          double* gk = &bwd->dk[size_t(((k0 + j) * hkv + hk) * dqk)];
          for (int64_t d = 0; d < dqk; ++d) {
            gq[d] += ds * krow(j)[d];
            gk[d] += ds * qrow(i)[d];
          }
        }
      }
    }
  });
}

}  // namespace

ReferenceForward reference_forward_dense(const AttentionProblem& problem, const std::vector<double>& q,
                                         const std::vector<double>& k, const std::vector<double>& v) {
  ReferenceForward out;
  run_oracle(problem, q, k, v, nullptr, &out, nullptr, nullptr, nullptr);
  return out;
}

ReferenceBackward reference_backward_dense(const AttentionProblem& problem, const std::vector<double>& q,
                                           const std::vector<double>& k, const std::vector<double>& v,
                                           const std::vector<double>& dout, const std::vector<double>* given_o,
                                           const std::vector<double>* given_lse) {
  ReferenceBackward out;
  run_oracle(problem, q, k, v, &dout, nullptr, &out, given_o, given_lse);
  return out;
}

ReferenceForward reference_forward(const AttentionProblem& p) {
  const Sequences s = sequences(p);
  return reference_forward_dense(p, gather_q(p, p.q, s, p.heads_q, p.headdim_qk), gather_k(p, p.k, s, p.headdim_qk),
                                 gather_k(p, p.v, s, p.headdim_v));
}

ReferenceBackward reference_backward(const AttentionProblem& p, OracleDelta delta) {
  const Sequences s = sequences(p);
  std::vector<double> given_o, given_lse;
  if (delta != OracleDelta::exact) given_o = gather_q(p, p.o, s, p.heads_q, p.headdim_v);
  if (delta == OracleDelta::given_stats) given_lse.assign(p.lse, p.lse + s.rows_q * p.heads_q);
  return reference_backward_dense(p, gather_q(p, p.q, s, p.heads_q, p.headdim_qk), gather_k(p, p.k, s, p.headdim_qk),
                                  gather_k(p, p.v, s, p.headdim_v), gather_q(p, p.dout, s, p.heads_q, p.headdim_v),
                                  delta == OracleDelta::exact ? nullptr : &given_o,
                                  delta == OracleDelta::given_stats ? &given_lse : nullptr);
}

std::vector<double> reference_softmax_matmul(const SoftmaxMatmulProblem& p) {
  std::vector<double> out(size_t(p.batch * p.d1 * p.d3), 0.0);
  parallel_for(p.batch * p.d1, 0, [&](int64_t task) {
    const int64_t b = task / p.d1, r = task % p.d1;
    std::vector<double> x(size_t(p.d2));
    double m = -std::numeric_limits<double>::infinity();
    for (int64_t c = 0; c < p.d2; ++c) {
      x[size_t(c)] = load_element(p.x, b * p.x_batch_stride + r * p.x_row_stride + c, p.dtype);
      m = std::max(m, x[size_t(c)]);
    }
    if (m == -std::numeric_limits<double>::infinity()) return;  // every key masked: a zero row
    double sum = 0.0;
    for (auto& e : x) sum += (e = std::exp(e - m));
    double* o = &out[size_t(task * p.d3)];
    for (int64_t c = 0; c < p.d2; ++c) {
      const double w = x[size_t(c)] / sum;
      for (int64_t d = 0; d < p.d3; ++d) o[d] += w * load_element(p.v, b * p.v_batch_stride + c * p.v_row_stride + d, p.dtype);
    }
  });
  return out;
}

}  // namespace tileattn::cpu
