// tileattn._ext: the one binding layer. Tensors arrive through DLPack (nb::ndarray), so the module
// never links libtorch. It checks only what AttentionProblem cannot express (ranks, per-tensor
// dtypes and devices, shapes of the tensors the struct sees through a pointer alone, contiguous
// last dimensions); every other rule is the library's (src/host/validate.cpp). tileattn::Error
// becomes ValueError / TypeError / NotImplementedError / RuntimeError by its kind.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/philox.hpp"
#include "tileattn/tileattn.hpp"

namespace nb = nanobind;
using tileattn::Error;
using tileattn::ErrorKind;

namespace {

using Array = nb::ndarray<>;
using OptArray = std::optional<Array>;

[[noreturn]] void fail(ErrorKind kind, const std::string& message) { throw Error(kind, message); }

// Tuple text, "(2, 64, 8)" or "(3,)". Plain std::string + std::to_string on purpose: formatting
// with std::ostringstream inside this module crashed under torch 2.11 built with gcc 13, where
// string concatenation did not.
std::string tuple_text(const int64_t* values, size_t n) {
  std::string s = "(";
  for (size_t i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(values[i]);
  return s + (n == 1 ? ",)" : ")");
}

std::string shape_of(const Array& a) { return tuple_text(a.shape_ptr(), a.ndim()); }

std::string dtype_name(nb::dlpack::dtype t) {
  using Code = nb::dlpack::dtype_code;
  std::string base;
  switch (Code(t.code)) {
    case Code::Int: base = "int"; break;
    case Code::UInt: base = "uint"; break;
    case Code::Float: base = "float"; break;
    case Code::Bfloat: base = "bfloat"; break;
    case Code::Complex: base = "complex"; break;
    case Code::Bool: return "bool";
    default: base = "code" + std::to_string(t.code) + "_"; break;
  }
  return base + std::to_string(t.bits);
}

bool is_cuda(const Array& a) {
  return a.device_type() == nb::device::cuda::value || a.device_type() == nb::device::cuda_managed::value;
}

std::string device_name(const Array& a) {
  if (a.device_type() == nb::device::cpu::value) return "cpu";
  if (is_cuda(a)) return "cuda:" + std::to_string(a.device_id());
  return "device type " + std::to_string(a.device_type());
}

bool same_device(const Array& a, const Array& b) {
  if (a.device_type() == nb::device::cpu::value || b.device_type() == nb::device::cpu::value)
    return a.device_type() == b.device_type();
  return is_cuda(a) == is_cuda(b) && a.device_id() == b.device_id();
}

std::optional<tileattn::DType> dtype_of(const Array& a) {
  using Code = nb::dlpack::dtype_code;
  const auto t = a.dtype();
  if (t.lanes != 1) return std::nullopt;
  if (Code(t.code) == Code::Float && t.bits == 32) return tileattn::DType::f32;
  if (Code(t.code) == Code::Float && t.bits == 16) return tileattn::DType::f16;
  if (Code(t.code) == Code::Bfloat && t.bits == 16) return tileattn::DType::bf16;
  return std::nullopt;
}

// The device every tensor of a call must share; also picks the backend from it.
tileattn::Backend backend_for(const Array& a, const char* name) {
  if (a.device_type() == nb::device::cpu::value) return tileattn::Backend::cpu;
  if (is_cuda(a)) return tileattn::Backend::cuda;
  fail(ErrorKind::invalid_argument,
       std::string(name) + " is on " + device_name(a) + "; tileattn runs on cpu and cuda tensors");
}

// Rank, dtype (one of the attention dtypes and equal to the reference's), device and a contiguous
// last dimension: the checks the problem struct cannot express because it only sees pointers.
void check_operand(const Array& a, const char* name, size_t rank, const char* dims, const Array& ref,
                   const char* ref_name) {
  if (a.ndim() != rank)
    fail(ErrorKind::invalid_argument, std::string(name) + " must have " + std::to_string(rank) +
                                          " dimensions " + dims + ", got shape " + shape_of(a));
  if (!dtype_of(a))
    fail(ErrorKind::invalid_type, std::string(name) + ".dtype=" + dtype_name(a.dtype()) +
                                      " is not supported (float16, bfloat16 or float32)");
  if (&a != &ref) {
    if (a.dtype() != ref.dtype())
      fail(ErrorKind::invalid_type, std::string(name) + ".dtype=" + dtype_name(a.dtype()) + " must equal " +
                                        ref_name + ".dtype=" + dtype_name(ref.dtype()));
    if (!same_device(a, ref))
      fail(ErrorKind::invalid_argument, std::string(name) + " is on " + device_name(a) + " but " + ref_name +
                                            " is on " + device_name(ref) + "; all tensors must share one device");
  }
  if (a.shape(rank - 1) > 1 && a.stride(rank - 1) != 1)
    fail(ErrorKind::invalid_argument, std::string(name) + ".stride(-1)=" + std::to_string(a.stride(rank - 1)) +
                                          " must be 1 (the last dimension must be contiguous)");
}

void check_shape(const Array& a, const char* name, const std::vector<int64_t>& expected, const std::string& why) {
  bool ok = a.ndim() == expected.size();
  for (size_t i = 0; ok && i < expected.size(); ++i) ok = int64_t(a.shape(i)) == expected[i];
  if (ok) return;
  fail(ErrorKind::invalid_argument, std::string(name) + ".shape=" + shape_of(a) + " must be " +
                                        tuple_text(expected.data(), expected.size()) + " " + why);
}

// A dense row-major tensor of the given dtype on the reference's device (lse, cu_seqlens).
void check_aux(const Array& a, const char* name, const std::vector<int64_t>& shape, const std::string& why,
               nb::dlpack::dtype dtype, const char* dtype_text, const Array& ref, const char* ref_name) {
  if (a.dtype() != dtype)
    fail(ErrorKind::invalid_type, std::string(name) + ".dtype=" + dtype_name(a.dtype()) + " must be " + dtype_text);
  if (!same_device(a, ref))
    fail(ErrorKind::invalid_argument, std::string(name) + " is on " + device_name(a) + " but " + ref_name +
                                          " is on " + device_name(ref) + "; all tensors must share one device");
  check_shape(a, name, shape, why);
  int64_t expect = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) > 1 && a.stride(i) != expect)
      fail(ErrorKind::invalid_argument, std::string(name) + " must be contiguous");
    expect *= int64_t(a.shape(i));
  }
}

