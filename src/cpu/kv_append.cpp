#include "cpu/kv_append.hpp"

#include <cstdint>
#include <cstring>

#include "common/kv_append.hpp"
#include "common/key_rows.hpp"
#include "cpu/convert.hpp"

namespace tileattn::cpu {
namespace {

// A table of rotary_dim / 2 angles per cache position; positions past it are clamped (validation
// reads the lengths on the CPU, so only a caller's broken table could reach them).
struct Rotary {
  const void* cos;
  const void* sin;
  int dim;
  int64_t rows;
  bool interleaved;
  DType dtype;

  // Row `src` (headdim elements) rotated at `position` into `dst`.
  void apply(const void* src, void* dst, int64_t headdim, int64_t position) const {
    const int64_t base = clamp_to(position, 0, rows - 1) * (dim / 2);
    for (int j = 0; j < dim; ++j) {
      const RotaryLane lane = rotary_lane(j, dim, interleaved);
      const float c = load_element(cos, base + lane.freq, dtype), s = load_element(sin, base + lane.freq, dtype);
      store_element(dst, j, dtype, rotate(load_element(src, j, dtype), load_element(src, lane.partner, dtype), c, s,
                                          lane.first));
    }
    const int64_t es = dtype_size(dtype);
    std::memcpy(static_cast<std::byte*>(dst) + dim * es, static_cast<const std::byte*>(src) + dim * es,
                size_t((headdim - dim) * es));
  }
};

const std::byte* at(const TensorView& t, int64_t offset, int64_t es) {
  return static_cast<const std::byte*>(t.data) + offset * es;
}

}  // namespace

AttentionProblem append_kv(const AttentionProblem& p, std::vector<std::byte>& rotated_q) {
  if (!p.appends() && !p.has_rotary()) return p;
  const int64_t es = dtype_size(p.dtype);
  const KeyLayout keys = key_layout(p);
  const Rotary rotary{p.rotary_cos, p.rotary_sin, int(p.rotary_dim), p.rotary_seqlen, p.rotary_interleaved, p.dtype};
  AttentionProblem a = p;
  if (p.has_rotary()) {
    rotated_q.resize(size_t(rotated_q_elements(p) * es));
    a.q = rotated_q_view(p, rotated_q.data());
  }
  for (int64_t b = 0; b < p.batch; ++b) {
    const AppendSpan span = append_span(keys, int(b), int(p.seqlen_new));
    for (int i = 0; i < span.count; ++i) {
      for (int64_t h = 0; h < p.heads_kv; ++h) {
        const int64_t row = span.first + i;
        auto* k = static_cast<std::byte*>(p.k.data) +
                  (key_offset(keys, span.keys, int(row), p.k.batch_stride, p.k.seq_stride) + h * p.k.head_stride) * es;
        auto* v = static_cast<std::byte*>(p.v.data) +
                  (key_offset(keys, span.keys, int(row), p.v.batch_stride, p.v.seq_stride) + h * p.v.head_stride) * es;
        const std::byte* k_new = at(p.k_new, b * p.k_new.batch_stride + i * p.k_new.seq_stride + h * p.k_new.head_stride, es);
        const std::byte* v_new = at(p.v_new, b * p.v_new.batch_stride + i * p.v_new.seq_stride + h * p.v_new.head_stride, es);
        if (p.has_rotary()) rotary.apply(k_new, k, p.headdim_qk, span.position + i);
        else std::memcpy(k, k_new, size_t(p.headdim_qk * es));
        std::memcpy(v, v_new, size_t(p.headdim_v * es));
      }
    }
    if (!p.has_rotary()) continue;
    for (int64_t i = 0; i < p.seqlen_q; ++i)
      for (int64_t h = 0; h < p.heads_q; ++h) {
        const std::byte* src = at(p.q, b * p.q.batch_stride + i * p.q.seq_stride + h * p.q.head_stride, es);
        std::byte* dst = static_cast<std::byte*>(a.q.data) + (b * a.q.batch_stride + i * a.q.seq_stride +
                                                              h * a.q.head_stride) * es;
        rotary.apply(src, dst, p.headdim_qk, query_position(span, int(i), *p.rotary_per_query));
      }
  }
  a.seqlen_new = 0;
  a.rotary_cos = a.rotary_sin = nullptr;
  return a;
}

}  // namespace tileattn::cpu
