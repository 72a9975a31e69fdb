#pragma once
// The CPU backend's entry points. Each takes a problem already validated and normalised by
// src/host/validate.hpp, with every pointer in host memory.
#include "tileattn/problem.hpp"

namespace tileattn::cpu {

void forward(const AttentionProblem& problem);
void backward(const AttentionProblem& problem);
void softmax_matmul(const SoftmaxMatmulProblem& problem);

}  // namespace tileattn::cpu