tileattn::TensorView view_of(const Array& a, bool varlen) {
  tileattn::TensorView t;
  t.data = a.data();
  if (varlen) {
    t.seq_stride = a.stride(0);
    t.head_stride = a.stride(1);
  } else {
    t.batch_stride = a.stride(0);
    t.seq_stride = a.stride(1);
    t.head_stride = a.stride(2);
  }
  return t;
}

std::pair<void*, size_t> workspace_of(const OptArray& w, const Array& ref) {
  if (!w) return {nullptr, 0};
  if (!same_device(*w, ref))
    fail(ErrorKind::invalid_argument, "workspace is on " + device_name(*w) + " but q is on " + device_name(ref));
  if (w->ndim() != 1 || (w->shape(0) > 1 && w->stride(0) != 1))
    fail(ErrorKind::invalid_argument, "workspace must be a contiguous 1-D tensor, got shape " + shape_of(*w));
  return {w->data(), w->nbytes()};
}

const char* backend_name(tileattn::Backend b) {
  switch (b) {
    case tileattn::Backend::cpu: return "cpu";
    case tileattn::Backend::cuda: return "cuda";
    default: return "automatic";
  }
}

constexpr const char* kFixedDims = "(batch, seqlen, heads, headdim)";
constexpr const char* kVarlenDims = "(total_tokens, heads, headdim)";
constexpr const char* kPagedDims = "(num_pages, page_size, heads_kv, headdim) (a paged cache)";

// The scalar options of an attention call, as one object: the Python layer builds one per distinct
// set of options and reuses it, so a call passes no long argument list.
struct Options {
  int64_t max_seqlen_q = 0, max_seqlen_k = 0;
  std::optional<float> softmax_scale;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;
  float softcap = 0.0f;
  bool deterministic = false;
  bool partial_keys = false;  // backward: o and lse cover more keys than k and v (problem.hpp)
  bool fp32_fast = false;
  int num_threads = 0;
  bool check_cu_seqlens = false;
  int num_splits = 0;
  // Attention dropout (problem.hpp); the Python layer draws seed and offset per call.
  float dropout_p = 0.0f;
  uint64_t dropout_seed = 0, dropout_offset = 0;
};

// flash-attn's key/value cache arguments (problem.hpp): each an int32 tensor or None.
struct KvCache {
  OptArray seqused_k, leftpad_k, kv_batch_idx, block_table;
  bool any() const { return seqused_k || leftpad_k || kv_batch_idx || block_table; }
};

