#include "cases.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <random>
#include <stdexcept>
#include <string>

#include <unistd.h>

#include "cpu/convert.hpp"
#include "tileattn/attention.hpp"
#include "tileattn/flops.hpp"

#ifdef TILEATTN_WITH_CUDA
#include "device.hpp"
#endif

namespace tileattn::bench {
namespace {

size_t element_bytes(DType dtype) { return size_t(cpu::dtype_size(dtype)); }

std::string gib(double bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f GiB", bytes / (1024.0 * 1024.0 * 1024.0));
  return buf;
}

// Refuses, before anything is allocated, a problem whose tensors cannot fit in the backend's
// memory: otherwise sizes near INT32_MAX end in std::bad_alloc (or an overflowed size) with no
// word on which flag asked for it. `bytes` is a double so that the product itself cannot overflow.
void check_fits(double bytes, Backend backend, const char* flags) {
  double total = 0;
  const char* where = "host";
  if (backend == Backend::cuda) {
#ifdef TILEATTN_WITH_CUDA
    total = double(device::total_memory());
    where = "device";
#endif
  } else {
    total = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE));
  }
  if (total > 0 && bytes > total) {
    throw std::invalid_argument("the problem's tensors need " + gib(bytes) + ", more than the " + gib(total) + " of " +
                                where + " memory (lower " + flags + ")");
  }
}

// A (batch, rows, heads, dim) tensor in the requested layout; `rows` is seqlen, or the total
// tokens of a varlen batch (then batch == 1 and batch_stride is unused).
Buffer make_tensor(TensorView& view, Backend backend, DType dtype, Layout layout, int64_t batch, int64_t rows,
                   int64_t heads, int64_t dim) {
  Buffer buffer(backend, size_t(batch * rows * heads * dim) * element_bytes(dtype));
  view.data = buffer.data();
  if (layout == Layout::bshd) {
    view.head_stride = dim;
    view.seq_stride = heads * dim;
  } else {
    view.seq_stride = dim;
    view.head_stride = rows * dim;
  }
  view.batch_stride = rows * heads * dim;
  return buffer;
}

void fill_normal(Buffer& buffer, DType dtype, std::mt19937_64& rng) {
  const int64_t n = int64_t(buffer.bytes() / element_bytes(dtype));
  std::vector<std::byte> host(buffer.bytes());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t i = 0; i < n; ++i) cpu::store_element(host.data(), i, dtype, normal(rng));
  buffer.upload(host.data());
}

std::vector<int32_t> draw_lengths(int64_t batch, int64_t max_len, std::mt19937_64& rng) {
  std::uniform_int_distribution<int64_t> pick(std::max<int64_t>(1, max_len / 2), max_len);
  std::vector<int32_t> lengths(static_cast<size_t>(batch));
  for (int32_t& n : lengths) n = int32_t(pick(rng));
  return lengths;
}

Buffer make_offsets(const std::vector<int32_t>& lengths, Backend backend, int64_t& total) {
  std::vector<int32_t> cu(1, 0);
  for (int32_t n : lengths) cu.push_back(cu.back() + n);
  total = cu.back();
  Buffer buffer(backend, cu.size() * sizeof(int32_t));
  buffer.upload(cu.data());
  return buffer;
}

}  // namespace

double attention_case_bytes(const Options& o) {
  const double e = double(cpu::dtype_size(o.dtype));
  const double dv = double(o.headdim_v > 0 ? o.headdim_v : o.headdim);
  const double hkv = double(o.heads_kv > 0 ? o.heads_kv : o.heads);
  const double rows_q = double(o.batch) * double(o.seqlen_q), rows_k = double(o.batch) * double(o.seqlen_k);
  const double q = rows_q * double(o.heads) * double(o.headdim), k = rows_k * hkv * double(o.headdim);
  const double v = rows_k * hkv * dv, out = rows_q * double(o.heads) * dv;
  const double inputs = q + k + v + out;  // q, k, v, dout
  const double outputs = out + (o.run_backward ? q + k + v : 0.0);  // o, dq, dk, dv
  return e * (inputs + outputs) + 4.0 * rows_q * double(o.heads);   // + fp32 L
}

