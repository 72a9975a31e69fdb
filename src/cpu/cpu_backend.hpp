#pragma once
// The CPU backend's entry points. Each takes a problem already validated and normalised by
// src/host/validate.hpp, with every pointer in host memory.
//
// Tiled like the GPU kernels (64 x 64 tiles, online softmax, fp32 accumulation, masked tiles
// skipped) and run on problem.num_threads std::threads (0 = all hardware threads). Scratch is
// allocated internally (no workspace). Results are bitwise identical for any thread count.
#include "tileattn/problem.hpp"

namespace tileattn::cpu {

void forward(const AttentionProblem& problem);
void backward(const AttentionProblem& problem);
void softmax_matmul(const SoftmaxMatmulProblem& problem);

}  // namespace tileattn::cpu
