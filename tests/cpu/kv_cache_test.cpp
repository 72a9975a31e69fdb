// Attention over keys in a cache (AttentionProblem's seqused_k, leftpad_k, kv_batch_idx and
// block_table) equals attention over the same keys laid out densely: the test scatters a dense
// variable-length problem's K and V into a paged cache, or into rows of a larger cache with left
// padding and a batch index, surrounded by random keys that must not be read, and compares the
// forward with the float64 oracle of the dense problem.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "cpu/convert.hpp"
#include "cpu/reference.hpp"
#include "support/host_problem.hpp"
#include "support/metrics.hpp"
#include "tileattn/attention.hpp"

namespace tileattn::test {
namespace {

int64_t element_bytes(DType t) { return t == DType::f32 ? 4 : 2; }

double tolerance(DType t) { return t == DType::f32 ? 2e-5 : t == DType::f16 ? 4e-3 : 3e-2; }

// A cache buffer of `rows` key rows (heads, dim) filled with random values of the dtype.
struct CacheBuffer {
  std::vector<std::byte> bytes;
  int64_t heads, dim, es;
  CacheBuffer(int64_t rows, int64_t heads, int64_t dim, DType dtype, std::mt19937_64& rng)
      : bytes(size_t(rows * heads * dim * element_bytes(dtype))), heads(heads), dim(dim), es(element_bytes(dtype)) {
    for (auto& b : bytes) b = std::byte(rng() % 64);  // finite values of every dtype (exponent bits low)
  }
  // Copies dense row `src_row` of t (all heads) to cache row `dst_row`.
  void put(const HostTensor& t, int64_t src_row, int64_t dst_row) {
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(&bytes[size_t((dst_row * heads + h) * dim * es)],
                  &t.bytes[size_t((src_row * t.view.seq_stride + h * t.view.head_stride) * es)], size_t(dim * es));
  }
  TensorView view(int64_t rows_per_entry) {
    return {bytes.data(), rows_per_entry * heads * dim, heads * dim, dim};
  }
};

ProblemShape dense_shape(DType dtype, bool causal, std::vector<int32_t> len_q, std::vector<int32_t> len_k) {
  ProblemShape s;
  s.seqlens_q = std::move(len_q);
  s.seqlens_k = std::move(len_k);
  s.heads_q = 4;
  s.heads_kv = 2;
  s.headdim_qk = 32;
  s.headdim_v = 24;
  s.dtype = dtype;
  s.causal = causal;
  s.with_backward = false;
  return s;
}

void check_paged(DType dtype, int64_t page_size, bool causal) {
  HostProblem hp(dense_shape(dtype, causal, {3, 1, 5, 2}, {20, 0, 37, 1}));
  const cpu::ReferenceForward want = cpu::reference_forward(hp.problem);
  AttentionProblem p = hp.problem;
  std::mt19937_64 rng(hp.seed);

  const int64_t pages_per_seq = (p.seqlen_k + page_size - 1) / page_size;
  const int64_t num_pages = p.batch * pages_per_seq + 3;  // spare pages nobody references
  std::vector<int32_t> perm(static_cast<size_t>(num_pages));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  const int64_t stride = pages_per_seq + 1;  // a table row wider than its pages
  std::vector<int32_t> table(size_t(p.batch * stride), -1);
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t i = 0; i < pages_per_seq; ++i) table[size_t(b * stride + i)] = perm[size_t(b * pages_per_seq + i)];

  CacheBuffer k(num_pages * page_size, p.heads_kv, p.headdim_qk, dtype, rng);
  CacheBuffer v(num_pages * page_size, p.heads_kv, p.headdim_v, dtype, rng);
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t r = 0; r < hp.cu_seqlens_k[size_t(b) + 1] - hp.cu_seqlens_k[size_t(b)]; ++r) {
      const int64_t dst = table[size_t(b * stride + r / page_size)] * page_size + r % page_size;
      k.put(hp.k, hp.cu_seqlens_k[size_t(b)] + r, dst);
      v.put(hp.v, hp.cu_seqlens_k[size_t(b)] + r, dst);
    }
  p.k = k.view(page_size);
  p.v = v.view(page_size);
  p.block_table = table.data();
  p.block_table_stride = stride;
  p.pages_per_seq = pages_per_seq;
  p.page_size = page_size;
  p.num_pages = num_pages;

