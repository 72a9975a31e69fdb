#pragma once
// Host test tensors for attention and softmax(X)@V problems.
//
//   ProblemShape shape;                 // sizes, dtype, options, layout (fields below)
//   shape.seqlen_q = 128; ...
//   HostProblem hp(shape);              // allocates, fills Q/K/V/dO with fresh random values,
//                                       // poisons O, L, dQ, dK, dV and every gap in the buffers
//   tileattn::forward(hp.problem);      // hp.problem points into hp's buffers
//   ErrorStats e = compare(hp.o.gather(), ref.o);       // support/metrics.hpp
//   EXPECT_EQ(hp.o.touched_outside_view(), 0);
//
// Seeds come from std::random_device; set TILEATTN_TEST_SEED to replay one. While a HostProblem
// lives, its seed and shape are attached to every gtest failure (a ScopedTrace member), so keep it
// a local of the test body.
//
// Device tests: copy each HostTensor's `bytes` (and hp.lse / cu_seqlens) to device buffers of the
// same size and point the problem's views there; strides are in elements and carry over. Copy the
// outputs back into the same HostTensor before calling gather() / touched_outside_view().
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "tileattn/problem.hpp"

namespace tileattn::test {

enum class Layout {
  bshd,    // (batch, seqlen, heads, dim) contiguous: flash-attn's layout
  bhsd,    // (batch, heads, seqlen, dim) contiguous: PyTorch SDPA's layout seen through strides
  padded,  // bshd with poisoned gaps after each head, row and batch (multiples of 8 elements)
};

struct ProblemShape {
  int64_t batch = 1;
  int64_t seqlen_q = 1, seqlen_k = 1;
  int64_t heads_q = 1, heads_kv = 1;
  int64_t headdim_qk = 64;
  int64_t headdim_v = 0;  // 0: same as headdim_qk
  DType dtype = DType::f32;
  // Variable length when non-empty (both, same size): batch, seqlen_q/k (the max) and
  // total_q/k are then derived from them.
  std::vector<int32_t> seqlens_q, seqlens_k;
  Layout layout = Layout::bshd;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;
  float softcap = 0.0f;
  // ALiBi slopes, random in [0, 0.5) (flash-attn's tests draw [0, 0.3)): one per query head
  // (flash-attn's (heads,) shape, alibi_batch_stride 0) or one per (sequence, head).
  enum class Alibi { none, per_head, per_batch_head };
  Alibi alibi = Alibi::none;
  std::optional<float> softmax_scale;
  bool with_backward = true;  // allocate dO, dQ, dK, dV
  bool lse_grad = false;      // with the backward, a gradient for L too (problem.hpp's dlse), N(0, 1)
  int num_threads = 0;

  std::string describe() const;
};

// One strided (batch, seqlen, heads, dim) tensor in its own buffer; varlen: batch 1, seqlen total.
struct HostTensor {
  DType dtype = DType::f32;
  int64_t batch = 0, seqlen = 0, heads = 0, dim = 0;
  TensorView view;  // strides into `bytes`; view.data points at bytes.data()
  std::vector<std::byte> bytes;

  HostTensor() = default;
  HostTensor(DType dtype, int64_t batch, int64_t seqlen, int64_t heads, int64_t dim, Layout layout);
  HostTensor(const HostTensor&) = delete;             // view.data points into bytes
  HostTensor& operator=(const HostTensor&) = delete;
  HostTensor(HostTensor&&) = default;                 // vector moves keep the buffer
  HostTensor& operator=(HostTensor&&) = default;

  int64_t elements() const { return int64_t(bytes.size()) / (dtype == DType::f32 ? 4 : 2); }
  void fill_random(std::mt19937_64& rng);   // N(0, 1) rounded to dtype, inside the view
  void poison();                            // the poison pattern everywhere, view included
  // Dense float64 copy, (batch * seqlen, heads, dim) row-major.
  std::vector<double> gather() const;
  // The inverse: stores a dense array (as gather returns) into the view, rounded to dtype.
  void scatter(const std::vector<double>& dense);
  // Elements outside the view (gaps and the guard tail) that no longer hold the poison pattern.
  int64_t touched_outside_view() const;
};

class HostProblem {
 public:
  explicit HostProblem(const ProblemShape& shape);
  HostProblem(const HostProblem&) = delete;
  HostProblem& operator=(const HostProblem&) = delete;

  ProblemShape shape;
  uint64_t seed;
  HostTensor q, k, v, o, dout, dq, dk, dv;  // dout/dq/dk/dv empty unless shape.with_backward
  std::vector<float> lse;                   // L plus a poisoned guard tail
  std::vector<int32_t> cu_seqlens_q, cu_seqlens_k;
  std::vector<float> alibi_slopes;  // empty without ALiBi
  std::vector<float> dlse;          // empty without shape.lse_grad
  AttentionProblem problem;  // points at the buffers above; options from the shape

  int64_t rows_q() const { return q.batch * q.seqlen; }  // batch * seqlen_q, or total_q
  int64_t rows_k() const { return k.batch * k.seqlen; }
  int64_t lse_elements() const { return problem.heads_q * rows_q(); }
  std::vector<double> gather_lse() const;  // the problem's L layout, float64
  int64_t lse_guard_touched() const;
  void poison_outputs();  // O, L, dQ, dK, dV back to poison (e.g. between two runs)

 private:
  testing::ScopedTrace trace_;
};

// softmax(X) @ V with X (batch, d1, d2), V (batch, d2, d3), out (batch, d1, d3); `padded` puts
// poisoned gaps after each row and batch. X is N(0, x_scale) so rows can be made peaky, plus
// x_ramp * key so that each row's max keeps climbing along the keys. With masked_rows, rows
// r % 7 == 3 are -inf throughout (every key masked) and rows r % 5 == 1 at every third key.
struct SoftmaxMatmulShape {
  int64_t batch = 1, d1 = 1, d2 = 1, d3 = 1;
  DType dtype = DType::f32;
  bool padded = false;
  float x_scale = 1.0f;
  float x_ramp = 0.0f;
  bool masked_rows = false;
  int num_threads = 0;
  static bool row_fully_masked(int64_t r) { return r % 7 == 3; }
  std::string describe() const;
};

class HostSoftmaxMatmul {
 public:
  explicit HostSoftmaxMatmul(const SoftmaxMatmulShape& shape);
  HostSoftmaxMatmul(const HostSoftmaxMatmul&) = delete;
  HostSoftmaxMatmul& operator=(const HostSoftmaxMatmul&) = delete;

  SoftmaxMatmulShape shape;
  uint64_t seed;
  HostTensor x, v, out;  // heads == 1: (batch, rows, 1, cols)
  SoftmaxMatmulProblem problem;

 private:
  testing::ScopedTrace trace_;
};

// A fresh seed (std::random_device), or TILEATTN_TEST_SEED when set.
uint64_t fresh_seed();

}  // namespace tileattn::test
