#pragma once
// The "same-precision naive implementation" of flash-attn's 2x rule, in C++: attention written
// from its definition with the full score matrix, every operation's result rounded to the
// problem's dtype, the way `softmax(Q K^T * scale) V` and its autograd run in a framework:
//   S = Q K^T * scale (+ ALiBi's bias; masked -inf), P = softmax(S), O = P V,
//   dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(P * dP) + dL), dQ = dS K * scale, dK = dS^T Q * scale
// (dL: the problem's dlse, 0 without one).
// Dot products are one fp32 running sum of fused multiply-adds per element, as a BLAS
// micro-kernel accumulates each output element. Fixed-length problems without soft-capping; the
// layouts of cpu/reference.hpp.
#include <vector>

#include "tileattn/problem.hpp"

namespace tileattn::test {

struct NaiveResult {
  std::vector<double> o, lse, dq, dk, dv;
};

struct NaiveOptions {
  // Terms per run of the Q K^T dot products: 0 is one running sum; n > 0 sums runs of n terms,
  // each from zero, added in order, as a BLAS that blocks the shared dimension does. PyTorch's
  // CPU matmul (MKL) is more accurate than one running sum over long rows (head dim 256: mean
  // error 2.4e-6 against 3.2e-6), so a test whose Python twin compares with it needs a naive
  // implementation at least that accurate.
  int64_t score_run = 0;
  // The naive form of a backward over part of the keys (AttentionProblem::partial_keys): P from
  // the problem's stored L, P = exp(S - L), and D = rowsum(dO * O) from its stored O, as such a
  // backward must take them (each part sees only its own keys). The forward results stay empty.
  bool probs_from_lse = false;
};

NaiveResult naive_attention(const AttentionProblem& problem, const NaiveOptions& options = {});

}  // namespace tileattn::test
