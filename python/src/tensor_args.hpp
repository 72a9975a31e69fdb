// The rules a binding checks before a tensor's pointer reaches the library, written once for both
// bindings: the nanobind module (DLPack arrays) and the PyTorch operator library (at::Tensor).
// Each describes its tensors as TensorRef; everything below works on that description alone. The
// checks are only those AttentionProblem cannot express (ranks, per-tensor dtypes and devices,
// shapes of the tensors the struct sees through a pointer alone, contiguous last dimensions); every
// other rule is the library's (src/host/validate.cpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>

#include "tileattn/tileattn.hpp"

namespace tileattn::bind {

[[noreturn]] inline void fail(ErrorKind kind, const std::string& message) { throw Error(kind, message); }

// DLPack's dtype triple and device codes: the nanobind side reads them as they are, the PyTorch
// side maps its ScalarType and DeviceType onto them.
struct DType {
  enum Code : uint8_t { Int = 0, UInt = 1, Float = 2, Bfloat = 4, Complex = 5, Bool = 6, Other = 255 };
  uint8_t code = Other, bits = 0;
  uint16_t lanes = 1;
  friend bool operator==(DType a, DType b) { return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes; }
  friend bool operator!=(DType a, DType b) { return !(a == b); }
};
inline constexpr DType kF32{DType::Float, 32, 1}, kI32{DType::Int, 32, 1}, kI64{DType::Int, 64, 1},
    kU8{DType::UInt, 8, 1};

enum DeviceCode : int { kCpu = 1, kCuda = 2, kCudaManaged = 13 };

// One tensor as a binding sees it. Shape and strides point into the binding's own tensor object,
// which outlives the TensorRef.
struct TensorRef {
  void* ptr = nullptr;
  DType type;
  int device = 0, device_index = 0;
  size_t rank = 0;
  const int64_t* sizes = nullptr;
  const int64_t* steps = nullptr;  // strides, in elements
  const char* type_text = nullptr;  // the framework's own dtype name where DLPack has none

