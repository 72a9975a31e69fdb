#include "support/host_problem.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "cpu/convert.hpp"

namespace tileattn::test {
namespace {

constexpr int64_t kGap = 8;     // elements; keeps 16-byte alignment of rows for 8-aligned dims
constexpr int64_t kGuard = 64;  // poisoned elements after the last one a view can reach

// Signalling-NaN patterns: arithmetic never produces them, so a changed pattern means a write.
constexpr uint32_t kPoison32 = 0x7fa5a5a5u;
constexpr uint16_t kPoison16 = 0x7d5au;   // fp16 signalling NaN
constexpr uint16_t kPoisonBf = 0x7f85u;   // bf16 signalling NaN

const char* dtype_name(DType d) { return d == DType::f32 ? "f32" : d == DType::f16 ? "f16" : "bf16"; }
const char* layout_name(Layout l) { return l == Layout::bshd ? "bshd" : l == Layout::bhsd ? "bhsd" : "padded"; }

bool is_poison(const std::byte* p, DType dtype) {
  if (dtype == DType::f32) {
    uint32_t u;
    std::memcpy(&u, p, 4);
    return u == kPoison32;
  }
  uint16_t u;
  std::memcpy(&u, p, 2);
  return u == (dtype == DType::f16 ? kPoison16 : kPoisonBf);
}

std::vector<int32_t> cumulative(const std::vector<int32_t>& lens) {
  std::vector<int32_t> cu(lens.size() + 1, 0);
  for (size_t i = 0; i < lens.size(); ++i) cu[i + 1] = cu[i] + lens[i];
  return cu;
}

std::string trace_message(uint64_t seed, const std::string& what) {
  std::ostringstream os;
  os << "seed " << seed << " (replay: TILEATTN_TEST_SEED=" << seed << "), " << what;
  return os.str();
}

}  // namespace

uint64_t fresh_seed() {
  if (const char* s = std::getenv("TILEATTN_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  std::random_device rd;
  return (uint64_t(rd()) << 32) ^ rd();
}

std::string ProblemShape::describe() const {
  std::ostringstream os;
  os << dtype_name(dtype) << " " << layout_name(layout) << " b=" << batch << " sq=" << seqlen_q << " sk=" << seqlen_k
     << " hq=" << heads_q << " hkv=" << heads_kv << " d=" << headdim_qk << " dv=" << (headdim_v ? headdim_v : headdim_qk);
  if (!seqlens_q.empty()) {
    os << " varlen q=[";
    for (auto l : seqlens_q) os << l << " ";
    os << "] k=[";
    for (auto l : seqlens_k) os << l << " ";
    os << "]";
  }
  if (causal) os << " causal";
  if (window_left >= 0 || window_right >= 0) os << " window=(" << window_left << "," << window_right << ")";
  if (softcap > 0) os << " softcap=" << softcap;
  if (alibi != Alibi::none) os << (alibi == Alibi::per_head ? " alibi=(heads)" : " alibi=(batch,heads)");
  if (softmax_scale) os << " scale=" << *softmax_scale;
  if (lse_grad) os << " dlse";
  return os.str();
}

std::string SoftmaxMatmulShape::describe() const {
  std::ostringstream os;
  os << dtype_name(dtype) << (padded ? " padded" : "") << " b=" << batch << " d1=" << d1 << " d2=" << d2 << " d3=" << d3
     << " x_scale=" << x_scale;
  if (x_ramp != 0.0f) os << " x_ramp=" << x_ramp;
  if (masked_rows) os << " masked_rows";
  return os.str();
}

HostTensor::HostTensor(DType dtype_, int64_t batch_, int64_t seqlen_, int64_t heads_, int64_t dim_, Layout layout)
    : dtype(dtype_), batch(batch_), seqlen(seqlen_), heads(heads_), dim(dim_) {
  int64_t span = 0;  // elements from the start to one past the last the view can reach
  switch (layout) {
    case Layout::bshd:
      view.head_stride = dim;
      view.seq_stride = heads * dim;
      view.batch_stride = seqlen * heads * dim;
      span = batch * view.batch_stride;
      break;
    case Layout::bhsd:
      view.seq_stride = dim;
      view.head_stride = seqlen * dim;
      view.batch_stride = heads * seqlen * dim;
      span = batch * view.batch_stride;
      break;
    case Layout::padded:
      view.head_stride = (dim + kGap - 1) / kGap * kGap + kGap;
      view.seq_stride = heads * view.head_stride + kGap;
      view.batch_stride = seqlen * view.seq_stride + kGap;
      span = batch * view.batch_stride;
      break;
  }
  bytes.resize(size_t(span + kGuard) * size_t(cpu::dtype_size(dtype)));
  view.data = bytes.data();
  poison();
}

void HostTensor::poison() {
  const int64_t n = elements();
  for (int64_t i = 0; i < n; ++i) {
    if (dtype == DType::f32) {
      std::memcpy(bytes.data() + 4 * i, &kPoison32, 4);
    } else {
      const uint16_t p = dtype == DType::f16 ? kPoison16 : kPoisonBf;
      std::memcpy(bytes.data() + 2 * i, &p, 2);
    }
  }
}

void HostTensor::fill_random(std::mt19937_64& rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t s = 0; s < seqlen; ++s)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t d = 0; d < dim; ++d)
          cpu::store_element(view.data, b * view.batch_stride + s * view.seq_stride + h * view.head_stride + d, dtype,
                             dist(rng));
}

std::vector<double> HostTensor::gather() const {
  std::vector<double> out(size_t(batch * seqlen * heads * dim));
  size_t n = 0;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t s = 0; s < seqlen; ++s)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t d = 0; d < dim; ++d)
          out[n++] = cpu::load_element(view.data, b * view.batch_stride + s * view.seq_stride + h * view.head_stride + d,
                                       dtype);
  return out;
}

