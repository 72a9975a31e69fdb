// tileattn._torch_ops: tileattn's two attention operators as a PyTorch operator library (the
// schemas, the CPU and CUDA kernels and the autograd formula, all in C++), and a Python entry that
// calls the forward operator through the dispatcher without boxing its arguments. A call, eager or
// from a torch.compile graph, goes from the dispatcher straight to the library and never re-enters
// Python, so its host cost is that of an ATen operator. The fake (meta) implementations stay in
// Python (tileattn/_ops.py), where they are only needed while tracing. Built against the PyTorch
// present at build time; where it is missing or does not load, _ops.py registers the same
// operators in Python over tileattn._ext.
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <numeric>
#include <optional>
#include <tuple>
#include <vector>

#include "error_classes.hpp"
#include "tensor_args.hpp"
#include "tileattn/tileattn.hpp"

namespace {

using namespace tileattn::bind;
using at::Tensor;
using OptTensor = std::optional<Tensor>;
using c10::SymInt;

// tileattn.check_cu_seqlens(): the opt-in host check of device offsets (tileattn/_ops.py).
std::atomic<bool> g_check_cu_seqlens{false};

// The CPU kernels' tasks run on PyTorch's intra-op threads, which torch's own CPU kernels use, so
// the process has one pool, not two competing for its cores (tileattn/cpu_executor.hpp). Each of the
// `threads` chunks drains the shared task counter, so uneven (causal) tasks still balance.
bool run_on_torch_threads(int threads, void (*work)(void*), void* job) {
  // An explicit count above torch's (not one this library passes) keeps tileattn's own pool.
  if (threads > at::get_num_threads()) return false;
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) work(job);
  });
  return true;
}

// With torch's OpenMP backend at::parallel_for's region is compiled in this file: built without
// OpenMP it would run every task on the caller, so tileattn's pool is kept then.
#if !AT_PARALLEL_OPENMP || defined(_OPENMP)
[[maybe_unused]] const bool g_torch_threads_installed = (tileattn::set_cpu_executor(run_on_torch_threads), true);
#endif

DType dl_type(at::ScalarType s) {
  switch (s) {
    case at::kFloat: return {DType::Float, 32};
    case at::kHalf: return {DType::Float, 16};
    case at::kBFloat16: return {DType::Bfloat, 16};
    case at::kDouble: return {DType::Float, 64};
    case at::kInt: return {DType::Int, 32};
    case at::kLong: return {DType::Int, 64};
    case at::kShort: return {DType::Int, 16};
    case at::kChar: return {DType::Int, 8};
    case at::kByte: return {DType::UInt, 8};
    case at::kBool: return {DType::Bool, 8};
    case at::kComplexFloat: return {DType::Complex, 64};
    case at::kComplexDouble: return {DType::Complex, 128};
    default: return {};
  }
}

TensorRef tensor_ref(const Tensor& t) {
  TensorRef r;
  r.ptr = t.data_ptr();
  r.type = dl_type(t.scalar_type());
  if (r.type.code == DType::Other) r.type_text = c10::toString(t.scalar_type());
  r.device = t.is_cuda() ? kCuda : t.is_cpu() ? kCpu : 0;
  r.device_index = t.is_cuda() ? t.device().index() : 0;
  r.rank = size_t(t.dim());
  r.sizes = t.sizes().data();
  r.steps = t.strides().data();
  return r;
}
OptRef tensor_ref(const OptTensor& t) { return t && t->defined() ? OptRef(tensor_ref(*t)) : std::nullopt; }

// A refused call as tileattn.errors' class. torch's bindings (torch.ops, the autograd engine) raise
// a PyTorchError as its python_type(), so the class survives the dispatcher; c10::ValueError would
// arrive as a plain ValueError.
struct Refusal : torch::PyTorchError {
  Refusal(const char* name, PyObject* fallback, std::string message)
      : PyTorchError(std::move(message)), name(name), fallback(fallback) {}
  PyObject* python_type() override { return tileattn::python::error_class(name, fallback); }
  const char* name;
  PyObject* fallback;
};

