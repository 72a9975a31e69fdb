#pragma once
// The float64 oracle: materialises the full score matrix of each (sequence, head) and computes
// everything in double. It exists for tests, never as a user path. Inputs are read from host
// memory in the problem's dtype and layout; the problem must be validated and normalised.
//
// Results are dense float64 arrays:
//   o   (rows_q, heads_q, headdim_v)        rows_q = batch * seqlen_q, or total_q for varlen
//   lse the problem's L layout: (batch, heads_q, seqlen_q) or (heads_q, total_q); -inf for empty rows
//   dq  (rows_q, heads_q, headdim_qk)
//   dk  (rows_k, heads_kv, headdim_qk)      rows_k = batch * seqlen_k, or total_k
//   dv  (rows_k, heads_kv, headdim_v)
// reference_backward reads Q, K, V and dO only: it recomputes O and L itself, so it does not
// inherit an error of the implementation under test. With OracleDelta::given_o it forms
// D = rowsum(dO * O) in dS = P (dP - D) from the problem's O instead: the exact result of a
// backward that takes O as an input, as the API's does. For 16-bit O the two differ by O's
// rounding, which reaches dQ and dK whole through D; comparing an implementation with the given-O
// result separates its own arithmetic from that. OracleDelta::given_stats also forms P as
// exp(S - L) from the problem's L, unnormalised: the exact result of a backward over part of the
// keys (AttentionProblem::partial_keys), which must take both from the whole problem's forward and
// so inherits their rounding, which no such backward can remove. The problem's dlse, when set, is
// read from host memory by both backward forms.
#include <vector>

#include "tileattn/problem.hpp"

namespace tileattn::cpu {

struct ReferenceForward {
  std::vector<double> o, lse;
};
struct ReferenceBackward {
  std::vector<double> dq, dk, dv;
};

enum class OracleDelta { exact, given_o, given_stats };

ReferenceForward reference_forward(const AttentionProblem& problem);
ReferenceBackward reference_backward(const AttentionProblem& problem, OracleDelta delta = OracleDelta::exact);

// The same oracle on dense float64 inputs in the layouts above (q (rows_q, heads_q, headdim_qk),
// k (rows_k, heads_kv, headdim_qk), v (rows_k, heads_kv, headdim_v), dout like o), for checks that
// need inputs no DType holds (finite differences). The problem supplies sizes, options and
// cu_seqlens; its tensor views and dtype are not read. given_o (like o), when set, is the O that
// D = rowsum(dO * O) is formed from (OracleDelta::given_o); given_lse (like lse), when set, the L
// that P = exp(S - L) is formed from (OracleDelta::given_stats).
ReferenceForward reference_forward_dense(const AttentionProblem& problem, const std::vector<double>& q,
                                         const std::vector<double>& k, const std::vector<double>& v);
ReferenceBackward reference_backward_dense(const AttentionProblem& problem, const std::vector<double>& q,
                                           const std::vector<double>& k, const std::vector<double>& v,
                                           const std::vector<double>& dout,
                                           const std::vector<double>* given_o = nullptr,
                                           const std::vector<double>* given_lse = nullptr);
// (batch, d1, d3); a row of X that is -inf throughout gives a zero row, as a fully masked
// attention row does.
std::vector<double> reference_softmax_matmul(const SoftmaxMatmulProblem& problem);

}  // namespace tileattn::cpu
