#include "host/validate.hpp"

#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/kv_append.hpp"
#include "tileattn/error.hpp"

namespace tileattn::host {
namespace {

[[noreturn]] void fail(ErrorKind kind, const std::string& message) { throw Error(kind, message); }
[[noreturn]] void invalid(const std::string& message) { fail(ErrorKind::invalid_argument, message); }

std::string str(int64_t v) { return std::to_string(v); }

std::string str(float v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  std::string s = std::to_string(v);
  // to_string prints six decimals; trailing zeros only add noise to a message.
  while (s.size() > 1 && s.back() == '0') s.pop_back();
  if (s.back() == '.') s.pop_back();
  return s;
}

const char* backend_name(Backend b) {
  switch (b) {
    case Backend::automatic: return "automatic";
    case Backend::cpu: return "cpu";
    case Backend::cuda: return "cuda";
  }
  return "?";
}

const char* dtype_name(DType d) {
  switch (d) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
  }
  return "?";
}

void check_dtype(DType dtype, const char* name = "dtype") {
  if (dtype != DType::f32 && dtype != DType::f16 && dtype != DType::bf16) {
    fail(ErrorKind::invalid_type,
         std::string(name) + "=" + str(int64_t(dtype)) + " is not a supported DType (f32=0, f16=1, bf16=2)");
  }
}

void check_fp32_mode(Fp32Mode mode) {
  if (mode != Fp32Mode::exact && mode != Fp32Mode::fast) {
    invalid("fp32_mode=" + str(int64_t(mode)) + " is not a Fp32Mode (exact=0, fast=1)");
  }
}

// Sizes index int32 offsets (cu_seqlens) and kernel grid coordinates, so they stay below 2^31.
void check_size(const char* name, int64_t value) {
  if (value <= 0) invalid(std::string(name) + "=" + str(value) + " must be positive");
  if (value > INT32_MAX) invalid(std::string(name) + "=" + str(value) + " exceeds INT32_MAX");
}

void check_head_dim(const char* name, int64_t value) {
  if (value <= 0) invalid(std::string(name) + "=" + str(value) + " must be positive");
  if (value > kMaxHeadDim) {
    fail(ErrorKind::unsupported,
         std::string(name) + "=" + str(value) + " exceeds " + str(kMaxHeadDim) + ", the largest head dim supported");
  }
}

void check_not_null(const void* p, const std::string& name) {
  if (p == nullptr) invalid(name + " is null");
}

int64_t element_bytes(DType dtype) { return dtype == DType::f32 ? 4 : 2; }

// A pointer off its element alignment faults on the GPU and is undefined behaviour on the CPU.
void check_aligned(const void* p, int64_t alignment, const std::string& name, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % uintptr_t(alignment) != 0) {
    invalid(name + " is not aligned to " + str(alignment) + " bytes (the size of " + what + ")");
  }
}

// One dimension of a strided tensor: the element stride of that dimension and its extent.
struct Dim {
  const char* field;  // e.g. "seq_stride"
  int64_t stride;
  int64_t extent;
  const char* extent_name;  // what sets the extent, e.g. "seqlen_q"
};

int64_t checked_add(int64_t a, int64_t b, const std::string& tensor) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) invalid(tensor + " addresses more than INT64_MAX elements");
  return r;
}

int64_t checked_mul(int64_t a, int64_t b, const std::string& tensor) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) invalid(tensor + " addresses more than INT64_MAX elements");
  return r;
}