// tileattn::Error as the Python exception the same rule raises through tileattn._ext.
template <typename F>
auto translate_errors(F&& f) {
  try {
    return f();
  } catch (const tileattn::Error& e) {
    switch (e.kind()) {
      case tileattn::ErrorKind::invalid_argument: throw Refusal("InvalidArgumentError", PyExc_ValueError, e.what());
      case tileattn::ErrorKind::invalid_type: throw Refusal("InvalidTypeError", PyExc_TypeError, e.what());
      case tileattn::ErrorKind::unsupported: C10_THROW_ERROR(NotImplementedError, e.what());
      default: C10_THROW_ERROR(Error, e.what());
    }
  }
}

// PyTorch's switch for fp32 matmuls, read at each call as tileattn._ext's callers do: "high" or
// "medium" precision (or allow_tf32) selects the TF32 fast mode.
bool fp32_fast(const Tensor& q) {
  if (q.scalar_type() != at::kFloat) return false;
  auto& ctx = at::globalContext();
  return ctx.float32MatmulPrecision() != at::Float32MatmulPrecision::HIGHEST || ctx.allowTF32CuBLAS();
}

// The options both operators take, as the bindings' Options.
Options options_of(const Tensor& q, const SymInt& max_seqlen_q, const SymInt& max_seqlen_k,
                   std::optional<double> softmax_scale, bool causal, const SymInt& window_left,
                   const SymInt& window_right, double softcap, bool deterministic, double dropout_p) {
  Options o;
  o.max_seqlen_q = max_seqlen_q.expect_int();
  o.max_seqlen_k = max_seqlen_k.expect_int();
  if (softmax_scale) o.softmax_scale = float(*softmax_scale);
  o.causal = causal;
  o.window_left = window_left.expect_int();
  o.window_right = window_right.expect_int();
  o.softcap = float(softcap);
  o.deterministic = deterministic;
  o.fp32_fast = fp32_fast(q);
  o.num_threads = q.is_cpu() ? at::get_num_threads() : 0;
  o.check_cu_seqlens = g_check_cu_seqlens.load(std::memory_order_relaxed);
  o.dropout_p = float(dropout_p);
  return o;
}

// The tensors both operators take (the backward adds its gradients).
AttentionTensors tensors_of(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                            const OptTensor& cu_seqlens_q, const OptTensor& cu_seqlens_k,
                            const OptTensor& alibi_slopes, const OptTensor& dropout_rng) {
  AttentionTensors t{tensor_ref(q), tensor_ref(k), tensor_ref(v), tensor_ref(out), tensor_ref(lse)};
  t.cu_seqlens_q = tensor_ref(cu_seqlens_q);
  t.cu_seqlens_k = tensor_ref(cu_seqlens_k);
  t.alibi_slopes = tensor_ref(alibi_slopes);
  t.dropout_rng = tensor_ref(dropout_rng);
  return t;
}

// Plans the problem on q's device and current stream, then runs it with a workspace from
// PyTorch's allocator (so the caching allocator and graph capture see it).
void plan_and_run(tileattn::AttentionProblem p, const Tensor& q, bool backward) {
  std::optional<c10::DeviceGuard> guard;
  if (q.is_cuda()) {
    guard.emplace(q.device());
    p.stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(q.device()).native_handle();
  }
  const tileattn::Plan plan = backward ? tileattn::plan_backward(p) : tileattn::plan_forward(p);
  const size_t bytes = plan.workspace_size();
  Tensor workspace;
  if (bytes) workspace = at::empty({int64_t(bytes)}, q.options().dtype(at::kByte));
  plan.run(bytes ? workspace.data_ptr() : nullptr, bytes);
}

