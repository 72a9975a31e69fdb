// Attention over keys in a cache (AttentionProblem's seqused_k, leftpad_k, kv_batch_idx and
// block_table) equals attention over the same keys laid out densely: the test scatters a dense
// variable-length problem's K and V into a paged cache, or into rows of a larger cache with left
// padding and a batch index, surrounded by random keys that must not be read, and compares the
// forward with the float64 oracle of the dense problem.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

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
  // The dense varlen Q and O (equal lengths, packed rows) read as fixed-length (batch, 4, heads, dim).
  p.cu_seqlens_q = p.cu_seqlens_k = nullptr;
  p.seqlen_q = 4;
  p.seqlen_k = cache_len;
  p.q.batch_stride = 4 * p.q.seq_stride;
  p.o.batch_stride = 4 * p.o.seq_stride;
  std::vector<float> lse(size_t(p.batch * p.heads_q * 4));
  p.lse = lse.data();
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

}  // namespace
}  // namespace tileattn::test
