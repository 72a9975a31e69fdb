#pragma once
// Where the keys (and values) of sequence b lie, for every backend: one range of a dense batch
// entry, a packed (varlen) sequence, a part of a cache row (seqused / leftpad / batch index), or
// pages of a paged cache. Filled once from a validated problem; kernels read it from their params.
//
// Like varlen_range, nothing here trusts the int32 tables: values that validation would refuse
// (it cannot read device memory without a sync) are clamped so every row stays in its buffer.
#include <climits>
#include <cstdint>

#include "common/host_device.hpp"
#include "common/varlen.hpp"
#include "tileattn/problem.hpp"

namespace tileattn {

struct KeyLayout {
  const int32_t* cu_seqlens = nullptr;  // varlen offsets of K (null: fixed length)
  int64_t total = 0;                    // rows of packed K (varlen, unpaged)
  int max_len = 0;                      // seqlen_k: the longest sequence, the cache row's length
  const int32_t* seqused = nullptr;
  const int32_t* leftpad = nullptr;
  const int32_t* batch_idx = nullptr;
  int cache_batch = 0;
  const int32_t* block_table = nullptr;
  int64_t table_stride = 0;
  int page_size = 1, num_pages = 0;
  int page_shift = 0;  // log2(page_size) when a power of two (the common case), else -1

  TA_HOST_DEVICE bool paged() const { return block_table != nullptr; }
  // Page and row within it of key r: shifts for power-of-two pages, integer division else (the
  // division costs more instructions than the copy it addresses).
  TA_HOST_DEVICE int page_of(int r) const { return page_shift >= 0 ? r >> page_shift : r / page_size; }
  TA_HOST_DEVICE int row_in_page(int r) const {
    return page_shift >= 0 ? r & (page_size - 1) : r % page_size;
  }
};

// The keys of one sequence: `len` rows; unpaged, row r is row row0 + r of batch entry `batch`
// (varlen: entry 0 and row0 its packed offset); paged, row r goes through `pages`.
struct KeySpan {
  int64_t batch;
  int64_t row0;
  int len;
  const int32_t* pages;  // this sequence's row of the page table, or nullptr
};

TA_HOST_DEVICE int clamp_to(int64_t x, int64_t lo, int64_t hi) { return int(x < lo ? lo : (x > hi ? hi : x)); }

TA_HOST_DEVICE KeySpan key_span(const KeyLayout& l, int b) {
  KeySpan s{b, 0, l.max_len, nullptr};
  if (l.cu_seqlens) {
    const SeqRange r = varlen_range(l.cu_seqlens, b, l.total, l.max_len);
    s.batch = 0, s.row0 = r.begin, s.len = r.len;
  }
  if (l.batch_idx) s.batch = clamp_to(l.batch_idx[b], 0, l.cache_batch - 1);
  if (l.block_table) s.batch = 0, s.row0 = 0, s.pages = l.block_table + b * l.table_stride;
  const int begin = l.leftpad ? clamp_to(l.leftpad[b], 0, s.len) : 0;
  const int end = l.seqused ? clamp_to(l.seqused[b], begin, s.len) : s.len;
  s.row0 += begin, s.len = end - begin;
  return s;
}

// Element offset of key row r (0 <= r < len) of span s in a tensor of these strides (head 0).
TA_HOST_DEVICE int64_t key_offset(const KeyLayout& l, const KeySpan& s, int r, int64_t batch_stride,
                                  int64_t row_stride) {
  if (s.pages) {
    const int64_t page = clamp_to(s.pages[l.page_of(r)], 0, l.num_pages - 1);
    return page * batch_stride + int64_t(l.row_in_page(r)) * row_stride;
  }
  return s.batch * batch_stride + (s.row0 + r) * row_stride;
}

// The layout of a validated problem's keys.
inline KeyLayout key_layout(const AttentionProblem& p) {
  KeyLayout l;
  l.cu_seqlens = p.cu_seqlens_k;
  // A paged varlen K is pages, not total_k rows: cu_seqlens_k then only gives lengths.
  l.total = p.is_paged() ? INT32_MAX : p.total_k;
  l.max_len = int(p.seqlen_k);
  l.seqused = p.seqused_k, l.leftpad = p.leftpad_k;
  l.batch_idx = p.kv_batch_idx, l.cache_batch = int(p.kv_batch);
  l.block_table = p.block_table, l.table_stride = p.block_table_stride;
  if (p.is_paged()) {
    l.page_size = int(p.page_size), l.num_pages = int(p.num_pages);
    l.page_shift = (l.page_size & (l.page_size - 1)) == 0 ? __builtin_ctz(unsigned(l.page_size)) : -1;
  }
  return l;
}

}  // namespace tileattn