// A tensor shaped as `like` but for its last dimension (`last`), laid out as `like` is: its other
// dimensions in the order of their strides (flash-attn allocates with empty_like, and PyTorch's
// SDPA returns the query's layout), the last one contiguous. Where `like` is expanded (a stride 0)
// or the order is the usual one, the plain contiguous tensor (_ops.py's _empty_like, the same rule).
Tensor empty_like_layout(const Tensor& like, int64_t last) {
  const int64_t n = like.dim();
  const auto strides = like.strides();
  auto sizes = like.sizes().vec();
  sizes.back() = last;
  bool usual = true, expanded = false;
  for (int64_t d = 0; d + 1 < n; ++d) {
    expanded |= strides[d] == 0;
    usual &= d == 0 || strides[d - 1] >= strides[d];
  }
  if (usual || expanded) return at::empty(sizes, like.options());
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end() - 1, [&](int64_t a, int64_t b) { return strides[a] > strides[b]; });
  std::vector<int64_t> permuted(n), inverse(n);
  for (int64_t d = 0; d < n; ++d) {
    permuted[d] = sizes[order[d]];
    inverse[order[d]] = d;
  }
  return at::empty(permuted, like.options()).permute(inverse);
}

// flash-attn's Python entries (maybe_contiguous) and PyTorch's SDPA take operands of any strides;
// the library reads rows, so an operand whose last dimension is not contiguous is copied once.
Tensor rows_contiguous(const Tensor& t) { return t.dim() > 0 && t.size(-1) > 1 && t.stride(-1) != 1 ? t.contiguous() : t; }
OptTensor rows_contiguous(const OptTensor& t) { return t ? OptTensor(rows_contiguous(*t)) : t; }

// Whether the forward hands its row statistics to the backward (problem.hpp's softmax_stats: fp32
// on CUDA); elsewhere attention_forward_stats returns an empty tensor for them.
bool hands_stats(const Tensor& q) { return q.scalar_type() == at::kFloat && q.is_cuda(); }

// The forward, and with `with_stats` the row statistics it hands to the backward where it hands any
// (an empty tensor elsewhere).
std::tuple<Tensor, Tensor, Tensor> run_forward(const Tensor& q_arg, const Tensor& k_arg, const Tensor& v_arg,
                                               const OptTensor& cu_seqlens_q, const OptTensor& cu_seqlens_k,
                                               SymInt max_seqlen_q, SymInt max_seqlen_k,
                                               std::optional<double> softmax_scale, bool causal, SymInt window_left,
                                               SymInt window_right, double softcap, bool deterministic,
                                               const OptTensor& alibi_slopes, double dropout_p,
                                               const OptTensor& dropout_rng, bool with_stats) {
  return translate_errors([&] {
    const Tensor q = rows_contiguous(q_arg), k = rows_contiguous(k_arg), v = rows_contiguous(v_arg);
    const bool varlen = cu_seqlens_q.has_value();
    check_inputs(tensor_ref(q), tensor_ref(k), tensor_ref(v), varlen);
    Tensor out = empty_like_layout(q, v.size(-1));
    Tensor lse = varlen ? at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat))
                        : at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
    AttentionTensors t = tensors_of(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_rng);
    Tensor stats;
    if (with_stats && hands_stats(q)) {
      auto shape = lse.sizes().vec();
      shape.push_back(2);
      stats = at::empty(shape, lse.options());
      t.softmax_stats = tensor_ref(stats);
    } else if (with_stats) {
      stats = at::empty({0}, lse.options());
    }
    const Options o = options_of(q, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right,
                                 softcap, deterministic, dropout_p);
    plan_and_run(attention_problem(t, o), q, false);
    return std::make_tuple(out, lse, stats);
  });
}

std::tuple<Tensor, Tensor, Tensor> attention_forward_stats(
    const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& cu_seqlens_q, const OptTensor& cu_seqlens_k,
    SymInt max_seqlen_q, SymInt max_seqlen_k, std::optional<double> softmax_scale, bool causal, SymInt window_left,
    SymInt window_right, double softcap, bool deterministic, const OptTensor& alibi_slopes, double dropout_p,
    const OptTensor& dropout_rng) {
  return run_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, std::move(max_seqlen_q), std::move(max_seqlen_k),
                     softmax_scale, causal, std::move(window_left), std::move(window_right), softcap, deterministic,
                     alibi_slopes, dropout_p, dropout_rng, true);
}