// One attention call (forward, and backward when the gradient tensors are given). Holds the
// arrays so that the pointers in `problem_` stay valid for the object's lifetime.
class Attention {
 public:
  Attention(Array q, Array k, Array v, Array out, Array lse, OptArray cu_seqlens_q, OptArray cu_seqlens_k,
            const Options& options, OptArray dout, OptArray dq, OptArray dk, OptArray dv, OptArray alibi_slopes,
            OptArray seqused_k, OptArray leftpad_k, OptArray kv_batch_idx, OptArray block_table,
            OptArray dropout_rng)
      : q_(q), k_(k), v_(v), out_(out), lse_(lse), dout_(dout), dq_(dq), dk_(dk), dv_(dv),
        cu_q_(cu_seqlens_q), cu_k_(cu_seqlens_k), alibi_(alibi_slopes), rng_(dropout_rng),
        cache_{seqused_k, leftpad_k, kv_batch_idx, block_table} {
    const int64_t max_seqlen_q = options.max_seqlen_q, max_seqlen_k = options.max_seqlen_k;
    if (cu_q_.has_value() != cu_k_.has_value())
      fail(ErrorKind::invalid_argument, "cu_seqlens_q and cu_seqlens_k must be given together (variable length)");
    const bool varlen = cu_q_.has_value();
    const size_t rank = varlen ? 3 : 4;
    const char* dims = varlen ? kVarlenDims : kFixedDims;

    // A paged K/V is (num_pages, page_size, heads_kv, headdim) whatever q's layout.
    const bool paged = cache_.block_table.has_value();
    const size_t k_rank = paged ? 4 : rank;
    const char* k_dims = paged ? kPagedDims : dims;
    check_operand(q_, "q", rank, dims, q_, "q");
    check_operand(k_, "k", k_rank, k_dims, q_, "q");
    check_operand(v_, "v", k_rank, k_dims, q_, "q");
    check_operand(out_, "out", rank, dims, q_, "q");
    const bool has_grads = dout_ || dq_ || dk_ || dv_;
    if (has_grads && !(dout_ && dq_ && dk_ && dv_))
      fail(ErrorKind::invalid_argument, "dout, dq, dk and dv must be given together (backward)");
    if (has_grads) {
      check_operand(*dout_, "dout", rank, dims, q_, "q");
      check_operand(*dq_, "dq", rank, dims, q_, "q");
      check_operand(*dk_, "dk", rank, dims, q_, "q");
      check_operand(*dv_, "dv", rank, dims, q_, "q");
    }

    auto dim = [](const Array& a, size_t i) { return int64_t(a.shape(i)); };
    const size_t h = rank - 2, d = rank - 1;  // heads and headdim axes
    const size_t kh = k_rank - 2, kd = k_rank - 1;
    auto& p = problem_;
    p.dtype = *dtype_of(q_);
    p.backend = backend_for(q_, "q");
    p.heads_q = dim(q_, h);
    p.heads_kv = dim(k_, kh);
    p.headdim_qk = dim(q_, d);
    p.headdim_v = dim(v_, kd);

    // k and v share every axis but the last; q and k share batch and headdim.
    std::vector<int64_t> k_shape(k_.shape_ptr(), k_.shape_ptr() + k_rank);
    k_shape[kd] = p.headdim_qk;
    check_shape(k_, "k", k_shape, "(its head dim must equal q.shape[-1])");
    std::vector<int64_t> v_shape = k_shape;
    v_shape[kd] = p.headdim_v;
    check_shape(v_, "v", v_shape, "(all dimensions but the last must equal k's)");
    std::vector<int64_t> o_shape(q_.shape_ptr(), q_.shape_ptr() + rank);
    o_shape[d] = p.headdim_v;
    check_shape(out_, "out", o_shape, "(q's shape with v's head dim)");
    if (has_grads) {
      check_shape(*dout_, "dout", o_shape, "(the shape of out)");
      check_shape(*dq_, "dq", std::vector<int64_t>(q_.shape_ptr(), q_.shape_ptr() + rank), "(the shape of q)");
      check_shape(*dk_, "dk", std::vector<int64_t>(k_.shape_ptr(), k_.shape_ptr() + rank), "(the shape of k)");
      check_shape(*dv_, "dv", std::vector<int64_t>(v_.shape_ptr(), v_.shape_ptr() + rank), "(the shape of v)");
    }

    const auto f32 = nb::dtype<float>();
    if (varlen) {
      const auto i32 = nb::dtype<int32_t>();
      if (cu_q_->ndim() != 1)
        fail(ErrorKind::invalid_argument, "cu_seqlens_q must be 1-D (batch + 1,), got shape " + shape_of(*cu_q_));
      const int64_t n = dim(*cu_q_, 0);
      check_aux(*cu_q_, "cu_seqlens_q", {n}, "(batch + 1 offsets)", i32, "int32", q_, "q");
      check_aux(*cu_k_, "cu_seqlens_k", {n}, "(the shape of cu_seqlens_q)", i32, "int32", q_, "q");
      if (n < 1) fail(ErrorKind::invalid_argument, "cu_seqlens_q must hold batch + 1 >= 1 offsets, got 0");
      p.batch = n - 1;
      p.total_q = dim(q_, 0);
      p.total_k = dim(k_, 0);
      p.seqlen_q = max_seqlen_q;
      p.seqlen_k = max_seqlen_k;
      p.cu_seqlens_q = static_cast<const int32_t*>(cu_q_->data());
      p.cu_seqlens_k = static_cast<const int32_t*>(cu_k_->data());
      check_aux(lse_, "lse", {p.heads_q, p.total_q}, "(heads, total_q)", f32, "float32", q_, "q");
    } else {
      // With kv_batch_idx (or pages) k's first axis is the cache's, not the batch.
      if (!paged && !cache_.kv_batch_idx && dim(k_, 0) != dim(q_, 0))
        fail(ErrorKind::invalid_argument, "k.shape[0]=" + std::to_string(dim(k_, 0)) + " must equal q.shape[0]=" +
                                              std::to_string(dim(q_, 0)) + " (batch)");
      p.batch = dim(q_, 0);
      p.seqlen_q = dim(q_, 1);
      p.seqlen_k = dim(k_, 1);
      check_aux(lse_, "lse", {p.batch, p.heads_q, p.seqlen_q}, "(batch, heads, seqlen_q)", f32, "float32", q_, "q");
    }

    p.q = view_of(q_, varlen);
    p.k = view_of(k_, varlen && !paged);
    p.v = view_of(v_, varlen && !paged);
    if (cache_.any()) set_cache(varlen);
    p.o = view_of(out_, varlen);
    p.lse = static_cast<float*>(lse_.data());
    if (has_grads) {
      p.dout = view_of(*dout_, varlen);
      p.dq = view_of(*dq_, varlen);
      p.dk = view_of(*dk_, varlen);
      p.dv = view_of(*dv_, varlen);
    }
    if (alibi_) set_alibi(*alibi_);
    p.softmax_scale = options.softmax_scale;
    p.causal = options.causal;
    p.window_left = options.window_left;
    p.window_right = options.window_right;
    p.softcap = options.softcap;
    p.deterministic = options.deterministic;
    p.partial_keys = options.partial_keys;
    p.fp32_mode = options.fp32_fast ? tileattn::Fp32Mode::fast : tileattn::Fp32Mode::exact;
    p.num_threads = options.num_threads;
    p.check_cu_seqlens = options.check_cu_seqlens;
    p.num_splits = options.num_splits;
    p.dropout_p = options.dropout_p;
    p.dropout_seed = options.dropout_seed;
    p.dropout_offset = options.dropout_offset;
    if (rng_) set_dropout_rng(*rng_);
  }