void HostTensor::scatter(const std::vector<double>& dense) {
  size_t n = 0;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t s = 0; s < seqlen; ++s)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t d = 0; d < dim; ++d)
          cpu::store_element(view.data, b * view.batch_stride + s * view.seq_stride + h * view.head_stride + d, dtype,
                             float(dense.at(n++)));
}

int64_t HostTensor::touched_outside_view() const {
  std::vector<bool> inside(size_t(elements()), false);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t s = 0; s < seqlen; ++s)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t d = 0; d < dim; ++d)
          inside[size_t(b * view.batch_stride + s * view.seq_stride + h * view.head_stride + d)] = true;
  const int64_t esize = cpu::dtype_size(dtype);
  int64_t touched = 0;
  for (int64_t i = 0; i < elements(); ++i)
    if (!inside[size_t(i)] && !is_poison(bytes.data() + i * esize, dtype)) ++touched;
  return touched;
}

HostProblem::HostProblem(const ProblemShape& shape_)
    : shape(shape_), seed(fresh_seed()), trace_(__FILE__, __LINE__, trace_message(seed, shape_.describe())) {
  const bool varlen = !shape.seqlens_q.empty();
  const int64_t hdv = shape.headdim_v ? shape.headdim_v : shape.headdim_qk;
  int64_t b = shape.batch, sq = shape.seqlen_q, sk = shape.seqlen_k;
  if (varlen) {
    cu_seqlens_q = cumulative(shape.seqlens_q);
    cu_seqlens_k = cumulative(shape.seqlens_k);
    b = int64_t(shape.seqlens_q.size());
    sq = *std::max_element(shape.seqlens_q.begin(), shape.seqlens_q.end());
    sk = *std::max_element(shape.seqlens_k.begin(), shape.seqlens_k.end());
  }
  // Varlen buffers are (total, heads, dim): one "batch" of all tokens.
  const int64_t tb = varlen ? 1 : b;
  const int64_t rq = varlen ? cu_seqlens_q.back() : sq;
  const int64_t rk = varlen ? cu_seqlens_k.back() : sk;
  const DType dt = shape.dtype;
  const Layout lay = shape.layout;
  q = HostTensor(dt, tb, rq, shape.heads_q, shape.headdim_qk, lay);
  k = HostTensor(dt, tb, rk, shape.heads_kv, shape.headdim_qk, lay);
  v = HostTensor(dt, tb, rk, shape.heads_kv, hdv, lay);
  o = HostTensor(dt, tb, rq, shape.heads_q, hdv, lay);
  if (shape.with_backward) {
    dout = HostTensor(dt, tb, rq, shape.heads_q, hdv, lay);
    dq = HostTensor(dt, tb, rq, shape.heads_q, shape.headdim_qk, lay);
    dk = HostTensor(dt, tb, rk, shape.heads_kv, shape.headdim_qk, lay);
    dv = HostTensor(dt, tb, rk, shape.heads_kv, hdv, lay);
  }
  std::mt19937_64 rng(seed);
  q.fill_random(rng);
  k.fill_random(rng);
  v.fill_random(rng);
  if (shape.with_backward) dout.fill_random(rng);

  problem.batch = b;
  problem.seqlen_q = sq;
  problem.seqlen_k = sk;
  problem.heads_q = shape.heads_q;
  problem.heads_kv = shape.heads_kv;
  problem.headdim_qk = shape.headdim_qk;
  problem.headdim_v = hdv;
  problem.dtype = dt;
  problem.q = q.view;
  problem.k = k.view;
  problem.v = v.view;
  problem.o = o.view;
  if (shape.with_backward) {
    problem.dout = dout.view;
    problem.dq = dq.view;
    problem.dk = dk.view;
    problem.dv = dv.view;
  }
  lse.resize(size_t(shape.heads_q * (varlen ? rq : b * sq) + kGuard));
  poison_outputs();
  problem.lse = lse.data();
  if (varlen) {
    problem.cu_seqlens_q = cu_seqlens_q.data();
    problem.cu_seqlens_k = cu_seqlens_k.data();
    problem.total_q = rq;
    problem.total_k = rk;
  }
  problem.softmax_scale = shape.softmax_scale;
  problem.causal = shape.causal;
  problem.window_left = shape.window_left;
  problem.window_right = shape.window_right;
  problem.softcap = shape.softcap;
  problem.num_threads = shape.num_threads;
  if (shape.alibi != ProblemShape::Alibi::none) {
    const bool per_batch = shape.alibi == ProblemShape::Alibi::per_batch_head;
    alibi_slopes.resize(size_t((per_batch ? b : 1) * shape.heads_q));
    std::uniform_real_distribution<float> slope(0.0f, 0.5f);
    for (float& x : alibi_slopes) x = slope(rng);
    problem.alibi_slopes = alibi_slopes.data();
    problem.alibi_batch_stride = per_batch ? shape.heads_q : 0;
  }
  if (shape.with_backward && shape.lse_grad) {
    dlse.resize(size_t(lse_elements()));
    std::normal_distribution<float> normal;
    for (float& x : dlse) x = normal(rng);
    problem.dlse = dlse.data();
  }
}

