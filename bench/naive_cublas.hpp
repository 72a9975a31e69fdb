#pragma once
// The naive peer (CUDA builds only): S = Q K^T with cuBLAS, a row softmax kernel, O = P V; the
// backward recomputes P from L and runs the five products of the textbook gradient. Every score
// matrix is materialised (batch * heads_q * seqlen_q * seqlen_k elements in the input dtype),
// which is the memory and bandwidth cost tileattn exists to avoid.
#include <memory>
#include <string>

#include "tileattn/problem.hpp"

namespace tileattn::bench {

class NaiveAttention {
 public:
  // `problem` has device tensors; the peer writes its o, lse, dq, dk and dv. Variable-length
  // batches are not supported (see unsupported_reason).
  explicit NaiveAttention(const AttentionProblem& problem);
  ~NaiveAttention();
  NaiveAttention(const NaiveAttention&) = delete;
  NaiveAttention& operator=(const NaiveAttention&) = delete;

  void forward();
  void backward();

  // Why the peer cannot run `problem`, or empty when it can.
  static std::string unsupported_reason(const AttentionProblem& problem);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace tileattn::bench
