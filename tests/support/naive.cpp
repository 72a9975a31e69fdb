#include "support/naive.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/mask.hpp"
#include "cpu/convert.hpp"

namespace tileattn::test {
namespace {

float round_to_dtype(float x, DType dtype) {
  if (dtype == DType::f16) return cpu::half_to_float(cpu::float_to_half(x));
  if (dtype == DType::bf16) return cpu::bf16_to_float(cpu::float_to_bf16(x));
  return x;
}

// sum_d a[d * sa] * b[d * sb]: one fp32 running sum of fused multiply-adds, as a BLAS
// micro-kernel keeps for each output element.
float dot(const float* a, int64_t sa, const float* b, int64_t sb, int64_t n) {
  float sum = 0.0f;
  for (int64_t d = 0; d < n; ++d) sum = std::fma(a[d * sa], b[d * sb], sum);
  return sum;
}

// dot in runs of `run` terms (run > 0), each run from zero, the runs added in order.
float dot_runs(const float* a, const float* b, int64_t n, int64_t run) {
  if (run <= 0) return dot(a, 1, b, 1, n);
  float sum = 0.0f;
  for (int64_t d0 = 0; d0 < n; d0 += run) sum += dot(a + d0, 1, b + d0, 1, std::min(run, n - d0));
  return sum;
}

// Dense fp32 (rows, heads, dim) copy of a fixed-length tensor.
std::vector<float> gather(const AttentionProblem& p, const TensorView& t, int64_t seqlen, int64_t heads, int64_t dim) {
  std::vector<float> out(size_t(p.batch * seqlen * heads * dim));
  size_t n = 0;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t s = 0; s < seqlen; ++s)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t d = 0; d < dim; ++d)
          out[n++] = cpu::load_element(t.data, b * t.batch_stride + s * t.seq_stride + h * t.head_stride + d, p.dtype);
  return out;
}

}  // namespace