  tileattn::forward(p);
  const double tol = tolerance(dtype);
  EXPECT_TRUE(within(hp.o.gather(), want.o, tol, tol)) << "O, page_size " << page_size;
  EXPECT_TRUE(within(hp.gather_lse(), want.lse, tol, tol)) << "L, page_size " << page_size;
}

TEST(KvCache, PagedEqualsDense) {
  for (DType dtype : {DType::f32, DType::bf16})
    for (int64_t page_size : {1, 3, 16, 64})
      for (bool causal : {false, true}) check_paged(dtype, page_size, causal);
}

// The dense varlen problem's Q and O (sequences of seqlen_q rows each, packed) read as
// fixed-length (batch, seqlen_q, heads, dim) over a cache of seqlen_k rows, L in `lse`.
void read_as_fixed_length(AttentionProblem& p, int64_t seqlen_q, int64_t seqlen_k, std::vector<float>& lse) {
  p.cu_seqlens_q = p.cu_seqlens_k = nullptr;
  p.seqlen_q = seqlen_q;
  p.seqlen_k = seqlen_k;
  p.q.batch_stride = seqlen_q * p.q.seq_stride;
  p.o.batch_stride = seqlen_q * p.o.seq_stride;
  lse.assign(size_t(p.batch * p.heads_q * seqlen_q), 0.0f);
  p.lse = lse.data();
}

// Fixed-length queries over rows of a larger cache: sequence b reads cache row batch_idx[b], its
// keys at [leftpad[b], seqused[b]), with random keys before and after.
void check_cache_rows(DType dtype, bool causal) {
  const std::vector<int32_t> len_k{9, 0, 30};
  HostProblem hp(dense_shape(dtype, causal, {4, 4, 4}, len_k));
  const cpu::ReferenceForward want = cpu::reference_forward(hp.problem);
  AttentionProblem p = hp.problem;
  std::mt19937_64 rng(hp.seed);

  const int64_t cache_len = 40, kv_batch = 5;
  const std::vector<int32_t> batch_idx{3, 0, 4}, leftpad{5, 40, 2};
  std::vector<int32_t> seqused(3);
  CacheBuffer k(kv_batch * cache_len, p.heads_kv, p.headdim_qk, dtype, rng);
  CacheBuffer v(kv_batch * cache_len, p.heads_kv, p.headdim_v, dtype, rng);
  for (int64_t b = 0; b < 3; ++b) {
    seqused[size_t(b)] = leftpad[size_t(b)] + len_k[size_t(b)];
    for (int64_t r = 0; r < len_k[size_t(b)]; ++r) {
      const int64_t dst = batch_idx[size_t(b)] * cache_len + leftpad[size_t(b)] + r;
      k.put(hp.k, hp.cu_seqlens_k[size_t(b)] + r, dst);
      v.put(hp.v, hp.cu_seqlens_k[size_t(b)] + r, dst);
    }
  }
  std::vector<float> lse;
  read_as_fixed_length(p, 4, cache_len, lse);
  p.k = k.view(cache_len);
  p.v = v.view(cache_len);
  p.kv_batch_idx = batch_idx.data();
  p.kv_batch = kv_batch;
  p.leftpad_k = leftpad.data();
  p.seqused_k = seqused.data();

  tileattn::forward(p);
  const double tol = tolerance(dtype);
  EXPECT_TRUE(within(hp.o.gather(), want.o, tol, tol)) << "O";
  std::vector<double> got_lse, want_lse;  // (batch, heads, 4) against the oracle's (heads, total_q)
  for (int64_t b = 0; b < 3; ++b)
    for (int64_t h = 0; h < p.heads_q; ++h)
      for (int64_t i = 0; i < 4; ++i) {
        got_lse.push_back(lse[size_t((b * p.heads_q + h) * 4 + i)]);
        want_lse.push_back(want.lse[size_t(h * 12 + b * 4 + i)]);
      }
  EXPECT_TRUE(within(got_lse, want_lse, tol, tol)) << "L";
}

TEST(KvCache, CacheRowsWithLeftpadAndBatchIndexEqualDense) {
  for (DType dtype : {DType::f32, DType::f16})
    for (bool causal : {false, true}) check_cache_rows(dtype, causal);
}