std::tuple<Tensor, Tensor> attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const OptTensor& cu_seqlens_q, const OptTensor& cu_seqlens_k,
                                             SymInt max_seqlen_q, SymInt max_seqlen_k,
                                             std::optional<double> softmax_scale, bool causal, SymInt window_left,
                                             SymInt window_right, double softcap, bool deterministic,
                                             const OptTensor& alibi_slopes, double dropout_p,
                                             const OptTensor& dropout_rng) {
  auto [out, lse, stats] = run_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, std::move(max_seqlen_q),
                                       std::move(max_seqlen_k), softmax_scale, causal, std::move(window_left),
                                       std::move(window_right), softcap, deterministic, alibi_slopes, dropout_p,
                                       dropout_rng, false);
  return std::make_tuple(std::move(out), std::move(lse));
}

std::tuple<Tensor, Tensor, Tensor> attention_backward(
    const Tensor& dout_arg, const Tensor& q_arg, const Tensor& k_arg, const Tensor& v_arg, const Tensor& out,
    const Tensor& lse, const OptTensor& cu_seqlens_q, const OptTensor& cu_seqlens_k, SymInt max_seqlen_q,
    SymInt max_seqlen_k, std::optional<double> softmax_scale, bool causal, SymInt window_left, SymInt window_right,
    double softcap, bool deterministic, const OptTensor& alibi_slopes, double dropout_p,
    const OptTensor& dropout_rng, const OptTensor& softmax_stats, const OptTensor& dlse_arg) {
  return translate_errors([&] {
    const Tensor q = rows_contiguous(q_arg), k = rows_contiguous(k_arg), v = rows_contiguous(v_arg);
    check_inputs(tensor_ref(q), tensor_ref(k), tensor_ref(v), cu_seqlens_q.has_value());
    // dout comes from whatever follows attention (the gradient of a sum is an expanded tensor).
    const Tensor dout = rows_contiguous(dout_arg);
    Tensor dq = empty_like_layout(q, q.size(-1));
    Tensor dk = empty_like_layout(k, k.size(-1));
    Tensor dv = empty_like_layout(v, v.size(-1));
    AttentionTensors t = tensors_of(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_rng);
    t.dout = tensor_ref(dout);
    t.dq = tensor_ref(dq);
    t.dk = tensor_ref(dk);
    t.dv = tensor_ref(dv);
    // attention_forward_stats' third output; empty where that forward hands none over.
    if (softmax_stats && softmax_stats->numel() > 0) t.softmax_stats = tensor_ref(*softmax_stats);
    // lse's gradient, as autograd hands it (the gradient of a sum is an expanded tensor).
    Tensor dlse;
    if (dlse_arg && dlse_arg->defined()) {
      dlse = dlse_arg->contiguous();
      t.dlse = tensor_ref(dlse);
    }
    const Options o = options_of(q, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right,
                                 softcap, deterministic, dropout_p);
    plan_and_run(attention_problem(t, o), q, true);
    return std::make_tuple(dq, dk, dv);
  });
}

