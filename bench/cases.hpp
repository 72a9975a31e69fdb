#pragma once
// The problems the bench times: inputs filled once with seeded N(0, 1) values and shared by every
// implementation; each implementation gets its own outputs.
#include <cstdint>
#include <string>
#include <vector>

#include "memory.hpp"
#include "options.hpp"
#include "tileattn/problem.hpp"

namespace tileattn::bench {

struct AttentionCase {
  AttentionProblem problem;  // inputs bound; outputs unbound until bind_outputs
  Buffer q, k, v, dout, cu_seqlens_q, cu_seqlens_k;
  std::vector<int32_t> lengths_q, lengths_k;  // per sequence (varlen), else empty
  double forward_flops = 0, backward_flops = 0;
  std::string describe;  // e.g. "B=1 H=8/8 N=1024/1024 D=64/64 causal"
};

struct AttentionOutputs {
  Buffer o, lse, dq, dk, dv, workspace;
};

// Bytes of the tensors a case and one implementation's outputs take (the library's workspace
// aside), for refusing a problem too large for memory before allocating any of it.
double attention_case_bytes(const Options& options);
double softmax_matmul_case_bytes(const Options& options);

// Both throw std::invalid_argument, naming the flags to lower, when the tensors cannot fit in
// the backend's memory.
AttentionCase make_attention_case(const Options& options, Backend backend);

// Allocates O and L (and dQ, dK, dV when `backward`) in the inputs' layout and points `problem`
// at them. With `workspace`, also the library's workspace for the passes that run.
AttentionOutputs bind_outputs(AttentionProblem& problem, Backend backend, Layout layout, bool backward, bool workspace);

struct SoftmaxMatmulCase {
  SoftmaxMatmulProblem problem;
  Buffer x, v, out, workspace;
  double flops = 0;
  std::string describe;
};

SoftmaxMatmulCase make_softmax_matmul_case(const Options& options, Backend backend);

// A buffer of `dtype` elements widened to float64, for comparing implementations.
std::vector<double> to_double(const Buffer& buffer, DType dtype);

}  // namespace tileattn::bench