NaiveResult naive_attention(const AttentionProblem& p, const NaiveOptions& options) {
  const int64_t sq = p.seqlen_q, sk = p.seqlen_k, hq = p.heads_q, hkv = p.heads_kv, group = hq / hkv;
  const int64_t dqk = p.headdim_qk, dv = p.headdim_v;
  const DType dt = p.dtype;
  const float scale = p.softmax_scale ? *p.softmax_scale : float(1.0 / std::sqrt(double(dqk)));
  const auto q = gather(p, p.q, sq, hq, dqk), k = gather(p, p.k, sk, hkv, dqk), v = gather(p, p.v, sk, hkv, dv);
  const auto dout = gather(p, p.dout, sq, hq, dv);
  const auto out = options.probs_from_lse ? gather(p, p.o, sq, hq, dv) : std::vector<float>{};
  NaiveResult r;
  r.o.assign(size_t(p.batch * sq * hq * dv), 0.0);
  r.lse.assign(size_t(p.batch * hq * sq), -std::numeric_limits<double>::infinity());
  r.dq.assign(size_t(p.batch * sq * hq * dqk), 0.0);
  std::vector<float> dk(size_t(p.batch * sk * hkv * dqk), 0.0f), dvv(size_t(p.batch * sk * hkv * dv), 0.0f);
  const int64_t reach = sq + sk;
  const Mask mask{int(sq), int(sk), int(std::min(p.window_left, reach)), int(p.causal ? 0 : std::min(p.window_right, reach))};
  std::vector<float> prob(size_t(sq * sk)), ds(size_t(sq * sk));
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < hq; ++h) {
      const int64_t hk = h / group;
      const float* qb = &q[size_t((b * sq * hq + h) * dqk)];
      const float* kb = &k[size_t((b * sk * hkv + hk) * dqk)];
      const float* vb = &v[size_t((b * sk * hkv + hk) * dv)];
      const float* gb = &dout[size_t((b * sq * hq + h) * dv)];
      const int64_t qs = hq * dqk, ks = hkv * dqk, vs = hkv * dv, gs = hq * dv;  // row strides
      for (int64_t i = 0; i < sq; ++i) {
        float* pi = &prob[size_t(i * sk)];
        float m = -INFINITY;
        for (int64_t j = 0; j < sk; ++j) {
          float s = round_to_dtype(round_to_dtype(dot_runs(qb + i * qs, kb + j * ks, dqk, options.score_run), dt) * scale, dt);
          // ALiBi as an additive bias tensor in the dtype, as a framework adds attn_bias.
          if (p.alibi_slopes != nullptr) {
            const float slope = p.alibi_slopes[b * p.alibi_batch_stride + h];
            s = round_to_dtype(s + round_to_dtype(-slope * float(std::abs(i + sk - sq - j)), dt), dt);
          }
          pi[j] = mask.visible(int(i), int(j)) ? s : -INFINITY;
          m = std::max(m, pi[j]);
        }
        if (m == -INFINITY) {
          std::fill(pi, pi + sk, 0.0f);
          continue;
        }
        if (options.probs_from_lse) {
          const float l = p.lse[(b * hq + h) * sq + i];
          for (int64_t j = 0; j < sk; ++j) pi[j] = pi[j] == -INFINITY ? 0.0f : round_to_dtype(std::exp(pi[j] - l), dt);
          continue;
        }
        float sum = 0.0f;
        for (int64_t j = 0; j < sk; ++j) sum += (pi[j] = std::exp(pi[j] - m));
        for (int64_t j = 0; j < sk; ++j) pi[j] = round_to_dtype(pi[j] / sum, dt);
        r.lse[size_t((b * hq + h) * sq + i)] = double(round_to_dtype(m + std::log(sum), dt));
        for (int64_t d = 0; d < dv; ++d)
          r.o[size_t(((b * sq + i) * hq + h) * dv + d)] = round_to_dtype(dot(pi, 1, vb + d, vs, sk), dt);
      }
      for (int64_t i = 0; i < sq; ++i) {
        const float* pi = &prob[size_t(i * sk)];
        float* dsi = &ds[size_t(i * sk)];
        for (int64_t j = 0; j < sk; ++j) dsi[j] = round_to_dtype(dot(gb + i * gs, 1, vb + j * vs, 1, dv), dt);  // dP
        const float* oi = options.probs_from_lse ? &out[size_t(((b * sq + i) * hq + h) * dv)] : nullptr;
        const float dl = p.dlse != nullptr ? p.dlse[(b * hq + h) * sq + i] : 0.0f;
        const float rowsum = round_to_dtype((oi ? dot(gb + i * gs, 1, oi, 1, dv) : dot(pi, 1, dsi, 1, sk)) - dl, dt);
        for (int64_t j = 0; j < sk; ++j) dsi[j] = round_to_dtype(pi[j] * round_to_dtype(dsi[j] - rowsum, dt), dt);
      }
      for (int64_t i = 0; i < sq; ++i)
        for (int64_t d = 0; d < dqk; ++d)
          r.dq[size_t(((b * sq + i) * hq + h) * dqk + d)] =
              round_to_dtype(round_to_dtype(dot(&ds[size_t(i * sk)], 1, kb + d, ks, sk), dt) * scale, dt);
      // GQA: each query head's dK, dV rounded, then summed over the group (as repeat_interleave's
      // gradient does).
      for (int64_t j = 0; j < sk; ++j) {
        for (int64_t d = 0; d < dqk; ++d)
          dk[size_t(((b * sk + j) * hkv + hk) * dqk + d)] +=
              round_to_dtype(round_to_dtype(dot(&ds[size_t(j)], sk, qb + d, qs, sq), dt) * scale, dt);
        for (int64_t d = 0; d < dv; ++d)
          dvv[size_t(((b * sk + j) * hkv + hk) * dv + d)] += round_to_dtype(dot(&prob[size_t(j)], sk, gb + d, gs, sq), dt);
      }
    }
  for (float x : dk) r.dk.push_back(round_to_dtype(x, dt));
  for (float x : dvv) r.dv.push_back(round_to_dtype(x, dt));
  return r;
}

}  // namespace tileattn::test