double softmax_matmul_case_bytes(const Options& o) {
  const double b = double(o.batch), d1 = double(o.d1), d2 = double(o.d2), d3 = double(o.d3);
  return double(cpu::dtype_size(o.dtype)) * b * (d1 * d2 + d2 * d3 + d1 * d3);
}

AttentionCase make_attention_case(const Options& o, Backend backend) {
  check_fits(attention_case_bytes(o), backend, "--batch, --seqlen, --heads or --headdim");
  AttentionCase c;
  AttentionProblem& p = c.problem;
  p.batch = o.batch;
  p.seqlen_q = o.seqlen_q;
  p.seqlen_k = o.seqlen_k;
  p.heads_q = o.heads;
  p.heads_kv = o.heads_kv > 0 ? o.heads_kv : o.heads;
  p.headdim_qk = o.headdim;
  p.headdim_v = o.headdim_v > 0 ? o.headdim_v : o.headdim;
  p.dtype = o.dtype;
  p.causal = o.causal;
  p.window_left = o.window_left;
  p.window_right = o.window_right;
  p.softcap = o.softcap;
  p.softmax_scale = o.scale;
  p.deterministic = o.deterministic;
  p.fp32_mode = o.fp32_mode;
  p.backend = backend;
  p.num_threads = o.threads;

  std::mt19937_64 rng(o.seed);
  int64_t batch = p.batch, rows_q = p.seqlen_q, rows_k = p.seqlen_k;
  if (o.varlen) {
    c.lengths_q = draw_lengths(p.batch, p.seqlen_q, rng);
    c.lengths_k = p.seqlen_q == p.seqlen_k ? c.lengths_q : draw_lengths(p.batch, p.seqlen_k, rng);
    c.cu_seqlens_q = make_offsets(c.lengths_q, backend, p.total_q);
    c.cu_seqlens_k = make_offsets(c.lengths_k, backend, p.total_k);
    p.cu_seqlens_q = static_cast<const int32_t*>(c.cu_seqlens_q.data());
    p.cu_seqlens_k = static_cast<const int32_t*>(c.cu_seqlens_k.data());
    batch = 1;
    rows_q = p.total_q;
    rows_k = p.total_k;
  }
  c.q = make_tensor(p.q, backend, p.dtype, o.layout, batch, rows_q, p.heads_q, p.headdim_qk);
  c.k = make_tensor(p.k, backend, p.dtype, o.layout, batch, rows_k, p.heads_kv, p.headdim_qk);
  c.v = make_tensor(p.v, backend, p.dtype, o.layout, batch, rows_k, p.heads_kv, p.headdim_v);
  c.dout = make_tensor(p.dout, backend, p.dtype, o.layout, batch, rows_q, p.heads_q, p.headdim_v);
  for (Buffer* b : {&c.q, &c.k, &c.v, &c.dout}) fill_normal(*b, p.dtype, rng);

  if (o.varlen) {
    for (size_t b = 0; b < c.lengths_q.size(); ++b) {
      c.forward_flops +=
          attention_forward_flops(1, p.heads_q, c.lengths_q[b], c.lengths_k[b], p.headdim_qk, p.headdim_v, p.causal);
    }
    c.backward_flops = 2.5 * c.forward_flops;
  } else {
    c.forward_flops =
        attention_forward_flops(p.batch, p.heads_q, p.seqlen_q, p.seqlen_k, p.headdim_qk, p.headdim_v, p.causal);
    c.backward_flops =
        attention_backward_flops(p.batch, p.heads_q, p.seqlen_q, p.seqlen_k, p.headdim_qk, p.headdim_v, p.causal);
  }

  c.describe = "B=" + std::to_string(p.batch) + " H=" + std::to_string(p.heads_q) + "/" + std::to_string(p.heads_kv) +
               " N=" + std::to_string(p.seqlen_q) + "/" + std::to_string(p.seqlen_k) +
               " D=" + std::to_string(p.headdim_qk) + "/" + std::to_string(p.headdim_v);
  if (o.varlen) c.describe += " varlen";
  if (o.causal) c.describe += " causal";
  if (o.window_left >= 0 || o.window_right >= 0) {
    c.describe += " window=" + std::to_string(o.window_left) + "," + std::to_string(o.window_right);
  }
  if (o.softcap > 0.0f) c.describe += " softcap";
  return c;
}