// Strides must not be negative, and positive where a dimension has more than one index (a zero
// stride would alias every index of it); a dimension of extent 1 never uses its stride. Inputs
// with `may_broadcast` are exempt from the zero rule: attention reads a tensor expanded over batch
// or heads (k.expand(...), which PyTorch SDPA accepts) as every index reading the same memory.
// The last dimension is contiguous by contract, with extent `inner`; `dims` come innermost first
// (the order ties keep).
//
// Outputs must not overlap themselves, otherwise two threads write one element and results depend
// on timing. The test: sorted by stride, each dimension must step past everything the smaller
// dimensions span. This is sufficient, and for the layouts attention uses (any permutation of
// (batch, seq, head) over a contiguous headdim) also necessary.
//
// Returns the span in elements (the highest index addressed + 1), for checks of aliasing.
int64_t check_strides(const std::string& tensor, int64_t inner, std::vector<Dim> dims, bool is_output,
                      bool may_broadcast = false) {
  for (const Dim& d : dims) {
    if (d.stride < 0) {
      invalid(tensor + "." + d.field + "=" + str(d.stride) + " must not be negative");
    }
    if (!(may_broadcast && !is_output) && d.stride == 0 && d.extent > 1) {
      invalid(tensor + "." + d.field + "=0 must be positive (" + d.extent_name + "=" + str(d.extent) + " > 1)");
    }
  }
  // The highest element addressed must fit in int64 for every backend's offset arithmetic.
  int64_t last = inner - 1;
  for (const Dim& d : dims) last = checked_add(last, checked_mul(d.extent - 1, d.stride, tensor), tensor);

  if (!is_output) return last + 1;
  std::erase_if(dims, [](const Dim& d) { return d.extent <= 1; });
  std::stable_sort(dims.begin(), dims.end(), [](const Dim& a, const Dim& b) { return a.stride < b.stride; });
  int64_t span = inner;  // elements covered by the dimensions already placed
  std::string spanned = "headdim";
  for (const Dim& d : dims) {
    if (d.stride < span) {
      invalid(tensor + "." + d.field + "=" + str(d.stride) + " makes output " + tensor +
              " overlap itself: it must be >= " + str(span) + " (the span of " + spanned + ")");
    }
    span = checked_add(span, checked_mul(d.extent - 1, d.stride, tensor), tensor);
    spanned += std::string(" x ") + d.extent_name;
  }
  return last + 1;
}

// Two byte ranges that must not share memory: the merge reads `b` while it writes `a` in place.
void check_disjoint(const void* a, int64_t a_bytes, const void* b, int64_t b_bytes, const char* a_name,
                    const char* b_name) {
  const auto a0 = reinterpret_cast<uintptr_t>(a), b0 = reinterpret_cast<uintptr_t>(b);
  if (a0 < b0 + uintptr_t(b_bytes) && b0 < a0 + uintptr_t(a_bytes)) {
    invalid(std::string(b_name) + " overlaps " + a_name + " (the merge writes " + a_name + " in place)");
  }
}

// Whether the backend is present (a CUDA build, a visible device) is the dispatcher's question
// (src/host/api.cpp); validation asks nothing of any backend.
void check_backend(Backend backend) {
  if (backend != Backend::cpu && backend != Backend::cuda) {
    if (backend == Backend::automatic) {
      invalid("backend=automatic must be resolved to cpu or cuda before validation");
    }
    invalid("backend=" + str(int64_t(backend)) + " is not a Backend (automatic=0, cpu=1, cuda=2)");
  }
}

void check_requested_backend(Backend requested, Backend resolved) {
  if (requested != Backend::automatic && requested != Backend::cpu && requested != Backend::cuda) {
    invalid("backend=" + str(int64_t(requested)) + " is not a Backend (automatic=0, cpu=1, cuda=2)");
  }
  if (requested != Backend::automatic && requested != resolved) {
    invalid(std::string("backend=") + backend_name(requested) + " was requested but validation was asked for " +
            backend_name(resolved));
  }
}

void check_num_threads(int num_threads) {
  if (num_threads < 0) invalid("num_threads=" + str(int64_t(num_threads)) + " must be >= 0 (0 = all hardware threads)");
}

// cu_seqlens: batch + 1 int32 offsets (host memory) into a buffer of `total` rows, each sequence
// no longer than `max_len`; the first may be past row 0 (rows before it belong to no sequence).
void check_cu_seqlens(const int32_t* host, const char* name, int64_t batch, int64_t total, const char* total_name,
                      int64_t max_len, const char* max_name) {
  const std::string n = name;
  if (host[0] < 0) invalid(n + "[0]=" + str(int64_t(host[0])) + " must be >= 0");
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t lo = host[size_t(b)], hi = host[size_t(b) + 1];
    if (hi < lo) {
      invalid(n + "[" + str(b + 1) + "]=" + str(hi) + " is less than " + n + "[" + str(b) + "]=" + str(lo) +
              " (offsets must be non-decreasing)");
    }
    if (hi - lo > max_len) {
      invalid(n + ": sequence " + str(b) + " has length " + str(hi - lo) + " > " + max_name + "=" + str(max_len) +
              " (" + max_name + " is the maximum length of a variable-length batch)");
    }
  }
  if (host[size_t(batch)] > total) {
    invalid(n + "[" + str(batch) + "]=" + str(int64_t(host[size_t(batch)])) + " exceeds " + total_name + "=" +
            str(total) + " (the rows the buffers hold)");
  }
}