// The forward over a key/value cache (tileattn/kvcache.py: flash_attn_with_kvcache, and
// flash_attn_varlen_func with block_table or seqused_k): the cache tables, the append of k_new and
// v_new with the rotary embedding, and the attention, validated, planned and run in one call. An
// operator that writes the caches in place and has no gradient, so that torch.compile traces it;
// eager calls enter it through the Python entry below, without the dispatcher's boxing.
std::tuple<Tensor, Tensor> cache_forward(const Tensor& q_arg, const Tensor& k, const Tensor& v,
                                         const OptTensor& cu_seqlens_q, const OptTensor& cu_seqlens_k,
                                         int64_t max_seqlen_q, int64_t max_seqlen_k,
                                         std::optional<double> softmax_scale, bool causal, int64_t window_left,
                                         int64_t window_right, double softcap, const OptTensor& alibi_slopes,
                                         const OptTensor& seqused_k, const OptTensor& leftpad_k,
                                         const OptTensor& kv_batch_idx, const OptTensor& block_table,
                                         int64_t num_splits, const OptTensor& k_new_arg, const OptTensor& v_new_arg,
                                         const OptTensor& rotary_cos, const OptTensor& rotary_sin,
                                         bool rotary_interleaved) {
  return translate_errors([&] {
    // The caches are written in place, so only the operands that are read alone may be copied.
    const Tensor q = rows_contiguous(q_arg);
    const OptTensor k_new = rows_contiguous(k_new_arg), v_new = rows_contiguous(v_new_arg);
    const bool varlen = cu_seqlens_q.has_value();
    check_rank(tensor_ref(q), "q", varlen ? 3 : 4, varlen ? kVarlenDims : kFixedDims);
    // A v of the wrong rank is named by attention_problem.
    Tensor out = empty_like_layout(q, v.dim() > 0 ? v.size(-1) : 0);
    Tensor lse = varlen ? at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat))
                        : at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
    AttentionTensors t = tensors_of(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, std::nullopt);
    t.seqused_k = tensor_ref(seqused_k), t.leftpad_k = tensor_ref(leftpad_k);
    t.kv_batch_idx = tensor_ref(kv_batch_idx), t.block_table = tensor_ref(block_table);
    t.k_new = tensor_ref(k_new), t.v_new = tensor_ref(v_new);
    t.rotary_cos = tensor_ref(rotary_cos), t.rotary_sin = tensor_ref(rotary_sin);
    Options o = options_of(q, SymInt(max_seqlen_q), SymInt(max_seqlen_k), softmax_scale, causal, SymInt(window_left),
                           SymInt(window_right), softcap, false, 0.0);
    o.num_splits = int(num_splits);
    o.rotary_interleaved = rotary_interleaved;
    plan_and_run(attention_problem(t, o), q, false);
    return std::make_tuple(out, lse);
  });
}

using ForwardSig = decltype(attention_forward);
using ForwardStatsSig = decltype(attention_forward_stats);
using BackwardSig = decltype(attention_backward);

const c10::TypedOperatorHandle<ForwardSig>& forward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("tileattn::attention_forward", "").typed<ForwardSig>();
  return op;
}
const c10::TypedOperatorHandle<ForwardStatsSig>& forward_stats_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("tileattn::attention_forward_stats", "")
                             .typed<ForwardStatsSig>();
  return op;
}
const c10::TypedOperatorHandle<BackwardSig>& backward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("tileattn::attention_backward", "").typed<BackwardSig>();
  return op;
}

// Forward-mode AD (dual tensors) has no formula here: refused rather than returning outputs
// without tangents, as PyTorch does for its own operators that lack one.
void refuse_forward_ad(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout = Tensor()) {
  for (const Tensor* t : {&q, &k, &v, &dout})
    TORCH_CHECK_NOT_IMPLEMENTED(!t->defined() || !t->_fw_grad(/*level=*/0).defined(),
                                "tileattn: forward-mode AD (dual tensors, torch.func.jvp) through attention is not "
                                "supported; its gradients are reverse-mode only");
}

// attention_forward's node in the autograd graph: the gradient of out -> (q, k, v). Only Q, K, V,
// O and L are kept (nothing of size seqlen_q x seqlen_k); dropout's mask is regenerated from
// dropout_rng, never stored. A Node of its own, as PyTorch's generated ones are, rather than a
// torch::autograd::Function: that generic wrapper cost a tiny call about twice SDPA's autograd
// bookkeeping (docs/perf-log.md) and is refused by torch.func's transforms. The backward calls the
// operator through the dispatcher, so a torch.compile trace records it and a second derivative
// meets attention_backward's Autograd kernel.
struct AttentionBackward : torch::autograd::Node {
  torch::autograd::SavedVariable q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_rng, stats;
  SymInt max_seqlen_q, max_seqlen_k, window_left, window_right;
  std::optional<double> softmax_scale;
  double softcap = 0.0, dropout_p = 0.0;
  bool causal = false, deterministic = false;