  // Validates and plans the call once (kernel, split count, workspace size, tensor maps) for the
  // stream it will run on, and returns the workspace size the run needs; run() then executes
  // that plan. The stream matters to planning: the opt-in cu_seqlens check reads on it.
  size_t plan_forward(uintptr_t stream) {
    plan_ = tileattn::plan_forward(with_stream(stream));
    return plan_->workspace_size();
  }
  size_t plan_backward(uintptr_t stream) {
    require_grads();
    plan_ = tileattn::plan_backward(with_stream(stream));
    return plan_->workspace_size();
  }

  void run(OptArray workspace) {
    if (!plan_) fail(ErrorKind::invalid_argument, "run() needs plan_forward() or plan_backward() first");
    auto [data, bytes] = workspace_of(workspace, q_);
    nb::gil_scoped_release release;
    plan_->run(data, bytes);
  }

  std::string backend() const { return backend_name(problem_.backend); }

 private:
  // flash-attn's alibi_slopes: fp32, (heads_q,) or (batch, heads_q), last dim contiguous; a batch
  // stride of 0 (expand) shares one row of slopes.
  void set_alibi(const Array& a) {
    auto& p = problem_;
    if (a.dtype() != nb::dtype<float>())
      fail(ErrorKind::invalid_type, "alibi_slopes.dtype=" + dtype_name(a.dtype()) + " must be float32");
    if (!same_device(a, q_))
      fail(ErrorKind::invalid_argument, "alibi_slopes is on " + device_name(a) + " but q is on " + device_name(q_) +
                                            "; all tensors must share one device");
    const bool per_batch = a.ndim() == 2;
    if (!(a.ndim() == 1 && int64_t(a.shape(0)) == p.heads_q) &&
        !(per_batch && int64_t(a.shape(0)) == p.batch && int64_t(a.shape(1)) == p.heads_q))
      fail(ErrorKind::invalid_argument, "alibi_slopes.shape=" + shape_of(a) + " must be (heads,)=(" +
                                            std::to_string(p.heads_q) + ",) or (batch, heads)=(" +
                                            std::to_string(p.batch) + ", " + std::to_string(p.heads_q) + ")");
    const size_t last = a.ndim() - 1;
    if (a.shape(last) > 1 && a.stride(last) != 1)
      fail(ErrorKind::invalid_argument, "alibi_slopes.stride(-1)=" + std::to_string(a.stride(last)) +
                                            " must be 1 (the last dimension must be contiguous)");
    p.alibi_slopes = static_cast<const float*>(a.data());
    p.alibi_batch_stride = per_batch && a.shape(0) > 1 ? int64_t(a.stride(0)) : 0;
  }