AttentionOutputs bind_outputs(AttentionProblem& p, Backend backend, Layout layout, bool backward, bool workspace) {
  AttentionOutputs out;
  const bool varlen = p.is_varlen();
  const int64_t batch = varlen ? 1 : p.batch;
  const int64_t rows_q = varlen ? p.total_q : p.seqlen_q, rows_k = varlen ? p.total_k : p.seqlen_k;
  auto like = [&](TensorView& view, int64_t rows, int64_t heads, int64_t dim) {
    return make_tensor(view, backend, p.dtype, layout, batch, rows, heads, dim);
  };
  out.o = like(p.o, rows_q, p.heads_q, p.headdim_v);
  out.lse = Buffer(backend, size_t(p.heads_q * batch * rows_q) * sizeof(float));
  p.lse = static_cast<float*>(out.lse.data());
  if (backward) {
    out.dq = like(p.dq, rows_q, p.heads_q, p.headdim_qk);
    out.dk = like(p.dk, rows_k, p.heads_kv, p.headdim_qk);
    out.dv = like(p.dv, rows_k, p.heads_kv, p.headdim_v);
  }
  if (workspace) {
    size_t bytes = forward_workspace_size(p);
    if (backward) bytes = std::max(bytes, backward_workspace_size(p));
    out.workspace = Buffer(backend, bytes);
    p.workspace = out.workspace.data();
    p.workspace_bytes = bytes;
  }
  return out;
}

SoftmaxMatmulCase make_softmax_matmul_case(const Options& o, Backend backend) {
  check_fits(softmax_matmul_case_bytes(o), backend, "--batch, --d1, --d2 or --d3");
  SoftmaxMatmulCase c;
  SoftmaxMatmulProblem& p = c.problem;
  p.batch = o.batch;
  p.d1 = o.d1;
  p.d2 = o.d2;
  p.d3 = o.d3;
  p.dtype = o.dtype;
  p.fp32_mode = o.fp32_mode;
  p.backend = backend;
  p.num_threads = o.threads;
  const size_t e = element_bytes(p.dtype);
  c.x = Buffer(backend, size_t(p.batch * p.d1 * p.d2) * e);
  c.v = Buffer(backend, size_t(p.batch * p.d2 * p.d3) * e);
  c.out = Buffer(backend, size_t(p.batch * p.d1 * p.d3) * e);
  p.x = c.x.data();
  p.v = c.v.data();
  p.out = c.out.data();
  p.x_row_stride = p.d2;
  p.x_batch_stride = p.d1 * p.d2;
  p.v_row_stride = p.d3;
  p.v_batch_stride = p.d2 * p.d3;
  p.out_row_stride = p.d3;
  p.out_batch_stride = p.d1 * p.d3;
  std::mt19937_64 rng(o.seed);
  fill_normal(c.x, p.dtype, rng);
  fill_normal(c.v, p.dtype, rng);
  if (backend == Backend::cuda) {
    const size_t bytes = softmax_matmul_workspace_size(p);
    c.workspace = Buffer(backend, bytes);
    p.workspace = c.workspace.data();
    p.workspace_bytes = bytes;
  }
  c.flops = softmax_matmul_flops(p.batch, p.d1, p.d2, p.d3);
  c.describe = "B=" + std::to_string(p.batch) + " d1=" + std::to_string(p.d1) + " d2=" + std::to_string(p.d2) +
               " d3=" + std::to_string(p.d3);
  return c;
}

std::vector<double> to_double(const Buffer& buffer, DType dtype) {
  std::vector<std::byte> host(buffer.bytes());
  buffer.download(host.data());
  const int64_t n = int64_t(buffer.bytes() / element_bytes(dtype));
  std::vector<double> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[size_t(i)] = cpu::load_element(host.data(), i, dtype);
  return out;
}

}  // namespace tileattn::bench
