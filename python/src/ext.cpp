// tileattn._ext: the binding layer for any DLPack producer. Tensors arrive through DLPack
// (nb::ndarray), so the module never links libtorch. Its checks are tensor_args.hpp's, shared with
// the PyTorch operator library (torch_ops.cpp); every other rule is the library's
// (src/host/validate.cpp). tileattn::Error becomes tileattn.errors' InvalidArgumentError or
// InvalidTypeError, NotImplementedError or RuntimeError by its kind.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/philox.hpp"
#include "error_classes.hpp"
#include "tensor_args.hpp"
#include "tileattn/tileattn.hpp"

namespace nb = nanobind;
using tileattn::Error;
using tileattn::ErrorKind;
using tileattn::python::error_class;
using namespace tileattn::bind;

namespace {

using Array = nb::ndarray<>;
using OptArray = std::optional<Array>;

TensorRef tensor_ref(const Array& a) {
  const auto t = a.dtype();
  TensorRef r;
  r.ptr = a.data();
  r.type = DType{t.code, t.bits, t.lanes};
  r.device = a.device_type();
  r.device_index = a.device_id();
  r.rank = a.ndim();
  r.sizes = a.shape_ptr();
  r.steps = a.stride_ptr();
  return r;
}
OptRef tensor_ref(const OptArray& a) { return a ? OptRef(tensor_ref(*a)) : std::nullopt; }

std::pair<void*, size_t> workspace_of(const OptArray& w, const Array& ref_array) {
  if (!w) return {nullptr, 0};
  const TensorRef r = tensor_ref(*w), q = tensor_ref(ref_array);
  if (!same_device(r, q))
    fail(ErrorKind::invalid_argument, "workspace is on " + device_name(r) + " but q is on " + device_name(q));
  if (w->ndim() != 1 || (w->shape(0) > 1 && w->stride(0) != 1))
    fail(ErrorKind::invalid_argument, "workspace must be a contiguous 1-D tensor, got shape " + shape_of(r));
  return {w->data(), w->nbytes()};
}

// One attention call (forward, and backward when the gradient tensors are given). Holds the
// arrays so that the pointers in `problem_` stay valid for the object's lifetime.
class Attention {
 public:
  Attention(Array q, Array k, Array v, Array out, Array lse, OptArray cu_seqlens_q, OptArray cu_seqlens_k,
            const Options& options, OptArray dout, OptArray dq, OptArray dk, OptArray dv, OptArray alibi_slopes,
            OptArray seqused_k, OptArray leftpad_k, OptArray kv_batch_idx, OptArray block_table,
            OptArray dropout_rng, OptArray k_new, OptArray v_new, OptArray rotary_cos, OptArray rotary_sin,
            OptArray softmax_stats, OptArray dlse)
      : q_(q), k_(k), v_(v), out_(out), lse_(lse), dout_(dout), dq_(dq), dk_(dk), dv_(dv),
        cu_q_(cu_seqlens_q), cu_k_(cu_seqlens_k), alibi_(alibi_slopes), rng_(dropout_rng),
        seqused_k_(seqused_k), leftpad_k_(leftpad_k), kv_batch_idx_(kv_batch_idx), block_table_(block_table),
        k_new_(k_new), v_new_(v_new), rotary_cos_(rotary_cos), rotary_sin_(rotary_sin), stats_(softmax_stats),
        dlse_(dlse) {
    const auto r = [](const auto& a) { return tensor_ref(a); };
    const AttentionTensors t{r(q_),         r(k_),         r(v_),        r(out_),         r(lse_),      r(cu_q_),
                             r(cu_k_),      r(dout_),      r(dq_),       r(dk_),          r(dv_),       r(alibi_),
                             r(rng_),       r(seqused_k_), r(leftpad_k_), r(kv_batch_idx_), r(block_table_),
                             r(k_new_),     r(v_new_),     r(rotary_cos_), r(rotary_sin_), r(stats_),
                             r(dlse_)};
    problem_ = attention_problem(t, options);
  }