// Appending and the rotary embedding (problem.hpp): what they need and their sizes. The tensors'
// strides are checked with the others.
void check_append(const AttentionProblem& p) {
  if (p.seqlen_new < 0) invalid("seqlen_new=" + str(p.seqlen_new) + " must be >= 0 (0: nothing is appended)");
  if (p.appends()) {
    if (p.seqused_k == nullptr)
      invalid("seqlen_new=" + str(p.seqlen_new) +
              " needs seqused_k (each sequence's key count after the append, which places the new rows)");
    if (p.is_varlen())
      invalid("seqlen_new is set with cu_seqlens (appending applies to fixed-length caches, as in "
              "flash_attn_with_kvcache)");
    if (p.seqlen_new > p.seqlen_k)
      invalid("seqlen_new=" + str(p.seqlen_new) + " exceeds seqlen_k=" + str(p.seqlen_k) + " (the cache row)");
  }
  if (!p.has_rotary()) return;
  if (p.rotary_cos == nullptr || p.rotary_sin == nullptr)
    invalid(std::string(p.rotary_cos ? "rotary_sin" : "rotary_cos") +
            " is null but the other rotary table is set (the rotary embedding needs both)");
  if (p.seqused_k == nullptr)
    invalid("rotary_cos needs seqused_k (rotary positions count from each sequence's cached keys)");
  if (p.is_varlen())
    invalid("rotary_cos is set with cu_seqlens (the rotary embedding applies to fixed-length caches, as in "
            "flash_attn_with_kvcache)");
  if (p.rotary_dim < 2 || p.rotary_dim % 2 != 0 || p.rotary_dim > p.headdim_qk)
    invalid("rotary_dim=" + str(p.rotary_dim) + " must be even and in [2, headdim_qk=" + str(p.headdim_qk) + "]");
  if (p.rotary_seqlen < p.seqlen_k)
    invalid("rotary_seqlen=" + str(p.rotary_seqlen) + " must be >= seqlen_k=" + str(p.seqlen_k) +
            " (a position for every row of the cache)");
  checked_mul(p.rotary_seqlen, p.rotary_dim / 2, "rotary_cos");
  const char* dtype_text = p.dtype == DType::f32 ? "an f32 element" : "an f16/bf16 element";
  check_aligned(p.rotary_cos, element_bytes(p.dtype), "rotary_cos", dtype_text);
  check_aligned(p.rotary_sin, element_bytes(p.dtype), "rotary_sin", dtype_text);
}

// Whether q's rows are rotated each at its own cache position (flash-attn: where the mask is causal or
// local, a side reaching past the cache row (>= seqlen_k) not counting) or all at the first new row.
bool rotary_per_query(const AttentionProblem& p) {
  if (p.rotary_per_query.has_value()) return *p.rotary_per_query;
  auto bounds = [&](int64_t side) { return side >= 0 && side < p.seqlen_k; };
  return p.causal || bounds(p.window_left) || bounds(p.window_right);
}