// Appending with the rotary embedding (k_new, v_new, rotary_*): the last `n_new` keys of each
// dense sequence are given as k_new/v_new instead of being in the cache. The forward must write
// them (the keys rotated) into the cache rows [seqused - n_new, seqused), leave every other cache
// row as it was, and attend like the float64 oracle of the dense problem whose new keys and queries
// are rotated at their absolute cache positions (flash-attn's rule: query i at the first new row
// plus i when causal, else every query at the first new row).
void check_append(DType dtype, bool paged, bool interleaved, bool causal) {
  const std::vector<int32_t> len_k{9, 2, 30};
  const int64_t n_new = 2, sq = 4, batch = 3, rotary_dim = 16;
  HostProblem hp(dense_shape(dtype, causal, {4, 4, 4}, len_k));
  AttentionProblem p = hp.problem;
  std::mt19937_64 rng(hp.seed);
  const int64_t hkv = p.heads_kv, hq = p.heads_q, dqk = p.headdim_qk, dv = p.headdim_v;

  // The cache: rows of 40 keys (batch-indexed, left-padded) or pages of 8 (shuffled, spare pages).
  const int64_t cache_len = 40, page_size = 8, pages_per_seq = cache_len / page_size;
  const std::vector<int32_t> batch_idx{3, 0, 4}, leftpad{5, 38, 2};
  const int64_t kv_rows = paged ? (batch * pages_per_seq + 2) * page_size : 5 * cache_len;  // key rows
  std::vector<int32_t> table(size_t(batch * pages_per_seq));
  std::iota(table.begin(), table.end(), 1);
  std::shuffle(table.begin(), table.end(), rng);
  // Cache row (in the buffer's rows of (heads, dim)) of sequence b's key position r.
  auto cache_row = [&](int64_t b, int64_t r) {
    return paged ? table[size_t(b * pages_per_seq + r / page_size)] * page_size + r % page_size
                 : batch_idx[size_t(b)] * cache_len + r;
  };
  CacheBuffer k(kv_rows, hkv, dqk, dtype, rng), v(kv_rows, hkv, dv, dtype, rng);
  std::vector<int32_t> seqused(3);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t pad = paged ? 0 : leftpad[size_t(b)];
    seqused[size_t(b)] = int32_t(pad + len_k[size_t(b)]);
    for (int64_t r = 0; r < len_k[size_t(b)] - n_new; ++r) {
      k.put(hp.k, hp.cu_seqlens_k[size_t(b)] + r, cache_row(b, pad + r));
      v.put(hp.v, hp.cu_seqlens_k[size_t(b)] + r, cache_row(b, pad + r));
    }
  }
  const std::vector<std::byte> k_before = k.bytes, v_before = v.bytes;

  // k_new, v_new (batch, n_new, heads_kv, dim): the dense problem's last keys, not yet rotated.
  CacheBuffer k_new(batch * n_new, hkv, dqk, dtype, rng), v_new(batch * n_new, hkv, dv, dtype, rng);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < n_new; ++i) {
      k_new.put(hp.k, hp.cu_seqlens_k[size_t(b)] + len_k[size_t(b)] - n_new + i, b * n_new + i);
      v_new.put(hp.v, hp.cu_seqlens_k[size_t(b)] + len_k[size_t(b)] - n_new + i, b * n_new + i);
    }

  // Rotary tables in the dtype, as the library reads them, with a position for every query (a
  // causal query past the cache's last row has one).
  const int64_t half = rotary_dim / 2, es = element_bytes(dtype), rotary_seqlen = cache_len + sq;
  std::vector<std::byte> cos_t(size_t(rotary_seqlen * half * es)), sin_t(cos_t.size());
  for (int64_t pos = 0; pos < rotary_seqlen; ++pos)
    for (int64_t f = 0; f < half; ++f) {
      const double angle = double(pos) * std::pow(10000.0, -double(f) / double(half));
      cpu::store_element(cos_t.data(), pos * half + f, dtype, float(std::cos(angle)));
      cpu::store_element(sin_t.data(), pos * half + f, dtype, float(std::sin(angle)));
    }
  // Row `x` (dim doubles) rotated at `pos` in float64, with the tables' rounded values.
  auto rotate_row = [&](double* x, int64_t pos) {
    std::vector<double> r(x, x + rotary_dim);
    for (int64_t f = 0; f < half; ++f) {
      const double c = cpu::load_element(cos_t.data(), pos * half + f, dtype);
      const double s = cpu::load_element(sin_t.data(), pos * half + f, dtype);
      const int64_t a = interleaved ? 2 * f : f, o = interleaved ? 2 * f + 1 : f + half;
      x[a] = r[size_t(a)] * c - r[size_t(o)] * s;
      x[o] = r[size_t(a)] * s + r[size_t(o)] * c;
    }
  };
  std::vector<double> q_rot = hp.q.gather(), k_rot = hp.k.gather();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t start = seqused[size_t(b)] - n_new;  // the first new row's cache position
    for (int64_t i = 0; i < n_new; ++i)
      for (int64_t h = 0; h < hkv; ++h)
        rotate_row(&k_rot[size_t(((hp.cu_seqlens_k[size_t(b)] + len_k[size_t(b)] - n_new + i) * hkv + h) * dqk)],
                   start + i);
    for (int64_t i = 0; i < sq; ++i)
      for (int64_t h = 0; h < hq; ++h) rotate_row(&q_rot[size_t(((b * sq + i) * hq + h) * dqk)], start + (causal ? i : 0));
  }
  const cpu::ReferenceForward want = cpu::reference_forward_dense(hp.problem, q_rot, k_rot, hp.v.gather());

  std::vector<float> lse;
  read_as_fixed_length(p, sq, cache_len, lse);
  p.k = k.view(paged ? page_size : cache_len);
  p.v = v.view(paged ? page_size : cache_len);
  if (paged) {
    p.block_table = table.data();
    p.block_table_stride = p.pages_per_seq = pages_per_seq;
    p.page_size = page_size;
    p.num_pages = kv_rows / page_size;
  } else {
    p.kv_batch_idx = batch_idx.data();
    p.kv_batch = 5;
    p.leftpad_k = leftpad.data();
  }
  p.seqused_k = seqused.data();
  p.k_new = k_new.view(n_new);
  p.v_new = v_new.view(n_new);
  p.seqlen_new = n_new;
  p.rotary_cos = cos_t.data();
  p.rotary_sin = sin_t.data();
  p.rotary_dim = rotary_dim;
  p.rotary_seqlen = rotary_seqlen;
  p.rotary_interleaved = interleaved;
  tileattn::forward(p);

  const double tol = tolerance(dtype);
  EXPECT_TRUE(within(hp.o.gather(), want.o, tol, tol)) << "O";
  // The cache: new rows hold k_new rotated (one rounding: within a unit roundoff of the float64
  // value) and v_new as given; every other byte is as before.
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < n_new; ++i) {
      const int64_t row = cache_row(b, seqused[size_t(b)] - n_new + i);
      const int64_t dense = hp.cu_seqlens_k[size_t(b)] + len_k[size_t(b)] - n_new + i;
      std::vector<double> got, exp;
      for (int64_t h = 0; h < hkv; ++h)
        for (int64_t d = 0; d < dqk; ++d) {
          got.push_back(cpu::load_element(k.bytes.data(), (row * hkv + h) * dqk + d, dtype));
          exp.push_back(k_rot[size_t((dense * hkv + h) * dqk + d)]);
        }
      EXPECT_TRUE(within(got, exp, 2 * unit_roundoff(dtype), 1e-6)) << "k cache row of sequence " << b << ", new row " << i;
      const size_t k_row_bytes = size_t(hkv * dqk * es), v_row_bytes = size_t(hkv * dv * es);
      EXPECT_EQ(0, std::memcmp(&v.bytes[size_t(row) * v_row_bytes], &v_new.bytes[size_t(b * n_new + i) * v_row_bytes],
                               v_row_bytes)) << "v cache row of sequence " << b << ", new row " << i;
      // Marked as expected so the untouched-rows comparison below skips them.
      std::memcpy(&k.bytes[size_t(row) * k_row_bytes], &k_before[size_t(row) * k_row_bytes], k_row_bytes);
      std::memcpy(&v.bytes[size_t(row) * v_row_bytes], &v_before[size_t(row) * v_row_bytes], v_row_bytes);
    }
  EXPECT_TRUE(k.bytes == k_before) << "k cache rows outside the appended ones changed";
  EXPECT_TRUE(v.bytes == v_before) << "v cache rows outside the appended ones changed";
}

TEST(KvCache, AppendWithRotaryEqualsTheDenseProblem) {
  for (DType dtype : {DType::f32, DType::bf16})
    for (bool paged : {false, true})
      for (bool interleaved : {true, false})
        for (bool causal : {false, true}) {
          SCOPED_TRACE(testing::Message() << "paged " << paged << ", interleaved " << interleaved << ", causal " << causal);
          check_append(dtype, paged, interleaved, causal);
        }
}

}  // namespace
}  // namespace tileattn::test