  std::string name() const override { return "tileattn::AttentionBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    const Tensor saved_out = out.unpack(getptr());
    auto optional = [](const torch::autograd::SavedVariable& s) {
      Tensor t = s.unpack();
      return t.defined() ? OptTensor(std::move(t)) : std::nullopt;
    };
    const Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(saved_out);
    const OptTensor dlse = grads[1].defined() ? OptTensor(grads[1]) : std::nullopt;
    auto [dq, dk, dv] = backward_op().call(dout, q.unpack(), k.unpack(), v.unpack(), saved_out, lse.unpack(getptr()),
                                           optional(cu_seqlens_q), optional(cu_seqlens_k), max_seqlen_q,
                                           max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
                                           deterministic, optional(alibi_slopes), dropout_p, optional(dropout_rng),
                                           optional(stats), dlse);
    return {dq, dk, dv};
  }

  void release_variables() override {
    for (auto* s : {&q, &k, &v, &out, &lse, &cu_seqlens_q, &cu_seqlens_k, &alibi_slopes, &dropout_rng, &stats})
      s->reset_data();
  }
};

// A new node as the torch being built against holds one: Node became an intrusive_ptr target in
// recent releases (std::shared_ptr before, with deleteNode as its deleter, found here by ADL so
// that the name is only needed where it exists).
template <class N>
auto make_node() {
  using Ptr = decltype(std::declval<torch::autograd::Node&>().getptr());
  if constexpr (std::is_same_v<Ptr, std::shared_ptr<torch::autograd::Node>>) {
    return std::shared_ptr<N>(new N(), [](N* node) { deleteNode(node); });
  } else {
    return c10::make_intrusive<N>();
  }
}

// The message every route gives where a graph differentiates attention's gradients.
constexpr const char* kNoSecondDerivative =
    "tileattn: attention's backward has no derivative of its own; a second derivative through attention "
    "(gradients taken with create_graph=True, then differentiated) is not supported";

// attention_backward's Autograd kernel: the gradients it returns where a graph could differentiate
// them (create_graph=True, or torch.func's nested transforms) carry a node whose backward stops with
// kNoSecondDerivative. Without a kernel here the dispatcher's fallback would let such a graph run on
// with a zero second derivative and only a warning.
struct AttentionBackwardBackward : torch::autograd::Node {
  std::string name() const override { return "tileattn::AttentionBackwardBackward"; }
  torch::autograd::variable_list apply(torch::autograd::variable_list&&) override {
    TORCH_CHECK_NOT_IMPLEMENTED(false, kNoSecondDerivative);
  }
};

std::tuple<Tensor, Tensor, Tensor> attention_backward_autograd(
    const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
    const OptTensor& cu_seqlens_q, const OptTensor& cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k,
    std::optional<double> softmax_scale, bool causal, SymInt window_left, SymInt window_right, double softcap,
    bool deterministic, const OptTensor& alibi_slopes, double dropout_p, const OptTensor& dropout_rng,
    const OptTensor& softmax_stats, const OptTensor& dlse) {
  refuse_forward_ad(q, k, v, dout);
  Tensor dq, dk, dv;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    std::tie(dq, dk, dv) = backward_op().call(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                              max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
                                              deterministic, alibi_slopes, dropout_p, dropout_rng, softmax_stats,
                                              dlse);
  }
  if (at::GradMode::is_enabled() &&
      (dout.requires_grad() || q.requires_grad() || k.requires_grad() || v.requires_grad() || out.requires_grad())) {
    auto node = make_node<AttentionBackwardBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(dout, q, k, v, out));
    torch::autograd::set_history(std::vector<Tensor>{dq, dk, dv}, node);
  }
  return std::make_tuple(dq, dk, dv);
}