// The key/value cache fields (problem.hpp): which combinations exist, their sizes, and (where the
// tables can be read) their values. Returns the rows K and V have along their batch dimension.
int64_t check_kv_cache(const AttentionProblem& p, Pass pass, const HostOffsets& t) {
  if (p.num_splits < 0) invalid("num_splits=" + str(int64_t(p.num_splits)) + " must be >= 0 (0 = chosen by the library)");
  check_append(p);
  if (!p.has_kv_cache()) return p.batch;
  if (pass == Pass::backward) {
    fail(ErrorKind::unsupported,
         "seqused_k, leftpad_k, kv_batch_idx and block_table are forward-only (a key/value cache has no backward, "
         "as in flash-attn); pass none of them to backward");
  }
  const bool varlen = p.is_varlen();
  if (varlen && p.leftpad_k) invalid("leftpad_k is set with cu_seqlens (left padding applies to fixed-length caches only)");
  if (varlen && p.kv_batch_idx) invalid("kv_batch_idx is set with cu_seqlens (it selects rows of a fixed-length cache)");
  if (p.is_paged() && p.leftpad_k) invalid("leftpad_k cannot be combined with block_table (as in flash-attn)");
  if (p.is_paged() && p.kv_batch_idx) invalid("kv_batch_idx cannot be combined with block_table (as in flash-attn)");
  const std::pair<const int32_t*, const char*> tables[] = {
      {p.seqused_k, "seqused_k"}, {p.leftpad_k, "leftpad_k"}, {p.kv_batch_idx, "kv_batch_idx"},
      {p.block_table, "block_table"}};
  for (const auto& [ptr, name] : tables)
    if (ptr) check_aligned(ptr, sizeof(int32_t), name, "an int32 entry");

  int64_t kv_rows = p.batch;
  if (p.kv_batch_idx) {
    check_size("kv_batch", p.kv_batch);
    kv_rows = p.kv_batch;
  }
  if (p.is_paged()) {
    check_size("page_size", p.page_size);
    check_size("num_pages", p.num_pages);
    check_size("pages_per_seq", p.pages_per_seq);
    if (p.block_table_stride < p.pages_per_seq)
      invalid("block_table_stride=" + str(p.block_table_stride) + " must be >= pages_per_seq=" + str(p.pages_per_seq));
    checked_mul(p.batch, p.block_table_stride, "block_table");
    if (p.seqlen_k > p.pages_per_seq * p.page_size)
      invalid("seqlen_k=" + str(p.seqlen_k) + " exceeds pages_per_seq * page_size = " +
              str(p.pages_per_seq * p.page_size) + " (the keys a row of block_table can hold)");
    kv_rows = p.num_pages;
  }

  // Values, where readable: each sequence's key range, then the pages it touches.
  const int32_t* cu = varlen ? t.k : nullptr;
  const bool per_query = p.has_rotary() && rotary_per_query(p);
  if (varlen && cu == nullptr) return kv_rows;
  for (int64_t b = 0; b < p.batch; ++b) {
    const std::string at = std::string("[").append(str(b)).append("]");  // ("[" + str(b): GCC 12's false -Wrestrict)
    const int64_t len = varlen ? int64_t(cu[b + 1]) - cu[b] : p.seqlen_k;
    int64_t begin = 0, end = len;
    if (t.leftpad_k) {
      begin = t.leftpad_k[b];
      if (begin < 0 || begin > len)
        invalid("leftpad_k" + at + "=" + str(begin) + " must be in [0, seqlen_k=" + str(len) + "]");
    }
    if (t.seqused_k) {
      end = t.seqused_k[b];
      if (end < begin || end > len)
        invalid("seqused_k" + at + "=" + str(end) + " must be in [" + str(begin) + ", " + str(len) + "] (" +
                (t.leftpad_k ? "from leftpad_k" + at + " to " : std::string("at most ")) +
                (varlen ? "the sequence's length in cu_seqlens_k)" : "seqlen_k)"));
      if (end - begin < p.seqlen_new)
        invalid("seqused_k" + at + "=" + str(end) + " must be >= " +
                (t.leftpad_k ? "leftpad_k" + at + " + seqlen_new = " + str(begin + p.seqlen_new)
                             : "seqlen_new=" + str(p.seqlen_new)) +
                " (the appended rows are each sequence's last seqlen_new keys)");
    }
    // The new keys sit inside the cache row, so inside the table (rotary_seqlen >= seqlen_k); q's rows
    // may reach past both: a causal q of more rows than it appends, or an append of none to a full
    // row. No row of the table is there to rotate them by.
    if (p.has_rotary() && t.seqused_k) {
      const AppendSpan span = append_span(KeySpan{b, begin, int(end - begin), nullptr}, int(p.seqlen_new));
      const int64_t row = per_query ? p.seqlen_q - 1 : 0;
      const int64_t last = query_position(span, int(row), per_query);
      if (last >= p.rotary_seqlen)
        invalid("rotary_cos has rotary_seqlen=" + str(p.rotary_seqlen) + " rows, but query row " + str(row) +
                " of sequence " + str(b) + " is rotated at cache position " + str(last) + " (seqused_k" + at + "=" +
                str(end) + " keys after the append of seqlen_new=" + str(p.seqlen_new) +
                (per_query ? ", each query at its own position under a causal or local mask" : "") +
                "); pass a table of at least " + str(last + 1) + " rows");
    }
    if (t.kv_batch_idx && (t.kv_batch_idx[b] < 0 || t.kv_batch_idx[b] >= p.kv_batch))
      invalid("kv_batch_idx" + at + "=" + str(int64_t(t.kv_batch_idx[b])) + " must be in [0, kv_batch=" +
              str(p.kv_batch) + ")");
    if (t.block_table) {
      const int32_t* row = t.block_table + b * p.block_table_stride;
      for (int64_t i = 0; i < (end + p.page_size - 1) / p.page_size; ++i)
        if (row[i] < 0 || row[i] >= p.num_pages)
          invalid("block_table[" + str(b) + ", " + str(i) + "]=" + str(int64_t(row[i])) + " must be in [0, num_pages=" +
                  str(p.num_pages) + ")");
    }
  }
  return kv_rows;
}