  size_t ndim() const { return rank; }
  int64_t shape(size_t i) const { return sizes[i]; }
  int64_t stride(size_t i) const { return steps[i]; }
  void* data() const { return ptr; }
  DType dtype() const { return type; }
};
using OptRef = std::optional<TensorRef>;

// Tuple text, "(2, 64, 8)" or "(3,)". Plain std::string + std::to_string on purpose: formatting
// with std::ostringstream inside the nanobind module crashed under torch 2.11 built with gcc 13,
// where string concatenation did not.
inline std::string tuple_text(const int64_t* values, size_t n) {
  std::string s = "(";
  for (size_t i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(values[i]);
  return s + (n == 1 ? ",)" : ")");
}

inline std::string shape_of(const TensorRef& a) { return tuple_text(a.sizes, a.rank); }

inline std::string dtype_name(DType t, const char* text = nullptr) {
  if (text) return text;
  std::string base;
  switch (t.code) {
    case DType::Int: base = "int"; break;
    case DType::UInt: base = "uint"; break;
    case DType::Float: base = "float"; break;
    case DType::Bfloat: base = "bfloat"; break;
    case DType::Complex: base = "complex"; break;
    case DType::Bool: return "bool";
    default: base = "code" + std::to_string(t.code) + "_"; break;
  }
  return base + std::to_string(t.bits);
}
inline std::string dtype_name(const TensorRef& a) { return dtype_name(a.type, a.type_text); }

inline bool is_cuda(const TensorRef& a) { return a.device == kCuda || a.device == kCudaManaged; }

inline std::string device_name(const TensorRef& a) {
  if (a.device == kCpu) return "cpu";
  if (is_cuda(a)) return "cuda:" + std::to_string(a.device_index);
  return "device type " + std::to_string(a.device);
}

inline bool same_device(const TensorRef& a, const TensorRef& b) {
  if (a.device == kCpu || b.device == kCpu) return a.device == b.device;
  return is_cuda(a) == is_cuda(b) && a.device_index == b.device_index;
}

inline std::optional<tileattn::DType> dtype_of(const TensorRef& a) {
  const DType t = a.type;
  if (t == kF32) return tileattn::DType::f32;
  if (t == DType{DType::Float, 16, 1}) return tileattn::DType::f16;
  if (t == DType{DType::Bfloat, 16, 1}) return tileattn::DType::bf16;
  return std::nullopt;
}

// The device every tensor of a call must share; also picks the backend from it.
inline tileattn::Backend backend_for(const TensorRef& a, const char* name) {
  if (a.device == kCpu) return tileattn::Backend::cpu;
  if (is_cuda(a)) return tileattn::Backend::cuda;
  fail(ErrorKind::invalid_argument,
       std::string(name) + " is on " + device_name(a) + "; tileattn runs on cpu and cuda tensors");
}

inline void check_same_device(const TensorRef& a, const char* name, const TensorRef& ref, const char* ref_name) {
  if (!same_device(a, ref))
    fail(ErrorKind::invalid_argument, std::string(name) + " is on " + device_name(a) + " but " + ref_name + " is on " +
                                          device_name(ref) + "; all tensors must share one device");
}

inline void check_last_contiguous(const TensorRef& a, const char* name) {
  const size_t last = a.rank - 1;
  if (a.shape(last) > 1 && a.stride(last) != 1)
    fail(ErrorKind::invalid_argument, std::string(name) + ".stride(-1)=" + std::to_string(a.stride(last)) +
                                          " must be 1 (the last dimension must be contiguous)");
}

// Rank, dtype (one of the attention dtypes and equal to the reference's), device and a contiguous
// last dimension: the checks the problem struct cannot express because it only sees pointers.
inline void check_rank(const TensorRef& a, const char* name, size_t rank, const char* dims) {
  if (a.rank != rank)
    fail(ErrorKind::invalid_argument, std::string(name) + " must have " + std::to_string(rank) + " dimensions " +
                                          dims + ", got shape " + shape_of(a));
}

inline void check_operand(const TensorRef& a, const char* name, size_t rank, const char* dims, const TensorRef& ref,
                          const char* ref_name) {
  check_rank(a, name, rank, dims);
  if (!dtype_of(a))
    fail(ErrorKind::invalid_type,
         std::string(name) + ".dtype=" + dtype_name(a) + " is not supported (float16, bfloat16 or float32)");
  if (&a != &ref) {
    if (a.type != ref.type)
      fail(ErrorKind::invalid_type,
           std::string(name) + ".dtype=" + dtype_name(a) + " must equal " + ref_name + ".dtype=" + dtype_name(ref));
    check_same_device(a, name, ref, ref_name);
  }
  check_last_contiguous(a, name);
}

// An expected shape, on the stack: these checks run on every call.
struct Dims {
  int64_t v[8] = {};
  size_t n = 0;
  Dims(std::initializer_list<int64_t> d) : n(d.size()) { std::copy(d.begin(), d.end(), v); }
  explicit Dims(const TensorRef& a) : n(std::min<size_t>(a.rank, 8)) { std::copy(a.sizes, a.sizes + n, v); }
};

inline void check_shape(const TensorRef& a, const char* name, const Dims& expected, const char* why) {
  bool ok = a.rank == expected.n;
  for (size_t i = 0; ok && i < expected.n; ++i) ok = a.shape(i) == expected.v[i];
  if (ok) return;
  fail(ErrorKind::invalid_argument, std::string(name) + ".shape=" + shape_of(a) + " must be " +
                                        tuple_text(expected.v, expected.n) + " " + why);
}

// A dense row-major tensor of the given dtype on the reference's device (lse, cu_seqlens).
inline void check_aux(const TensorRef& a, const char* name, const Dims& shape, const char* why, DType dtype,
                      const char* dtype_text, const TensorRef& ref, const char* ref_name) {
  if (a.type != dtype)
    fail(ErrorKind::invalid_type, std::string(name) + ".dtype=" + dtype_name(a) + " must be " + dtype_text);
  check_same_device(a, name, ref, ref_name);
  check_shape(a, name, shape, why);
  int64_t expect = 1;
  for (size_t i = a.rank; i-- > 0;) {
    if (a.shape(i) > 1 && a.stride(i) != expect) fail(ErrorKind::invalid_argument, std::string(name) + " must be contiguous");
    expect *= a.shape(i);
  }
}

inline tileattn::TensorView view_of(const TensorRef& a, bool varlen) {
  tileattn::TensorView t;
  t.data = a.ptr;
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

inline constexpr const char* kFixedDims = "(batch, seqlen, heads, headdim)";
inline constexpr const char* kVarlenDims = "(total_tokens, heads, headdim)";
inline constexpr const char* kPagedDims = "(num_pages, page_size, heads_kv, headdim) (a paged cache)";

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
  bool rotary_interleaved = true;  // with rotary_cos/rotary_sin (problem.hpp)
  // Attention dropout (problem.hpp); the Python layer draws seed and offset per call.
  float dropout_p = 0.0f;
  uint64_t dropout_seed = 0, dropout_offset = 0;
};

// The tensors of one attention call: forward, and backward when the gradient tensors are given;
// the key/value cache tables (problem.hpp) are flash-attn's, each an int32 tensor or absent.
struct AttentionTensors {
  TensorRef q, k, v, out, lse;
  OptRef cu_seqlens_q, cu_seqlens_k;
  OptRef dout, dq, dk, dv;
  OptRef alibi_slopes, dropout_rng;
  OptRef seqused_k, leftpad_k, kv_batch_idx, block_table;
  OptRef k_new, v_new, rotary_cos, rotary_sin;  // appending to the cache (flash-attn's k, v)
  OptRef softmax_stats;  // fp32 on CUDA: the forward's row statistics for the backward (problem.hpp)
  OptRef dlse;           // backward: the loss's gradient with respect to lse (problem.hpp), or none
};

// q, k and v alone, before the outputs are shaped from them: the three ranks first (the order the
// Python layer always checked in), then dtypes, devices, contiguous last dimensions
// (attention_problem() repeats these checks; they cost nanoseconds).
inline void check_inputs(const TensorRef& q, const TensorRef& k, const TensorRef& v, bool varlen) {
  const size_t rank = varlen ? 3 : 4;
  const char* dims = varlen ? kVarlenDims : kFixedDims;
  check_rank(q, "q", rank, dims);
  check_rank(k, "k", rank, dims);
  check_rank(v, "v", rank, dims);
  check_operand(q, "q", rank, dims, q, "q");
  check_operand(k, "k", rank, dims, q, "q");
  check_operand(v, "v", rank, dims, q, "q");
}

namespace detail {

// flash-attn's alibi_slopes: fp32, (heads_q,) or (batch, heads_q), last dim contiguous; a batch
// stride of 0 (expand) shares one row of slopes.
inline void set_alibi(AttentionProblem& p, const TensorRef& a, const TensorRef& q) {
  if (a.type != kF32) fail(ErrorKind::invalid_type, "alibi_slopes.dtype=" + dtype_name(a) + " must be float32");
  check_same_device(a, "alibi_slopes", q, "q");
  const bool per_batch = a.rank == 2;
  if (!(a.rank == 1 && a.shape(0) == p.heads_q) && !(per_batch && a.shape(0) == p.batch && a.shape(1) == p.heads_q))
    fail(ErrorKind::invalid_argument, "alibi_slopes.shape=" + shape_of(a) + " must be (heads,)=(" +
                                          std::to_string(p.heads_q) + ",) or (batch, heads)=(" +
                                          std::to_string(p.batch) + ", " + std::to_string(p.heads_q) + ")");
  check_last_contiguous(a, "alibi_slopes");
  p.alibi_slopes = static_cast<const float*>(a.ptr);
  p.alibi_batch_stride = per_batch && a.shape(0) > 1 ? a.stride(0) : 0;
}

// dropout_rng: the call's {seed, offset} as two int64 on q's device (their bits read as uint64),
// read when the kernels run (problem.hpp's dropout_rng_state), in place of the options' pair.
inline void set_dropout_rng(AttentionProblem& p, const TensorRef& a, const TensorRef& q) {
  if (a.type != kI64) fail(ErrorKind::invalid_type, "dropout_rng.dtype=" + dtype_name(a) + " must be int64");
  check_same_device(a, "dropout_rng", q, "q");
  if (a.rank != 1 || a.shape(0) != 2 || a.stride(0) != 1)
    fail(ErrorKind::invalid_argument, "dropout_rng.shape=" + shape_of(a) + " must be (2,) and contiguous");
  p.dropout_rng_state = static_cast<const uint64_t*>(a.ptr);
}

// The cache tables: int32, contiguous, on q's device; (batch,) each, block_table (batch, pages).
inline void set_cache(AttentionProblem& p, const AttentionTensors& t, bool varlen) {
  auto per_sequence = [&](const OptRef& a, const char* name) -> const int32_t* {
    if (!a) return nullptr;
    check_aux(*a, name, {p.batch}, "(one entry per sequence)", kI32, "int32", t.q, "q");
    return static_cast<const int32_t*>(a->ptr);
  };
  p.seqused_k = per_sequence(t.seqused_k, "seqused_k");
  p.leftpad_k = per_sequence(t.leftpad_k, "leftpad_k");
  p.kv_batch_idx = per_sequence(t.kv_batch_idx, "kv_batch_idx");
  if (p.kv_batch_idx) p.kv_batch = t.k.shape(0);
  if (const OptRef& b = t.block_table) {
    if (b->type != kI32) fail(ErrorKind::invalid_type, "block_table.dtype=" + dtype_name(*b) + " must be int32");
    check_same_device(*b, "block_table", t.q, "q");
    if (b->rank != 2 || b->shape(0) != p.batch)
      fail(ErrorKind::invalid_argument, "block_table.shape=" + shape_of(*b) +
                                            " must be (batch, max_pages) with batch=" + std::to_string(p.batch));
    check_last_contiguous(*b, "block_table");
    p.block_table = static_cast<const int32_t*>(b->ptr);
    p.pages_per_seq = b->shape(1);
    p.block_table_stride = b->shape(0) > 1 ? b->stride(0) : p.pages_per_seq;
    p.num_pages = t.k.shape(0);
    p.page_size = t.k.shape(1);
    // Fixed length: every sequence may reach its whole row of pages. Varlen: total_k is unused
    // for pages; the key rows the cache holds stand in for it.
    if (!varlen) p.seqlen_k = p.pages_per_seq * p.page_size;
    else p.total_k = p.num_pages * p.page_size;
  }
}

// New keys and values (batch, seqlen_new, heads_kv, headdim of the cache) and the rotary tables
// (seqlen_ro, rotary_dim / 2), contiguous, in q's dtype (as flash-attn requires).
inline void set_append(AttentionProblem& p, const AttentionTensors& t, const Options& options) {
  if (t.k_new.has_value() != t.v_new.has_value())
    fail(ErrorKind::invalid_argument, "k_new and v_new must be given together (the new keys and values to append)");
  if (t.k_new) {
    const int64_t seqlen_new = t.k_new->rank == 4 ? t.k_new->shape(1) : 0;
    // The problem struct's names: the caller's wrapper knows which of its arguments these are.
    for (const auto& [a, name, dim] :
         {std::tuple{&*t.k_new, "k_new", p.headdim_qk}, std::tuple{&*t.v_new, "v_new", p.headdim_v}}) {
      check_operand(*a, name, 4, "(batch, seqlen_new, heads_kv, headdim)", t.q, "q");
      check_shape(*a, name, {p.batch, seqlen_new, p.heads_kv, dim}, "(batch, seqlen_new, heads_kv, headdim of the cache)");
    }
    p.k_new = view_of(*t.k_new, false);
    p.v_new = view_of(*t.v_new, false);
    p.seqlen_new = seqlen_new;
  }
  if (t.rotary_cos.has_value() != t.rotary_sin.has_value())
    fail(ErrorKind::invalid_argument, "rotary_cos and rotary_sin must be given together");
  if (!t.rotary_cos) return;
  const TensorRef &cos = *t.rotary_cos, &sin = *t.rotary_sin;
  if (cos.rank != 2)
    fail(ErrorKind::invalid_argument, "rotary_cos must be (seqlen_ro, rotary_dim / 2), got shape " + shape_of(cos));
  const std::string type = dtype_name(t.q);
  check_aux(cos, "rotary_cos", {cos.shape(0), cos.shape(1)}, "", t.q.type, type.c_str(), t.q, "q");
  check_aux(sin, "rotary_sin", {cos.shape(0), cos.shape(1)}, "(the shape of rotary_cos)", t.q.type, type.c_str(), t.q,
            "q");
  p.rotary_cos = cos.ptr;
  p.rotary_sin = sin.ptr;
  p.rotary_seqlen = cos.shape(0);
  p.rotary_dim = 2 * cos.shape(1);
  p.rotary_interleaved = options.rotary_interleaved;
}

}  // namespace detail

// The AttentionProblem of one call, every binding-side rule checked (the library checks the rest
// when it plans). The stream is left unset.
inline AttentionProblem attention_problem(const AttentionTensors& t, const Options& options) {
  if (t.cu_seqlens_q.has_value() != t.cu_seqlens_k.has_value())
    fail(ErrorKind::invalid_argument, "cu_seqlens_q and cu_seqlens_k must be given together (variable length)");
  const bool varlen = t.cu_seqlens_q.has_value();
  const size_t rank = varlen ? 3 : 4;
  const char* dims = varlen ? kVarlenDims : kFixedDims;

  // A paged K/V is (num_pages, page_size, heads_kv, headdim) whatever q's layout.
  const bool paged = t.block_table.has_value();
  const size_t k_rank = paged ? 4 : rank;
  const char* k_dims = paged ? kPagedDims : dims;
  check_operand(t.q, "q", rank, dims, t.q, "q");
  check_operand(t.k, "k", k_rank, k_dims, t.q, "q");
  check_operand(t.v, "v", k_rank, k_dims, t.q, "q");
  check_operand(t.out, "out", rank, dims, t.q, "q");
  const bool has_grads = t.dout || t.dq || t.dk || t.dv;
  if (has_grads && !(t.dout && t.dq && t.dk && t.dv))
    fail(ErrorKind::invalid_argument, "dout, dq, dk and dv must be given together (backward)");
  if (has_grads) {
    check_operand(*t.dout, "dout", rank, dims, t.q, "q");
    check_operand(*t.dq, "dq", rank, dims, t.q, "q");
    check_operand(*t.dk, "dk", rank, dims, t.q, "q");
    check_operand(*t.dv, "dv", rank, dims, t.q, "q");
  }

  const size_t h = rank - 2, d = rank - 1;  // heads and headdim axes
  const size_t kh = k_rank - 2, kd = k_rank - 1;
  AttentionProblem p;
  p.dtype = *dtype_of(t.q);
  p.backend = backend_for(t.q, "q");
  p.heads_q = t.q.shape(h);
  p.heads_kv = t.k.shape(kh);
  p.headdim_qk = t.q.shape(d);
  p.headdim_v = t.v.shape(kd);

  // k and v share every axis but the last; q and k share batch and headdim.
  Dims k_shape(t.k);
  k_shape.v[kd] = p.headdim_qk;
  check_shape(t.k, "k", k_shape, "(its head dim must equal q.shape[-1])");
  Dims v_shape = k_shape;
  v_shape.v[kd] = p.headdim_v;
  check_shape(t.v, "v", v_shape, "(all dimensions but the last must equal k's)");
  Dims o_shape(t.q);
  o_shape.v[d] = p.headdim_v;
  check_shape(t.out, "out", o_shape, "(q's shape with v's head dim)");
  if (has_grads) {
    check_shape(*t.dout, "dout", o_shape, "(the shape of out)");
    check_shape(*t.dq, "dq", Dims(t.q), "(the shape of q)");
    check_shape(*t.dk, "dk", Dims(t.k), "(the shape of k)");
    check_shape(*t.dv, "dv", Dims(t.v), "(the shape of v)");
  }

  if (varlen) {
    const TensorRef &cu_q = *t.cu_seqlens_q, &cu_k = *t.cu_seqlens_k;
    if (cu_q.rank != 1)
      fail(ErrorKind::invalid_argument, "cu_seqlens_q must be 1-D (batch + 1,), got shape " + shape_of(cu_q));
    const int64_t n = cu_q.shape(0);
    check_aux(cu_q, "cu_seqlens_q", {n}, "(batch + 1 offsets)", kI32, "int32", t.q, "q");
    check_aux(cu_k, "cu_seqlens_k", {n}, "(the shape of cu_seqlens_q)", kI32, "int32", t.q, "q");
    if (n < 1) fail(ErrorKind::invalid_argument, "cu_seqlens_q must hold batch + 1 >= 1 offsets, got 0");
    p.batch = n - 1;
    p.total_q = t.q.shape(0);
    p.total_k = t.k.shape(0);
    p.seqlen_q = options.max_seqlen_q;
    p.seqlen_k = options.max_seqlen_k;
    p.cu_seqlens_q = static_cast<const int32_t*>(cu_q.ptr);
    p.cu_seqlens_k = static_cast<const int32_t*>(cu_k.ptr);
    check_aux(t.lse, "lse", {p.heads_q, p.total_q}, "(heads, total_q)", kF32, "float32", t.q, "q");
  } else {
    // With kv_batch_idx (or pages) k's first axis is the cache's, not the batch.
    if (!paged && !t.kv_batch_idx && t.k.shape(0) != t.q.shape(0))
      fail(ErrorKind::invalid_argument, "k.shape[0]=" + std::to_string(t.k.shape(0)) + " must equal q.shape[0]=" +
                                            std::to_string(t.q.shape(0)) + " (batch)");
    p.batch = t.q.shape(0);
    p.seqlen_q = t.q.shape(1);
    p.seqlen_k = t.k.shape(1);
    check_aux(t.lse, "lse", {p.batch, p.heads_q, p.seqlen_q}, "(batch, heads, seqlen_q)", kF32, "float32", t.q, "q");
  }

  p.q = view_of(t.q, varlen);
  p.k = view_of(t.k, varlen && !paged);
  p.v = view_of(t.v, varlen && !paged);
  if (t.seqused_k || t.leftpad_k || t.kv_batch_idx || t.block_table) detail::set_cache(p, t, varlen);
  if (t.k_new || t.v_new || t.rotary_cos || t.rotary_sin) detail::set_append(p, t, options);
  p.o = view_of(t.out, varlen);
  p.lse = static_cast<float*>(t.lse.ptr);
  if (t.softmax_stats) {
    // Two float32 a row of L, in L's order (problem.hpp's softmax_stats).
    if (varlen)
      check_aux(*t.softmax_stats, "softmax_stats", {p.heads_q, p.total_q, 2}, "(heads, total_q, 2)", kF32, "float32",
                t.q, "q");
    else
      check_aux(*t.softmax_stats, "softmax_stats", {p.batch, p.heads_q, p.seqlen_q, 2}, "(batch, heads, seqlen_q, 2)",
                kF32, "float32", t.q, "q");
    p.softmax_stats = static_cast<float*>(t.softmax_stats->ptr);
  }
  if (has_grads) {
    p.dout = view_of(*t.dout, varlen);
    p.dq = view_of(*t.dq, varlen);
    p.dk = view_of(*t.dk, varlen);
    p.dv = view_of(*t.dv, varlen);
    if (t.dlse) {
      if (varlen)
        check_aux(*t.dlse, "dlse", {p.heads_q, p.total_q}, "(heads, total_q), as lse", kF32, "float32", t.q, "q");
      else
        check_aux(*t.dlse, "dlse", {p.batch, p.heads_q, p.seqlen_q}, "(batch, heads, seqlen_q), as lse", kF32,
                  "float32", t.q, "q");
      p.dlse = static_cast<const float*>(t.dlse->ptr);
    }
  }
  if (t.alibi_slopes) detail::set_alibi(p, *t.alibi_slopes, t.q);
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
  if (t.dropout_rng) detail::set_dropout_rng(p, *t.dropout_rng, t.q);
  // Every tensor's device was checked above (one device, cpu or cuda): the library need not ask
  // the CUDA runtime about each pointer again.
  p.check_memory_spaces = false;
  return p;
}

inline const char* backend_name(tileattn::Backend b) {
  switch (b) {
    case tileattn::Backend::cpu: return "cpu";
    case tileattn::Backend::cuda: return "cuda";
    default: return "automatic";
  }
}

}  // namespace tileattn::bind
