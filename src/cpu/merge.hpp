#pragma once
// The CPU merge of partial attention results (include/tileattn/merge.hpp). Takes a problem
// validated by src/host/validate.cpp, with every pointer host memory.
#include "tileattn/merge.hpp"

namespace tileattn::cpu {

void merge_attention(const MergeProblem& problem);

}  // namespace tileattn::cpu