struct TensorSpec {
  const TensorView* view;
  const char* name;
  bool varlen_k;  // K-side row count (seqlen_k / total_k) rather than Q-side
  bool kv_heads;  // heads_kv rather than heads_q
  int64_t headdim;
  bool is_output;
};

// The rules both problem kinds share: backend, dtype, fp32 mode and CPU thread count.
template <class Problem>
void check_execution(const Problem& p, Backend backend) {
  check_backend(backend);
  check_requested_backend(p.backend, backend);
  check_dtype(p.dtype);
  check_fp32_mode(p.fp32_mode);
  check_num_threads(p.num_threads);
}

}  // namespace

AttentionProblem validate_attention(const AttentionProblem& problem, Pass pass, Backend backend,
                                    HostOffsets offsets) {
  const AttentionProblem& p = problem;
  check_execution(p, backend);

  check_size("batch", p.batch);
  check_size("seqlen_q", p.seqlen_q);
  check_size("seqlen_k", p.seqlen_k);
  check_size("heads_q", p.heads_q);
  check_size("heads_kv", p.heads_kv);
  check_head_dim("headdim_qk", p.headdim_qk);
  check_head_dim("headdim_v", p.headdim_v);
  if (p.heads_q % p.heads_kv != 0) {
    invalid("heads_kv=" + str(p.heads_kv) + " must divide heads_q=" + str(p.heads_q) + " (GQA)");
  }

  // ---- variable length: both or neither, and the totals they index --------------------------
  const bool varlen = p.is_varlen();
  if (varlen) {
    if (p.cu_seqlens_q == nullptr) invalid("cu_seqlens_q is null but cu_seqlens_k is set (variable length needs both)");
    if (p.cu_seqlens_k == nullptr) invalid("cu_seqlens_k is null but cu_seqlens_q is set (variable length needs both)");
    check_size("total_q", p.total_q);
    check_size("total_k", p.total_k);
  }

  // ---- key/value cache: on the CPU backend its tables are host memory already -----------------
  if (backend == Backend::cpu) {
    offsets.seqused_k = p.seqused_k, offsets.leftpad_k = p.leftpad_k;
    offsets.kv_batch_idx = p.kv_batch_idx, offsets.block_table = p.block_table;
    if (varlen) offsets.q = p.cu_seqlens_q, offsets.k = p.cu_seqlens_k;
  }
  if (varlen && offsets.q != nullptr && offsets.k != nullptr) {
    check_cu_seqlens(offsets.q, "cu_seqlens_q", p.batch, p.total_q, "total_q", p.seqlen_q, "seqlen_q");
    // A paged K is pages, not total_k rows: its offsets only give lengths.
    check_cu_seqlens(offsets.k, "cu_seqlens_k", p.batch, p.is_paged() ? INT32_MAX : p.total_k, "total_k", p.seqlen_k,
                     "seqlen_k");
  }
  const int64_t kv_rows = check_kv_cache(p, pass, offsets);

  // ---- tensors: presence, memory space, strides ---------------------------------------------
  std::vector<TensorSpec> tensors = {
      {&p.q, "q", false, false, p.headdim_qk, false},
      {&p.k, "k", true, true, p.headdim_qk, p.appends()},  // appending writes the cache
      {&p.v, "v", true, true, p.headdim_v, p.appends()},
      {&p.o, "o", false, false, p.headdim_v, pass == Pass::forward},
  };
  if (pass == Pass::backward) {
    tensors.push_back({&p.dout, "dout", false, false, p.headdim_v, false});
    tensors.push_back({&p.dq, "dq", false, false, p.headdim_qk, true});
    tensors.push_back({&p.dk, "dk", true, true, p.headdim_qk, true});
    tensors.push_back({&p.dv, "dv", true, true, p.headdim_v, true});
  }
  for (const TensorSpec& t : tensors) check_not_null(t.view->data, std::string(t.name) + ".data");
  check_not_null(p.lse, "lse");
  const char* dtype_text = p.dtype == DType::f32 ? "an f32 element" : "an f16/bf16 element";
  for (const TensorSpec& t : tensors) {
    check_aligned(t.view->data, element_bytes(p.dtype), std::string(t.name) + ".data", dtype_text);
  }
  check_aligned(p.lse, sizeof(float), "lse", "an f32 element");
  check_aligned(p.dlse, sizeof(float), "dlse", "an f32 element");
  if (p.softmax_stats != nullptr) {
    if (p.dtype != DType::f32 || backend != Backend::cuda)
      invalid("softmax_stats is for fp32 problems on the CUDA backend (set it to nullptr here)");
    check_aligned(p.softmax_stats, sizeof(float), "softmax_stats", "an f32 element");
  }
  if (varlen) {
    check_aligned(p.cu_seqlens_q, sizeof(int32_t), "cu_seqlens_q", "an int32 offset");
    check_aligned(p.cu_seqlens_k, sizeof(int32_t), "cu_seqlens_k", "an int32 offset");
  }
  checked_mul(checked_mul(varlen ? 1 : p.batch, p.heads_q, "lse"), varlen ? p.total_q : p.seqlen_q, "lse");

  for (const TensorSpec& t : tensors) {
    int64_t rows = varlen ? (t.varlen_k ? p.total_k : p.total_q) : (t.varlen_k ? p.seqlen_k : p.seqlen_q);
    const char* rows_name = varlen ? (t.varlen_k ? "total_k" : "total_q") : (t.varlen_k ? "seqlen_k" : "seqlen_q");
    int64_t batch_rows = p.batch;
    const char* batch_name = "batch";
    // A paged K/V is (num_pages, page_size, heads_kv, dim); a batch-indexed cache has kv_batch rows.
    const bool cache = t.varlen_k && (p.is_paged() || p.kv_batch_idx);
    if (cache && p.is_paged()) rows = p.page_size, rows_name = "page_size";
    if (cache) batch_rows = kv_rows, batch_name = p.is_paged() ? "num_pages" : "kv_batch";
    std::vector<Dim> dims = {
        {"head_stride", t.view->head_stride, t.kv_heads ? p.heads_kv : p.heads_q, t.kv_heads ? "heads_kv" : "heads_q"},
        {"seq_stride", t.view->seq_stride, rows, rows_name},
    };
    if (!varlen || cache) dims.push_back({"batch_stride", t.view->batch_stride, batch_rows, batch_name});
    check_strides(t.name, t.headdim, std::move(dims), t.is_output, /*may_broadcast=*/true);
  }
  if (p.appends()) {
    for (const auto& [view, name, dim] : {std::tuple{&p.k_new, "k_new", p.headdim_qk},
                                          std::tuple{&p.v_new, "v_new", p.headdim_v}}) {
      check_not_null(view->data, std::string(name) + ".data");
      check_aligned(view->data, element_bytes(p.dtype), std::string(name) + ".data", dtype_text);
      check_strides(name, dim,
                    {{"head_stride", view->head_stride, p.heads_kv, "heads_kv"},
                     {"seq_stride", view->seq_stride, p.seqlen_new, "seqlen_new"},
                     {"batch_stride", view->batch_stride, p.batch, "batch"}},
                    false, /*may_broadcast=*/true);
    }
  }

  // ---- options ------------------------------------------------------------------------------
  AttentionProblem n = p;
  if (p.softmax_scale.has_value()) {
    const float s = *p.softmax_scale;
    if (!std::isfinite(s) || s <= 0.0f) invalid("softmax_scale=" + str(s) + " must be finite and > 0");
  } else {
    n.softmax_scale = float(1.0 / std::sqrt(double(p.headdim_qk)));
  }
  if (!std::isfinite(p.softcap) || p.softcap < 0.0f) {
    invalid("softcap=" + str(p.softcap) + " must be finite and >= 0 (0 disables soft-capping)");
  }
  if (p.alibi_slopes != nullptr) {
    check_aligned(p.alibi_slopes, sizeof(float), "alibi_slopes", "an f32 element");
    if (p.alibi_batch_stride < 0) {
      invalid("alibi_batch_stride=" + str(p.alibi_batch_stride) +
              " must be >= 0 (0: one slope per head for the whole batch)");
    }
    checked_mul(p.batch - 1, p.alibi_batch_stride, "alibi_slopes");
  }
  if (!std::isfinite(p.dropout_p) || p.dropout_p < 0.0f || p.dropout_p >= 1.0f) {
    invalid("dropout_p=" + str(p.dropout_p) +
            " must be finite and in [0, 1) (1 would drop every weight; 0 disables dropout)");
  }
  if (p.partial_keys && pass == Pass::forward) {
    invalid("partial_keys is a backward option (o and lse given from more keys than k and v hold); the forward "
            "computes o and lse over its own keys, so pass partial_keys=false to forward");
  }
  if (p.window_left < -1) invalid("window_left=" + str(p.window_left) + " must be >= -1 (-1 = unbounded)");
  if (p.window_right < -1) invalid("window_right=" + str(p.window_right) + " must be >= -1 (-1 = unbounded)");
  // causal sets the right bound to 0 whatever window_right says, and the left bound stays: the
  // rule of flash-attn, whose callers (Mistral, Gemma) pass causal=true with a full window pair.
  // Decided before the clamp below, which would make a side past the cache row look local.
  if (p.has_rotary()) n.rotary_per_query = rotary_per_query(p);
  if (p.causal) n.window_right = 0;
  // A side reaching past every key (left >= seqlen_k) or every query (right >= seqlen_q) masks
  // nothing; it is clamped there so the int32 arithmetic of the shared Mask cannot overflow.
  if (n.window_left > p.seqlen_k) n.window_left = p.seqlen_k;
  if (n.window_right > p.seqlen_q) n.window_right = p.seqlen_q;

  n.backend = backend;
  return n;
}