  // Validates and plans the call once (kernel, split count, workspace size, tensor maps) for the
  // stream it will run on, and returns the workspace size the run needs; run() then executes
  // that plan. The stream matters to planning: the opt-in cu_seqlens check reads on it.
  size_t plan_forward(uintptr_t stream) {
    plan_ = tileattn::plan_forward(with_stream(stream));
    return plan_->workspace_size();
  }
  size_t plan_backward(uintptr_t stream) {
    if (!dout_) fail(ErrorKind::invalid_argument, "backward needs dout, dq, dk and dv");
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
  tileattn::AttentionProblem with_stream(uintptr_t stream) const {
    auto p = problem_;
    p.stream = reinterpret_cast<void*>(stream);
    return p;
  }

  Array q_, k_, v_, out_, lse_;
  OptArray dout_, dq_, dk_, dv_, cu_q_, cu_k_, alibi_, rng_, seqused_k_, leftpad_k_, kv_batch_idx_, block_table_;
  OptArray k_new_, v_new_, rotary_cos_, rotary_sin_, stats_, dlse_;
  tileattn::AttentionProblem problem_;
  std::optional<tileattn::Plan> plan_;
};

// out = softmax(x, dim=-1) @ v for x (batch, d1, d2), v (batch, d2, d3), out (batch, d1, d3).
class SoftmaxMatmul {
 public:
  SoftmaxMatmul(Array x, Array v, Array out, bool fp32_fast, int num_threads) : x_(x), v_(v), out_(out) {
    const TensorRef rx = tensor_ref(x_), rv = tensor_ref(v_), ro = tensor_ref(out_);
    check_operand(rx, "x", 3, "(batch, d1, d2)", rx, "x");
    check_operand(rv, "v", 3, "(batch, d2, d3)", rx, "x");
    check_operand(ro, "out", 3, "(batch, d1, d3)", rx, "x");
    auto& p = problem_;
    p.batch = int64_t(x_.shape(0));
    p.d1 = int64_t(x_.shape(1));
    p.d2 = int64_t(x_.shape(2));
    p.d3 = int64_t(v_.shape(2));
    check_shape(rv, "v", {p.batch, p.d2, p.d3}, "(batch and d2 from x.shape)");
    check_shape(ro, "out", {p.batch, p.d1, p.d3}, "(batch, d1 from x; d3 from v)");
    p.dtype = *dtype_of(rx);
    p.backend = backend_for(rx, "x");
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
    p.check_memory_spaces = false;  // the devices were checked above
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
        case ErrorKind::invalid_argument: type = error_class("InvalidArgumentError", PyExc_ValueError); break;
        case ErrorKind::invalid_type: type = error_class("InvalidTypeError", PyExc_TypeError); break;
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
      .def_rw("rotary_interleaved", &Options::rotary_interleaved)
      .def_rw("dropout_p", &Options::dropout_p)
      .def_rw("dropout_seed", &Options::dropout_seed)
      .def_rw("dropout_offset", &Options::dropout_offset);

  // dropout_keep_mask(out, dropout_p, seed, offset): out (batch, heads, seqlen_q, seqlen_k), uint8,
  // contiguous, on the CPU, set to 1 where the mask rule of src/common/philox.hpp keeps element
  // (b, h, i, j) and 0 where it drops it; positions are those within each sequence.
  m.def(
      "dropout_keep_mask",
      [](Array out, float dropout_p, uint64_t seed, uint64_t offset) {
        const TensorRef r = tensor_ref(out);
        if (r.device != kCpu)
          fail(ErrorKind::invalid_argument, "out is on " + device_name(r) + "; the keep mask is built on the cpu");
        if (r.type != kU8) fail(ErrorKind::invalid_type, "out.dtype=" + dtype_name(r) + " must be uint8");
        if (out.ndim() != 4)
          fail(ErrorKind::invalid_argument, "out must have 4 dimensions (batch, heads, seqlen_q, seqlen_k), got shape " +
                                                shape_of(r));
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
                    OptArray, OptArray, OptArray, OptArray, OptArray, OptArray, OptArray, OptArray, OptArray, OptArray,
                    OptArray, OptArray, OptArray>(),
           nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("lse"), nb::arg("cu_seqlens_q").none(),
           nb::arg("cu_seqlens_k").none(), nb::arg("options"), nb::arg("dout").none() = nb::none(),
           nb::arg("dq").none() = nb::none(), nb::arg("dk").none() = nb::none(), nb::arg("dv").none() = nb::none(),
           nb::kw_only(), nb::arg("alibi_slopes").none() = nb::none(), nb::arg("seqused_k").none() = nb::none(),
           nb::arg("leftpad_k").none() = nb::none(), nb::arg("kv_batch_idx").none() = nb::none(),
           nb::arg("block_table").none() = nb::none(), nb::arg("dropout_rng").none() = nb::none(),
           nb::arg("k_new").none() = nb::none(), nb::arg("v_new").none() = nb::none(),
           nb::arg("rotary_cos").none() = nb::none(), nb::arg("rotary_sin").none() = nb::none(),
           nb::arg("softmax_stats").none() = nb::none(), nb::arg("dlse").none() = nb::none())
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
  m.attr("max_headdim") = tileattn::kMaxHeadDim;
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
      [](Array out_array, Array lse_array, Array out_b_array, Array lse_b_array, uintptr_t stream, int num_threads) {
        const TensorRef out = tensor_ref(out_array), lse = tensor_ref(lse_array);
        const TensorRef out_b = tensor_ref(out_b_array), lse_b = tensor_ref(lse_b_array);
        const bool varlen = out.ndim() == 3;
        const size_t rank = varlen ? 3 : 4;
        const char* dims = varlen ? kVarlenDims : kFixedDims;
        if (out.ndim() != 3 && out.ndim() != 4)
          fail(ErrorKind::invalid_argument, std::string("out must have 4 dimensions ") + kFixedDims + " or 3 " +
                                                kVarlenDims + ", got shape " + shape_of(out));
        check_operand(out, "out", rank, dims, out, "out");
        if (!dtype_of(out_b))
          fail(ErrorKind::invalid_type, "out_b.dtype=" + dtype_name(out_b) +
                                            " is not supported (float16, bfloat16 or float32)");
        check_shape(out_b, "out_b", Dims(out), "(the shape of out)");
        check_same_device(out_b, "out_b", out, "out");
        check_last_contiguous(out_b, "out_b");
        tileattn::MergeProblem p;
        const int64_t b = varlen ? 1 : int64_t(out.shape(0)), n = int64_t(out.shape(rank - 3));
        p.batch = b, p.seqlen = n, p.heads = int64_t(out.shape(rank - 2)), p.headdim = int64_t(out.shape(rank - 1));
        const Dims l_shape = varlen ? Dims{p.heads, n} : Dims{b, p.heads, n};
        const char* l_why = varlen ? "(heads, total)" : "(batch, heads, seqlen)";
        for (auto [l, name] : {std::pair<const TensorRef*, const char*>{&lse, "lse"}, {&lse_b, "lse_b"}}) {
          if (l->type != kF32)
            fail(ErrorKind::invalid_type, std::string(name) + ".dtype=" + dtype_name(*l) + " must be float32");
          check_same_device(*l, name, out, "out");
          check_shape(*l, name, l_shape, l_why);
          check_last_contiguous(*l, name);
        }
        const auto view = [&](const TensorRef& a) {
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

  // The CPU tasks of this module's calls on the executor the PyTorch operator library hands over
  // at its import (torch's intra-op pool, tileattn/cpu_executor.hpp), so that they too share torch's
  // threads instead of this module's own pool. This module links the library's own copy.
  // None restores the module's own pool.
  m.def("set_cpu_executor", [](std::optional<nb::capsule> executor_or_none) {
    if (!executor_or_none) return tileattn::set_cpu_executor(nullptr);
    const nb::capsule& executor = *executor_or_none;
    const char* name = executor.name() ? executor.name() : "";
    if (std::string_view(name) != "tileattn.cpu_executor")
      fail(ErrorKind::invalid_type,
           std::string("executor is a capsule named '") + name + "', not 'tileattn.cpu_executor'");
    tileattn::set_cpu_executor(reinterpret_cast<tileattn::CpuExecutor>(executor.data()));
  }, nb::arg("executor").none());
}
