#pragma once
// The "same-precision naive implementation" of flash-attn's 2x rule, in C++: attention written
// from its definition with the full score matrix, every operation's result rounded to the
// problem's dtype, the way `softmax(Q K^T * scale) V` and its autograd run in a framework:
//   S = Q K^T * scale (+ ALiBi's bias; masked -inf), P = softmax(S), O = P V,
//   dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(P * dP)), dQ = dS K * scale, dK = dS^T Q * scale.
// Dot products are one fp32 running sum of fused multiply-adds per element, as a BLAS
// micro-kernel accumulates each output element. Fixed-length problems without soft-capping; the
// layouts of cpu/reference.hpp.
#include <vector>

#include "tileattn/problem.hpp"

namespace tileattn::test {

struct NaiveResult {
  std::vector<double> o, lse, dq, dk, dv;
};

NaiveResult naive_attention(const AttentionProblem& problem);

}  // namespace tileattn::test
