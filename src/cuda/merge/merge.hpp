#pragma once
// The CUDA merge of partial attention results (include/tileattn/merge.hpp), declared in plain C++
// for src/host/api.cpp. Takes a problem validated by src/host/validate.cpp, with every pointer
// device memory.
#include "tileattn/merge.hpp"

namespace tileattn::cuda {

void merge_attention(const MergeProblem& problem);

}  // namespace tileattn::cuda