  // dropout_rng: the call's {seed, offset} as two int64 on q's device (their bits read as uint64),
  // read when the kernels run (problem.hpp's dropout_rng_state), in place of the options' pair.
  void set_dropout_rng(const Array& a) {
    if (a.dtype() != nb::dtype<int64_t>())
      fail(ErrorKind::invalid_type, "dropout_rng.dtype=" + dtype_name(a.dtype()) + " must be int64");
    if (!same_device(a, q_))
      fail(ErrorKind::invalid_argument, "dropout_rng is on " + device_name(a) + " but q is on " + device_name(q_) +
                                            "; all tensors must share one device");
    if (a.ndim() != 1 || a.shape(0) != 2 || a.stride(0) != 1)
      fail(ErrorKind::invalid_argument, "dropout_rng.shape=" + shape_of(a) + " must be (2,) and contiguous");
    problem_.dropout_rng_state = static_cast<const uint64_t*>(a.data());
  }

  // The cache tables: int32, contiguous, on q's device; (batch,) each, block_table (batch, pages).
  void set_cache(bool varlen) {
    auto& p = problem_;
    const auto i32 = nb::dtype<int32_t>();
    auto per_sequence = [&](const OptArray& a, const char* name) -> const int32_t* {
      if (!a) return nullptr;
      check_aux(*a, name, {p.batch}, "(one entry per sequence)", i32, "int32", q_, "q");
      return static_cast<const int32_t*>(a->data());
    };
    p.seqused_k = per_sequence(cache_.seqused_k, "seqused_k");
    p.leftpad_k = per_sequence(cache_.leftpad_k, "leftpad_k");
    p.kv_batch_idx = per_sequence(cache_.kv_batch_idx, "kv_batch_idx");
    if (p.kv_batch_idx) p.kv_batch = int64_t(k_.shape(0));
    if (const OptArray& t = cache_.block_table) {
      if (t->dtype() != i32)
        fail(ErrorKind::invalid_type, "block_table.dtype=" + dtype_name(t->dtype()) + " must be int32");
      if (!same_device(*t, q_))
        fail(ErrorKind::invalid_argument, "block_table is on " + device_name(*t) + " but q is on " + device_name(q_) +
                                              "; all tensors must share one device");
      if (t->ndim() != 2 || int64_t(t->shape(0)) != p.batch)
        fail(ErrorKind::invalid_argument, "block_table.shape=" + shape_of(*t) + " must be (batch, max_pages) with batch=" +
                                              std::to_string(p.batch));
      if (t->shape(1) > 1 && t->stride(1) != 1)
        fail(ErrorKind::invalid_argument, "block_table.stride(-1)=" + std::to_string(t->stride(1)) +
                                              " must be 1 (the last dimension must be contiguous)");
      p.block_table = static_cast<const int32_t*>(t->data());
      p.pages_per_seq = int64_t(t->shape(1));
      p.block_table_stride = t->shape(0) > 1 ? int64_t(t->stride(0)) : p.pages_per_seq;
      p.num_pages = int64_t(k_.shape(0));
      p.page_size = int64_t(k_.shape(1));
      // Fixed length: every sequence may reach its whole row of pages. Varlen: total_k is unused
      // for pages; the key rows the cache holds stand in for it.
      if (!varlen) p.seqlen_k = p.pages_per_seq * p.page_size;
      else p.total_k = p.num_pages * p.page_size;
    }
  }

  void require_grads() const {
    if (!dout_) fail(ErrorKind::invalid_argument, "backward needs dout, dq, dk and dv");
  }

  tileattn::AttentionProblem with_stream(uintptr_t stream) const {
    auto p = problem_;
    p.stream = reinterpret_cast<void*>(stream);
    return p;
  }