std::tuple<Tensor, Tensor> attention_forward_autograd(
    const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& cu_seqlens_q, const OptTensor& cu_seqlens_k,
    SymInt max_seqlen_q, SymInt max_seqlen_k, std::optional<double> softmax_scale, bool causal, SymInt window_left,
    SymInt window_right, double softcap, bool deterministic, const OptTensor& alibi_slopes, double dropout_p,
    const OptTensor& dropout_rng) {
  refuse_forward_ad(q, k, v);
  // Nothing to differentiate (inference, or no input that requires grad): no graph node to build.
  const bool grad = at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad());
  Tensor out, lse, stats;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    // A graph's fp32 CUDA forward keeps its row statistics for the backward.
    if (grad && hands_stats(q))
      std::tie(out, lse, stats) = forward_stats_op().call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                          max_seqlen_k, softmax_scale, causal, window_left,
                                                          window_right, softcap, deterministic, alibi_slopes,
                                                          dropout_p, dropout_rng);
    else
      std::tie(out, lse) =
          forward_op().call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                            window_left, window_right, softcap, deterministic, alibi_slopes, dropout_p, dropout_rng);
  }
  if (!grad) return std::make_tuple(out, lse);
  using torch::autograd::SavedVariable;
  auto node = make_node<AttentionBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(q, k, v));
  auto saved = [](const OptTensor& t) { return t ? SavedVariable(*t, false) : SavedVariable(); };
  node->q = SavedVariable(q, false);
  node->k = SavedVariable(k, false);
  node->v = SavedVariable(v, false);
  if (stats.defined()) node->stats = SavedVariable(stats, false);
  node->cu_seqlens_q = saved(cu_seqlens_q);
  node->cu_seqlens_k = saved(cu_seqlens_k);
  node->alibi_slopes = saved(alibi_slopes);
  node->dropout_rng = saved(dropout_rng);
  node->max_seqlen_q = std::move(max_seqlen_q);
  node->max_seqlen_k = std::move(max_seqlen_k);
  node->window_left = std::move(window_left);
  node->window_right = std::move(window_right);
  node->softmax_scale = softmax_scale;
  node->softcap = softcap;
  node->dropout_p = dropout_p;
  node->causal = causal;
  node->deterministic = deterministic;
  // Both outputs differentiable: L's gradient is each row's softmax (problem.hpp's dlse).
  torch::autograd::set_history(std::vector<Tensor>{out, lse}, node);
  node->out = SavedVariable(out, true);  // after set_history: saved as the node's own outputs
  node->lse = SavedVariable(lse, true);
  return std::make_tuple(out, lse);
}

}  // namespace

// The schemas are tileattn/_ops.py's fallback registration's, word for word; the arguments of both
// forward operators:
constexpr const char* kForwardArgs =
    "(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt max_seqlen_q, "
    "SymInt max_seqlen_k, float? softmax_scale, bool causal, SymInt window_left, SymInt window_right, "
    "float softcap, bool deterministic, Tensor? alibi_slopes=None, float dropout_p=0.0, Tensor? dropout_rng=None)";