void HostProblem::poison_outputs() {
  o.poison();
  if (shape.with_backward) {
    dq.poison();
    dk.poison();
    dv.poison();
  }
  std::fill(lse.begin(), lse.end(), std::bit_cast<float>(kPoison32));
}

std::vector<double> HostProblem::gather_lse() const {
  return std::vector<double>(lse.begin(), lse.begin() + lse_elements());
}

int64_t HostProblem::lse_guard_touched() const {
  int64_t touched = 0;
  for (size_t i = size_t(lse_elements()); i < lse.size(); ++i)
    if (std::bit_cast<uint32_t>(lse[i]) != kPoison32) ++touched;
  return touched;
}

HostSoftmaxMatmul::HostSoftmaxMatmul(const SoftmaxMatmulShape& shape_)
    : shape(shape_), seed(fresh_seed()), trace_(__FILE__, __LINE__, trace_message(seed, shape_.describe())) {
  const Layout lay = shape.padded ? Layout::padded : Layout::bshd;
  x = HostTensor(shape.dtype, shape.batch, shape.d1, 1, shape.d2, lay);
  v = HostTensor(shape.dtype, shape.batch, shape.d2, 1, shape.d3, lay);
  out = HostTensor(shape.dtype, shape.batch, shape.d1, 1, shape.d3, lay);
  std::mt19937_64 rng(seed);
  x.fill_random(rng);
  v.fill_random(rng);
  if (shape.x_scale != 1.0f || shape.x_ramp != 0.0f) {
    for (int64_t b = 0; b < x.batch; ++b)
      for (int64_t r = 0; r < x.seqlen; ++r)
        for (int64_t c = 0; c < x.dim; ++c) {
          const int64_t i = b * x.view.batch_stride + r * x.view.seq_stride + c;
          const float value = shape.x_scale * cpu::load_element(x.view.data, i, x.dtype) + shape.x_ramp * float(c);
          cpu::store_element(x.view.data, i, x.dtype, value);
        }
  }
  if (shape.masked_rows) {
    for (int64_t b = 0; b < x.batch; ++b)
      for (int64_t r = 0; r < x.seqlen; ++r)
        for (int64_t c = 0; c < x.dim; ++c)
          if (SoftmaxMatmulShape::row_fully_masked(r) || (r % 5 == 1 && c % 3 == 0))
            cpu::store_element(x.view.data, b * x.view.batch_stride + r * x.view.seq_stride + c, x.dtype, -INFINITY);
  }
  problem.batch = shape.batch;
  problem.d1 = shape.d1;
  problem.d2 = shape.d2;
  problem.d3 = shape.d3;
  problem.dtype = shape.dtype;
  problem.x = x.view.data;
  problem.x_batch_stride = x.view.batch_stride;
  problem.x_row_stride = x.view.seq_stride;
  problem.v = v.view.data;
  problem.v_batch_stride = v.view.batch_stride;
  problem.v_row_stride = v.view.seq_stride;
  problem.out = out.view.data;
  problem.out_batch_stride = out.view.batch_stride;
  problem.out_row_stride = out.view.seq_stride;
  problem.num_threads = shape.num_threads;
}

}  // namespace tileattn::test