  Array q_, k_, v_, out_, lse_;
  OptArray dout_, dq_, dk_, dv_, cu_q_, cu_k_, alibi_, rng_;
  KvCache cache_;
  tileattn::AttentionProblem problem_;
  std::optional<tileattn::Plan> plan_;
};

// out = softmax(x, dim=-1) @ v for x (batch, d1, d2), v (batch, d2, d3), out (batch, d1, d3).
class SoftmaxMatmul {
 public:
  SoftmaxMatmul(Array x, Array v, Array out, bool fp32_fast, int num_threads) : x_(x), v_(v), out_(out) {
    check_operand(x_, "x", 3, "(batch, d1, d2)", x_, "x");
    check_operand(v_, "v", 3, "(batch, d2, d3)", x_, "x");
    check_operand(out_, "out", 3, "(batch, d1, d3)", x_, "x");
    auto& p = problem_;
    p.batch = int64_t(x_.shape(0));
    p.d1 = int64_t(x_.shape(1));
    p.d2 = int64_t(x_.shape(2));
    p.d3 = int64_t(v_.shape(2));
    check_shape(v_, "v", {p.batch, p.d2, p.d3}, "(batch and d2 from x.shape)");
    check_shape(out_, "out", {p.batch, p.d1, p.d3}, "(batch, d1 from x; d3 from v)");
    p.dtype = *dtype_of(x_);
    p.backend = backend_for(x_, "x");
    p.x = x_.data();
    p.x_batch_stride = x_.stride(0);
    p.x_row_stride = x_.stride(1);
    p.v = v_.data();
    p.v_batch_stride = v_.stride(0);
    p.v_row_stride = v_.stride(1);
    p.out = out_.data();
    p.out_batch_stride = out_.stride(0);
    p.out_row_stride = out_.stride(1);
    p.fp32_mode = fp32_fast ? tileattn::Fp32Mode::fast : tileattn::Fp32Mode::exact;
    p.num_threads = num_threads;
  }

  // As Attention: plan once for the stream, then run that plan.
  size_t plan(uintptr_t stream) {
    auto p = problem_;
    p.stream = reinterpret_cast<void*>(stream);
    plan_ = tileattn::plan_softmax_matmul(p);
    return plan_->workspace_size();
  }

  void run(OptArray workspace) {
    if (!plan_) fail(ErrorKind::invalid_argument, "run() needs plan() first");
    auto [data, bytes] = workspace_of(workspace, x_);
    nb::gil_scoped_release release;
    plan_->run(data, bytes);
  }

 private:
  Array x_, v_, out_;
  tileattn::SoftmaxMatmulProblem problem_;
  std::optional<tileattn::Plan> plan_;
};

}  // namespace

