// The key/value cache fields of AttentionProblem (seqused_k, leftpad_k, kv_batch_idx, block_table):
// which combinations exist, their sizes and, where the tables are readable, their values. Each
// broken rule must be an Error naming the field and the rule.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "host/valid_problems.hpp"
#include "host/validate.hpp"

namespace tileattn::test {
namespace {

using host::Pass;
using host::validate_attention;

void expect_fwd_error(const AttentionProblem& p, ErrorKind kind, const std::vector<std::string>& fragments) {
  expect_error([&] { validate_attention(p, Pass::forward, Backend::cpu); }, kind, fragments);
}

// batch 2, seqlen_k 6: a cache row of 6 keys per sequence.
struct CacheCase {
  ValidAttention a;
  std::vector<int32_t> seqused{3, 6}, leftpad{1, 0}, batch_idx{1, 0};
};

TEST(ValidateKvCache, SequsedLeftpadAndBatchIndexPass) {
  CacheCase c;
  c.a.p.seqused_k = c.seqused.data();
  c.a.p.leftpad_k = c.leftpad.data();
  c.a.p.kv_batch_idx = c.batch_idx.data();
  c.a.p.kv_batch = 2;
  EXPECT_NO_THROW(validate_attention(c.a.p, Pass::forward, Backend::cpu));
}

TEST(ValidateKvCache, BackwardIsRefused) {
  CacheCase c;
  c.a.p.seqused_k = c.seqused.data();
  expect_error([&] { validate_attention(c.a.p, Pass::backward, Backend::cpu); }, ErrorKind::unsupported,
               {"seqused_k", "forward-only"});
}

TEST(ValidateKvCache, SequsedPastTheCacheRow) {
  CacheCase c;
  c.seqused[1] = 7;
  c.a.p.seqused_k = c.seqused.data();
  expect_fwd_error(c.a.p, ErrorKind::invalid_argument, {"seqused_k[1]=7", "[0, 6]"});
}

TEST(ValidateKvCache, LeftpadPastSeqused) {
  CacheCase c;
  c.leftpad[0] = 4;
  c.a.p.seqused_k = c.seqused.data();
  c.a.p.leftpad_k = c.leftpad.data();
  expect_fwd_error(c.a.p, ErrorKind::invalid_argument, {"seqused_k[0]=3", "[4, 6]", "leftpad_k[0]"});
}

TEST(ValidateKvCache, BatchIndexOutOfRange) {
  CacheCase c;
  c.batch_idx[0] = 2;
  c.a.p.kv_batch_idx = c.batch_idx.data();
  c.a.p.kv_batch = 2;
  expect_fwd_error(c.a.p, ErrorKind::invalid_argument, {"kv_batch_idx[0]=2", "kv_batch=2"});
}

TEST(ValidateKvCache, BatchIndexNeedsKvBatch) {
  CacheCase c;
  c.a.p.kv_batch_idx = c.batch_idx.data();
  expect_fwd_error(c.a.p, ErrorKind::invalid_argument, {"kv_batch=0", "positive"});
}

TEST(ValidateKvCache, LeftpadWithVarlenIsRefused) {
  CacheCase c;
  c.a.make_varlen({4, 4}, {6, 6});
  c.a.p.leftpad_k = c.leftpad.data();
  expect_fwd_error(c.a.p, ErrorKind::invalid_argument, {"leftpad_k", "cu_seqlens"});
}

TEST(ValidateKvCache, NegativeNumSplits) {
  ValidAttention a;
  a.p.num_splits = -1;
  expect_fwd_error(a.p, ErrorKind::invalid_argument, {"num_splits=-1", ">= 0"});
}

// Paged: K and V are (num_pages=4, page_size=3, heads_kv, dim); each sequence has 2 pages.
struct PagedCase {
  ValidAttention a;
  std::vector<int32_t> table{3, 0, 1, 2};
  PagedCase() {
    AttentionProblem& p = a.p;
    p.block_table = table.data();
    p.pages_per_seq = 2;
    p.block_table_stride = 2;
    p.page_size = 3;
    p.num_pages = 4;
    // The default buffers hold batch 2 x seqlen 6 rows: the same memory as 4 pages of 3 rows.
    for (TensorView* t : {&p.k, &p.v}) t->batch_stride = 3 * t->seq_stride;
  }
};

TEST(ValidateKvCache, PagedPasses) {
  PagedCase c;
  EXPECT_NO_THROW(validate_attention(c.a.p, Pass::forward, Backend::cpu));
}

TEST(ValidateKvCache, PageIndexOutOfRange) {
  PagedCase c;
  c.table[3] = 4;
  expect_fwd_error(c.a.p, ErrorKind::invalid_argument, {"block_table[1, 1]=4", "num_pages=4"});
}

TEST(ValidateKvCache, PagesTooFewForSeqlenK) {
  PagedCase c;
  c.a.p.pages_per_seq = 1;
  expect_fwd_error(c.a.p, ErrorKind::invalid_argument, {"seqlen_k=6", "pages_per_seq * page_size = 3"});
}

TEST(ValidateKvCache, TableRowNarrowerThanItsPages) {
  PagedCase c;
  c.a.p.block_table_stride = 1;
  expect_fwd_error(c.a.p, ErrorKind::invalid_argument, {"block_table_stride=1", "pages_per_seq=2"});
}

TEST(ValidateKvCache, PagedWithBatchIndexIsRefused) {
  PagedCase c;
  std::vector<int32_t> idx{0, 1};
  c.a.p.kv_batch_idx = idx.data();
  c.a.p.kv_batch = 2;
  expect_fwd_error(c.a.p, ErrorKind::invalid_argument, {"kv_batch_idx", "block_table"});
}

TEST(ValidateKvCache, PageStrideOverlappingPagesIsAllowedForInputsButNotZero) {
  PagedCase c;
  c.a.p.k.batch_stride = 0;  // every page the same memory: an input may alias
  EXPECT_NO_THROW(validate_attention(c.a.p, Pass::forward, Backend::cpu));
  c.a.p.k.batch_stride = -1;
  expect_fwd_error(c.a.p, ErrorKind::invalid_argument, {"k.batch_stride=-1", "negative"});
}

// Appending 2 rows to each sequence of CacheCase (seqused 3 and 6 after the append) with rotary
// tables of 6 positions, rotary_dim 4 of headdim_qk 8. k_new/v_new borrow the q/o buffers: their
// values are never read by validation.
struct AppendCase : CacheCase {
  std::vector<float> cos = std::vector<float>(6 * 2), sin = cos;
  AppendCase() {
    AttentionProblem& p = a.p;
    p.seqused_k = seqused.data();
    p.seqlen_new = 2;
    p.k_new = a.p.q, p.v_new = a.p.o;
    p.k_new.head_stride = 8, p.k_new.seq_stride = 16, p.k_new.batch_stride = 32;  // (2, 2, heads_kv 2, 8)
    p.v_new.head_stride = 16, p.v_new.seq_stride = 32, p.v_new.batch_stride = 64;
    p.rotary_cos = cos.data(), p.rotary_sin = sin.data();
    p.rotary_dim = 4, p.rotary_seqlen = 6;
  }
};

TEST(ValidateKvCache, AppendWithRotaryPasses) {
  AppendCase c;
  EXPECT_NO_THROW(validate_attention(c.a.p, Pass::forward, Backend::cpu));
}

TEST(ValidateKvCache, AppendNeedsSequsedK) {
  AppendCase c;
  c.a.p.seqused_k = nullptr;
  c.a.p.rotary_cos = c.a.p.rotary_sin = nullptr;
  expect_fwd_error(c.a.p, ErrorKind::invalid_argument, {"seqlen_new=2", "needs seqused_k"});
}

TEST(ValidateKvCache, AppendWithVarlenIsRefused) {
  AppendCase c;
  c.a.make_varlen({4, 4}, {6, 6});
  expect_fwd_error(c.a.p, ErrorKind::invalid_argument, {"seqlen_new", "cu_seqlens"});
}

TEST(ValidateKvCache, SequsedBelowTheAppendedRows) {
  AppendCase c;
  c.seqused[0] = 1;
  expect_fwd_error(c.a.p, ErrorKind::invalid_argument, {"seqused_k[0]=1", "seqlen_new=2"});
  c.seqused[0] = 2;
  c.a.p.leftpad_k = c.leftpad.data();  // leftpad[0] = 1: the appended rows would start before it
  expect_fwd_error(c.a.p, ErrorKind::invalid_argument, {"seqused_k[0]=2", "leftpad_k[0] + seqlen_new = 3"});
}

TEST(ValidateKvCache, NegativeSeqlenNew) {
  AppendCase c;
  c.a.p.seqlen_new = -1;
  expect_fwd_error(c.a.p, ErrorKind::invalid_argument, {"seqlen_new=-1", ">= 0"});
}

TEST(ValidateKvCache, AppendNeedsTheNewRows) {
  AppendCase c;
  c.a.p.v_new.data = nullptr;
  expect_fwd_error(c.a.p, ErrorKind::invalid_argument, {"v_new.data", "null"});
}

TEST(ValidateKvCache, AppendingWritesTheCacheSoItMayNotAliasItself) {
  AppendCase c;
  c.a.p.k.head_stride = 0;  // accepted for a read-only cache, refused for one being written
  expect_fwd_error(c.a.p, ErrorKind::invalid_argument, {"k.head_stride=0", "must be positive"});
}

TEST(ValidateKvCache, RotaryNeedsBothTables) {
  AppendCase c;
  c.a.p.rotary_sin = nullptr;
  expect_fwd_error(c.a.p, ErrorKind::invalid_argument, {"rotary_sin is null"});
}

TEST(ValidateKvCache, RotaryDimEvenAndWithinTheHeadDim) {
  for (int64_t dim : {0, 3, 10}) {
    AppendCase c;
    c.a.p.rotary_dim = dim;
    expect_fwd_error(c.a.p, ErrorKind::invalid_argument,
                     {"rotary_dim=" + std::to_string(dim), "even", "headdim_qk=8"});
  }
}

TEST(ValidateKvCache, RotaryTableShorterThanTheCache) {
  AppendCase c;
  c.a.p.rotary_seqlen = 5;
  expect_fwd_error(c.a.p, ErrorKind::invalid_argument, {"rotary_seqlen=5", "seqlen_k=6"});
}

TEST(ValidateKvCache, RotaryNeedsSequsedK) {
  AppendCase c;
  c.a.p.seqlen_new = 0;
  c.a.p.seqused_k = nullptr;
  expect_fwd_error(c.a.p, ErrorKind::invalid_argument, {"rotary_cos needs seqused_k"});
}

// Query rows rotated past the table's last row (the new keys never are): under a causal mask
// sequence 1's 4 queries sit at cache positions 4..7 of a 6-row table; and a full cache row
// appending nothing puts every query at position 6. flash-attn reads past its table there.
TEST(ValidateKvCache, RotaryQueriesPastTheTable) {
  AppendCase c;
  c.a.p.causal = true;
  expect_fwd_error(c.a.p, ErrorKind::invalid_argument,
                   {"rotary_seqlen=6", "query row 3 of sequence 1", "cache position 7", "at least 8 rows"});
  c.cos.resize(8 * 2), c.sin.resize(8 * 2);
  c.a.p.rotary_cos = c.cos.data(), c.a.p.rotary_sin = c.sin.data(), c.a.p.rotary_seqlen = 8;
  EXPECT_NO_THROW(validate_attention(c.a.p, Pass::forward, Backend::cpu));

  AppendCase full;
  full.a.p.seqlen_new = 0;
  full.a.p.k_new = full.a.p.v_new = TensorView{};
  expect_fwd_error(full.a.p, ErrorKind::invalid_argument, {"query row 0 of sequence 1", "cache position 6"});
  full.seqused[1] = 5;
  EXPECT_NO_THROW(validate_attention(full.a.p, Pass::forward, Backend::cpu));
}

// flash-attn's rule for where queries are rotated: per query under a causal or local mask, where a
// window side of at least the cache row's length (seqlen_k = 6) masks nothing and does not count.
// (A table of 8 rows: sequence 1's queries reach position 7 where they are rotated per query.)
TEST(ValidateKvCache, RotaryQueriesFollowTheMaskUnlessSet) {
  struct Case {
    bool causal;
    int64_t left, right;
    bool per_query;
  };
  for (const Case& k : {Case{false, -1, -1, false}, Case{true, -1, -1, true}, Case{false, 2, -1, true},
                        Case{false, -1, 0, true}, Case{false, 6, -1, false}, Case{false, -1, 100, false}}) {
    AppendCase c;
    c.cos.resize(8 * 2), c.sin.resize(8 * 2);
    c.a.p.rotary_cos = c.cos.data(), c.a.p.rotary_sin = c.sin.data(), c.a.p.rotary_seqlen = 8;
    c.a.p.causal = k.causal, c.a.p.window_left = k.left, c.a.p.window_right = k.right;
    EXPECT_EQ(validate_attention(c.a.p, Pass::forward, Backend::cpu).rotary_per_query, k.per_query)
        << "causal " << k.causal << ", window (" << k.left << ", " << k.right << ")";
    c.a.p.rotary_per_query = !k.per_query;  // an explicit choice stays
    EXPECT_EQ(validate_attention(c.a.p, Pass::forward, Backend::cpu).rotary_per_query, !k.per_query);
  }
}

}  // namespace
}  // namespace tileattn::test
