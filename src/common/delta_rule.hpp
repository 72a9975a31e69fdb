#pragma once
// Where the backward's D = rowsum(O * dO) is not accurate enough, so that D must come from the
// gradient passes' own P and dP, D = rowsum(P * dP) / rowsum(P) (docs/accuracy.md). One rule for
// the CPU backward (src/cpu/backward.cpp), the CUDA 16-bit backward (bwd_row_stats.cuh) and the
// Hopper exact fp32 backward, which otherwise takes rowsum(O * dO) on rows of many keys
// (BwdParams::delta_from_out); the portable CUDA fp32 backward forms D from P and dP always.
#include "tileattn/problem.hpp"

namespace tileattn {

// dS = P (dP - D) cancels D against dP, and rowsum(O * dO) agrees with the passes' P and dP only up
// to O's rounding summed over headdim_v, which is the whole result where the exact dS is ~0:
//  - headdim_qk <= 8: scores are few-term sums and rows peaky, so a handful of elements carry dQ
//    and dK (fp32 on the CPU: the 2x rule failed at headdim_qk 1-4, held from 8 up with headdim_v
//    up to 256; bf16 on CUDA, headdim 1/55: dK 0.257 against a naive backward's 0.065);
//  - keys or values repeated along the sequence (stride 0, expand()): with one V row every dP of a
//    row is the same value and the exact dS is 0 (fp32, 2 keys, headdim 205: dQ 6.5e-6 against a
//    naive 6e-7).
// Never with partial_keys: a part's P and dP are not the row's, so D must be the given O's.
inline bool delta_from_p_and_dp(const AttentionProblem& p) {
  if (p.partial_keys) return false;
  const bool keys_repeat = !p.is_paged() && p.seqlen_k > 1 && (p.k.seq_stride == 0 || p.v.seq_stride == 0);
  return p.headdim_qk <= 8 || keys_repeat;
}

}  // namespace tileattn