NB_MODULE(_ext, m) {
  m.doc() = "tileattn's binding layer (DLPack tensors in; no libtorch link)";

  nb::register_exception_translator([](const std::exception_ptr& e, void*) {
    try {
      std::rethrow_exception(e);
    } catch (const Error& err) {
      PyObject* type = PyExc_RuntimeError;
      switch (err.kind()) {
        case ErrorKind::invalid_argument: type = PyExc_ValueError; break;
        case ErrorKind::invalid_type: type = PyExc_TypeError; break;
        case ErrorKind::unsupported: type = PyExc_NotImplementedError; break;
        case ErrorKind::device: type = PyExc_RuntimeError; break;
      }
      PyErr_SetString(type, err.what());
    }
  });

  nb::class_<Options>(m, "Options")
      .def(nb::init<>())
      .def_rw("max_seqlen_q", &Options::max_seqlen_q)
      .def_rw("max_seqlen_k", &Options::max_seqlen_k)
      .def_rw("softmax_scale", &Options::softmax_scale)
      .def_rw("causal", &Options::causal)
      .def_rw("window_left", &Options::window_left)
      .def_rw("window_right", &Options::window_right)
      .def_rw("softcap", &Options::softcap)
      .def_rw("deterministic", &Options::deterministic)
      .def_rw("partial_keys", &Options::partial_keys)
      .def_rw("fp32_fast", &Options::fp32_fast)
      .def_rw("num_threads", &Options::num_threads)
      .def_rw("check_cu_seqlens", &Options::check_cu_seqlens)
      .def_rw("num_splits", &Options::num_splits)
      .def_rw("dropout_p", &Options::dropout_p)
      .def_rw("dropout_seed", &Options::dropout_seed)
      .def_rw("dropout_offset", &Options::dropout_offset);

  // dropout_keep_mask(out, dropout_p, seed, offset): out (batch, heads, seqlen_q, seqlen_k), uint8,
  // contiguous, on the CPU, set to 1 where the mask rule of src/common/philox.hpp keeps element
  // (b, h, i, j) and 0 where it drops it; positions are those within each sequence.
  m.def(
      "dropout_keep_mask",
      [](Array out, float dropout_p, uint64_t seed, uint64_t offset) {
        if (out.device_type() != nb::device::cpu::value)
          fail(ErrorKind::invalid_argument, "out is on " + device_name(out) + "; the keep mask is built on the cpu");
        if (out.dtype() != nb::dtype<uint8_t>())
          fail(ErrorKind::invalid_type, "out.dtype=" + dtype_name(out.dtype()) + " must be uint8");
        if (out.ndim() != 4)
          fail(ErrorKind::invalid_argument, "out must have 4 dimensions (batch, heads, seqlen_q, seqlen_k), got shape " +
                                                shape_of(out));
        int64_t expect = 1;
        for (size_t i = 4; i-- > 0;) {
          if (out.shape(i) > 1 && out.stride(i) != expect) fail(ErrorKind::invalid_argument, "out must be contiguous");
          expect *= int64_t(out.shape(i));
        }
        if (!(dropout_p >= 0.0f && dropout_p < 1.0f))
          fail(ErrorKind::invalid_argument, "dropout_p=" + std::to_string(dropout_p) + " must be in [0, 1)");
        const int64_t batch = out.shape(0), heads = out.shape(1), sq = out.shape(2), sk = out.shape(3);
        const tileattn::Dropout d = tileattn::make_dropout(dropout_p, seed, offset, heads);
        auto* m = static_cast<uint8_t*>(out.data());
        nb::gil_scoped_release release;
        for (int64_t b = 0; b < batch; ++b)
          for (int64_t h = 0; h < heads; ++h)
            for (int64_t i = 0; i < sq; ++i)
              for (int64_t j = 0; j < sk; ++j) *m++ = !d.on || d.keep(b, h, i, j);
      },
      nb::arg("out"), nb::arg("dropout_p"), nb::arg("seed"), nb::arg("offset"));

  nb::class_<Attention>(m, "Attention")
      .def(nb::init<Array, Array, Array, Array, Array, OptArray, OptArray, const Options&, OptArray, OptArray, OptArray,
                    OptArray, OptArray, OptArray, OptArray, OptArray, OptArray, OptArray>(),
           nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("lse"), nb::arg("cu_seqlens_q").none(),
           nb::arg("cu_seqlens_k").none(), nb::arg("options"), nb::arg("dout").none() = nb::none(),
           nb::arg("dq").none() = nb::none(), nb::arg("dk").none() = nb::none(), nb::arg("dv").none() = nb::none(),
           nb::kw_only(), nb::arg("alibi_slopes").none() = nb::none(), nb::arg("seqused_k").none() = nb::none(),
           nb::arg("leftpad_k").none() = nb::none(), nb::arg("kv_batch_idx").none() = nb::none(),
           nb::arg("block_table").none() = nb::none(), nb::arg("dropout_rng").none() = nb::none())
      .def("plan_forward", &Attention::plan_forward, nb::arg("stream") = 0)
      .def("plan_backward", &Attention::plan_backward, nb::arg("stream") = 0)
      .def("run", &Attention::run, nb::arg("workspace").none() = nb::none())
      .def_prop_ro("backend", &Attention::backend);

  nb::class_<SoftmaxMatmul>(m, "SoftmaxMatmul")
      .def(nb::init<Array, Array, Array, bool, int>(), nb::arg("x"), nb::arg("v"), nb::arg("out"), nb::kw_only(),
           nb::arg("fp32_fast") = false, nb::arg("num_threads") = 0)
      .def("plan", &SoftmaxMatmul::plan, nb::arg("stream") = 0)
      .def("run", &SoftmaxMatmul::run, nb::arg("workspace").none() = nb::none());

  m.def("attention_forward_flops", &tileattn::attention_forward_flops, nb::arg("batch"), nb::arg("heads_q"),
        nb::arg("seqlen_q"), nb::arg("seqlen_k"), nb::arg("headdim_qk"), nb::arg("headdim_v"), nb::arg("causal"));
  m.def("attention_backward_flops", &tileattn::attention_backward_flops, nb::arg("batch"), nb::arg("heads_q"),
        nb::arg("seqlen_q"), nb::arg("seqlen_k"), nb::arg("headdim_qk"), nb::arg("headdim_v"), nb::arg("causal"));
  m.def("softmax_matmul_flops", &tileattn::softmax_matmul_flops, nb::arg("batch"), nb::arg("d1"), nb::arg("d2"),
        nb::arg("d3"));
  m.def("cuda_available", &tileattn::cuda_available);
  m.def("version", &tileattn::version);
#ifdef TILEATTN_WITH_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif

  // merge_attention(out, lse, out_b, lse_b): (out_b, lse_b) merged into (out, lse) in place
  // (include/tileattn/merge.hpp). out/out_b (batch, seqlen, heads, headdim) with lse (batch, heads,
  // seqlen), or (total, heads, headdim) with lse (heads, total); out float32 over any dtype, or
  // out_b's dtype. L views need a contiguous last dimension; the library checks the rest.
  m.def(
      "merge_attention",
      [](Array out, Array lse, Array out_b, Array lse_b, uintptr_t stream, int num_threads) {
        const bool varlen = out.ndim() == 3;
        const size_t rank = varlen ? 3 : 4;
        const char* dims = varlen ? kVarlenDims : kFixedDims;
        if (out.ndim() != 3 && out.ndim() != 4)
          fail(ErrorKind::invalid_argument, std::string("out must have 4 dimensions ") + kFixedDims + " or 3 " +
                                                kVarlenDims + ", got shape " + shape_of(out));
        check_operand(out, "out", rank, dims, out, "out");
        if (!dtype_of(out_b))
          fail(ErrorKind::invalid_type, "out_b.dtype=" + dtype_name(out_b.dtype()) +
                                            " is not supported (float16, bfloat16 or float32)");
        check_shape(out_b, "out_b", std::vector<int64_t>(out.shape_ptr(), out.shape_ptr() + rank), "(the shape of out)");
        if (!same_device(out_b, out))
          fail(ErrorKind::invalid_argument, "out_b is on " + device_name(out_b) + " but out is on " +
                                                device_name(out) + "; all tensors must share one device");
        if (out_b.shape(rank - 1) > 1 && out_b.stride(rank - 1) != 1)
          fail(ErrorKind::invalid_argument, "out_b.stride(-1)=" + std::to_string(out_b.stride(rank - 1)) +
                                                " must be 1 (the last dimension must be contiguous)");
        tileattn::MergeProblem p;
        const int64_t b = varlen ? 1 : int64_t(out.shape(0)), n = int64_t(out.shape(rank - 3));
        p.batch = b, p.seqlen = n, p.heads = int64_t(out.shape(rank - 2)), p.headdim = int64_t(out.shape(rank - 1));
        const std::vector<int64_t> l_shape = varlen ? std::vector<int64_t>{p.heads, n} : std::vector<int64_t>{b, p.heads, n};
        const char* l_why = varlen ? "(heads, total)" : "(batch, heads, seqlen)";
        for (auto [l, name] : {std::pair<Array*, const char*>{&lse, "lse"}, {&lse_b, "lse_b"}}) {
          if (l->dtype() != nb::dtype<float>())
            fail(ErrorKind::invalid_type, std::string(name) + ".dtype=" + dtype_name(l->dtype()) + " must be float32");
          if (!same_device(*l, out))
            fail(ErrorKind::invalid_argument, std::string(name) + " is on " + device_name(*l) + " but out is on " +
                                                  device_name(out) + "; all tensors must share one device");
          check_shape(*l, name, l_shape, l_why);
          if (n > 1 && l->stride(l->ndim() - 1) != 1)
            fail(ErrorKind::invalid_argument, std::string(name) + ".stride(-1)=" +
                                                  std::to_string(l->stride(l->ndim() - 1)) +
                                                  " must be 1 (the last dimension must be contiguous)");
        }
        const auto view = [&](const Array& a) {
          tileattn::TensorView t = view_of(a, varlen);
          if (varlen) t.batch_stride = 0;
          return t;
        };
        p.out = view(out), p.out_dtype = *dtype_of(out);
        p.out_b = view(out_b), p.out_b_dtype = *dtype_of(out_b);
        p.lse = static_cast<float*>(lse.data());
        p.lse_b = static_cast<const float*>(lse_b.data());
        p.lse_head_stride = int64_t(lse.stride(varlen ? 0 : 1));
        p.lse_b_head_stride = int64_t(lse_b.stride(varlen ? 0 : 1));
        p.lse_batch_stride = varlen ? 0 : int64_t(lse.stride(0));
        p.lse_b_batch_stride = varlen ? 0 : int64_t(lse_b.stride(0));
        p.backend = backend_for(out, "out");
        p.stream = reinterpret_cast<void*>(stream);
        p.num_threads = num_threads;
        nb::gil_scoped_release release;
        tileattn::merge_attention(p);
      },
      nb::arg("out"), nb::arg("lse"), nb::arg("out_b"), nb::arg("lse_b"), nb::kw_only(), nb::arg("stream") = 0,
      nb::arg("num_threads") = 0);
}