SoftmaxMatmulProblem validate_softmax_matmul(const SoftmaxMatmulProblem& problem, Backend backend) {
  const SoftmaxMatmulProblem& p = problem;
  check_execution(p, backend);
  check_size("batch", p.batch);
  check_size("d1", p.d1);
  check_size("d2", p.d2);
  check_size("d3", p.d3);

  check_not_null(p.x, "x");
  check_not_null(p.v, "v");
  check_not_null(p.out, "out");
  const char* dtype_text = p.dtype == DType::f32 ? "an f32 element" : "an f16/bf16 element";
  check_aligned(p.x, element_bytes(p.dtype), "x", dtype_text);
  check_aligned(p.v, element_bytes(p.dtype), "v", dtype_text);
  check_aligned(p.out, element_bytes(p.dtype), "out", dtype_text);

  check_strides("x", p.d2,
                {{"row_stride", p.x_row_stride, p.d1, "d1"}, {"batch_stride", p.x_batch_stride, p.batch, "batch"}},
                false);
  check_strides("v", p.d3,
                {{"row_stride", p.v_row_stride, p.d2, "d2"}, {"batch_stride", p.v_batch_stride, p.batch, "batch"}},
                false);
  check_strides("out", p.d3,
                {{"row_stride", p.out_row_stride, p.d1, "d1"}, {"batch_stride", p.out_batch_stride, p.batch, "batch"}},
                true);

  SoftmaxMatmulProblem n = p;
  n.backend = backend;
  return n;
}