TORCH_LIBRARY_FRAGMENT(tileattn, m) {
  const std::string forward = std::string("attention_forward") + kForwardArgs + " -> (Tensor, Tensor)";
  m.def(torch::schema(forward.c_str()));
  // attention_forward with the row statistics it hands to attention_backward (problem.hpp's
  // softmax_stats; empty where it hands none over). No gradient of its own: attention_forward's
  // autograd and tileattn.FlashAttentionFunction call it.
  const std::string forward_stats =
      std::string("attention_forward_stats") + kForwardArgs + " -> (Tensor, Tensor, Tensor)";
  m.def(torch::schema(forward_stats.c_str()));
  m.def("attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, "
        "float? softmax_scale, bool causal, SymInt window_left, SymInt window_right, float softcap, "
        "bool deterministic, Tensor? alibi_slopes=None, float dropout_p=0.0, Tensor? dropout_rng=None, "
        "Tensor? softmax_stats=None, Tensor? dlse=None) -> (Tensor, Tensor, Tensor)");
  // k and v are the caches, written in place where k_new and v_new are appended.
  m.def("cache_forward(Tensor q, Tensor(a!) k, Tensor(b!) v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
        "SymInt max_seqlen_q, SymInt max_seqlen_k, float? softmax_scale, bool causal, SymInt window_left, "
        "SymInt window_right, float softcap, Tensor? alibi_slopes, Tensor? seqused_k, Tensor? leftpad_k, "
        "Tensor? kv_batch_idx, Tensor? block_table, int num_splits, Tensor? k_new=None, Tensor? v_new=None, "
        "Tensor? rotary_cos=None, Tensor? rotary_sin=None, bool rotary_interleaved=True) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tileattn, CPU, m) {
  m.impl("attention_forward", &attention_forward);
  m.impl("attention_forward_stats", &attention_forward_stats);
  m.impl("attention_backward", &attention_backward);
  m.impl("cache_forward", &cache_forward);
}

TORCH_LIBRARY_IMPL(tileattn, CUDA, m) {
  m.impl("attention_forward", &attention_forward);
  m.impl("attention_forward_stats", &attention_forward_stats);
  m.impl("attention_backward", &attention_backward);
  m.impl("cache_forward", &cache_forward);
}

TORCH_LIBRARY_IMPL(tileattn, Autograd, m) {
  m.impl("attention_forward", &attention_forward_autograd);
  m.impl("attention_backward", &attention_backward_autograd);
  m.impl("attention_forward_stats", torch::CppFunction::makeFallthrough());  // called below autograd
  m.impl("cache_forward", torch::CppFunction::makeFallthrough());  // inference only: no gradient
}

namespace py = pybind11;

PYBIND11_MODULE(_torch_ops, m) {
  // The errors the kernels raise (translate_errors) as the Python exceptions tileattn._ext gives
  // for the same rules. Local: torch's own functions keep torch's translation.
  py::register_local_exception_translator([](std::exception_ptr e) {
    try {
      if (e) std::rethrow_exception(e);
    } catch (torch::PyTorchError& err) {
      PyErr_SetString(err.python_type(), err.what());
    } catch (const c10::NotImplementedError& err) {
      PyErr_SetString(PyExc_NotImplementedError, err.what_without_backtrace());
    } catch (const c10::Error& err) {
      PyErr_SetString(PyExc_RuntimeError, err.what_without_backtrace());
    }
  });
  // The eager forward: what torch.ops.tileattn.attention_forward does, with the arguments converted
  // by pybind11's casters instead of boxed through the operator's schema (a few microseconds of a
  // tiny call). Still a dispatcher call, so autograd, dispatch modes and fake tensors see it.
  m.def(
      "attention_forward",
      [](const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& cu_seqlens_q,
         const OptTensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, std::optional<double> softmax_scale,
         bool causal, int64_t window_left, int64_t window_right, double softcap, bool deterministic,
         const OptTensor& alibi_slopes, double dropout_p, const OptTensor& dropout_rng) {
        return forward_op().call(q, k, v, cu_seqlens_q, cu_seqlens_k, SymInt(max_seqlen_q), SymInt(max_seqlen_k),
                                 softmax_scale, causal, SymInt(window_left), SymInt(window_right), softcap,
                                 deterministic, alibi_slopes, dropout_p, dropout_rng);
      },
      py::call_guard<py::gil_scoped_release>());
  m.def("cache_forward", &cache_forward, py::call_guard<py::gil_scoped_release>());
#if !AT_PARALLEL_OPENMP || defined(_OPENMP)
  // tileattn._ext (imported first by tileattn._ops) links its own copy of the CPU backend: its
  // CPU calls (kv cache, softmax_matmul, merges, the Python route) take torch's threads too.
  m.attr("cpu_executor") = py::capsule(reinterpret_cast<void*>(&run_on_torch_threads), "tileattn.cpu_executor");
  try {
    py::module_::import("tileattn._ext").attr("set_cpu_executor")(m.attr("cpu_executor"));
  } catch (const py::error_already_set&) {
    // An _ext without the hook keeps its own pool.
  }
#endif
  // tileattn.check_cu_seqlens(enabled): the operators read it at every call.
  m.def("set_check_cu_seqlens",
        [](bool enabled) { g_check_cu_seqlens.store(enabled, std::memory_order_relaxed); });
}