bool merge_is_empty(const MergeProblem& p) {
  if (p.backend != Backend::automatic) check_backend(p.backend);
  const std::pair<const char*, int64_t> sizes[] = {
      {"batch", p.batch}, {"seqlen", p.seqlen}, {"heads", p.heads}, {"headdim", p.headdim}};
  for (const auto& [name, v] : sizes) {
    if (v < 0) invalid(std::string(name) + "=" + str(v) + " must be >= 0");
  }
  return p.batch == 0 || p.seqlen == 0 || p.heads == 0 || p.headdim == 0;
}

void validate_merge(const MergeProblem& p, Backend backend) {
  check_backend(backend);
  check_requested_backend(p.backend, backend);
  check_dtype(p.out_dtype, "out_dtype");
  check_dtype(p.out_b_dtype, "out_b_dtype");
  if (p.out_dtype != DType::f32 && p.out_b_dtype != p.out_dtype) {
    fail(ErrorKind::invalid_type, std::string("out_b_dtype=") + dtype_name(p.out_b_dtype) + " must equal out_dtype=" +
                                      dtype_name(p.out_dtype) +
                                      " (a 16-bit accumulator merges its own dtype; use an f32 out to mix)");
  }
  check_num_threads(p.num_threads);

  check_not_null(p.out.data, "out.data");
  check_not_null(p.out_b.data, "out_b.data");
  check_not_null(p.lse, "lse");
  check_not_null(p.lse_b, "lse_b");
  check_aligned(p.out.data, element_bytes(p.out_dtype), "out.data", "its element");
  check_aligned(p.out_b.data, element_bytes(p.out_b_dtype), "out_b.data", "its element");
  check_aligned(p.lse, sizeof(float), "lse", "its element");
  check_aligned(p.lse_b, sizeof(float), "lse_b", "its element");

  // The read side may be expanded (zero strides), as attention's inputs may; out and lse are
  // written in place and must not overlap themselves.
  const auto o_dims = [&](const TensorView& t) {
    return std::vector<Dim>{{"head_stride", t.head_stride, p.heads, "heads"},
                            {"seq_stride", t.seq_stride, p.seqlen, "seqlen"},
                            {"batch_stride", t.batch_stride, p.batch, "batch"}};
  };
  // L's rows are contiguous: lse_head_stride and lse_batch_stride name the fields.
  const auto l_dims = [&](int64_t head_stride, int64_t batch_stride) {
    return std::vector<Dim>{{"head_stride", head_stride, p.heads, "heads"},
                            {"batch_stride", batch_stride, p.batch, "batch"}};
  };
  const int64_t out_bytes =
      checked_mul(check_strides("out", p.headdim, o_dims(p.out), true), element_bytes(p.out_dtype), "out");
  const int64_t out_b_bytes = checked_mul(check_strides("out_b", p.headdim, o_dims(p.out_b), false, true),
                                          element_bytes(p.out_b_dtype), "out_b");
  const int64_t lse_bytes =
      checked_mul(check_strides("lse", p.seqlen, l_dims(p.lse_head_stride, p.lse_batch_stride), true), 4, "lse");
  const int64_t lse_b_bytes = checked_mul(
      check_strides("lse_b", p.seqlen, l_dims(p.lse_b_head_stride, p.lse_b_batch_stride), false, true), 4, "lse_b");

  // Nothing read may share memory with what is written in place: an element would be read after
  // another thread overwrote it, and a row's write must not change what a later row reads.
  check_disjoint(p.out.data, out_bytes, p.out_b.data, out_b_bytes, "out", "out_b");
  check_disjoint(p.lse, lse_bytes, p.lse_b, lse_b_bytes, "lse", "lse_b");
  check_disjoint(p.out.data, out_bytes, p.lse, lse_bytes, "out", "lse");
  check_disjoint(p.out.data, out_bytes, p.lse_b, lse_b_bytes, "out", "lse_b");
  check_disjoint(p.lse, lse_bytes, p.out_b.data, out_b_bytes, "lse", "out_b");
}

}  // namespace tileattn::host
