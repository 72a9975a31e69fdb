#pragma once
// The one FLOP count every benchmark reports (DESIGN.md "Performance method"): two matrix
// products of 2*Nq*Nk*D each, halved under a causal mask; the backward counts 2.5x the forward
// (five products instead of two). Masked work that kernels skip is not subtracted beyond causal,
// so figures compare directly with flash-attn's and PyTorch's published numbers.
#include <cstdint>

namespace tileattn {

inline double attention_forward_flops(int64_t batch, int64_t heads_q, int64_t seqlen_q, int64_t seqlen_k,
                                      int64_t headdim_qk, int64_t headdim_v, bool causal) {
  double f = 2.0 * double(batch) * double(heads_q) * double(seqlen_q) * double(seqlen_k) *
             double(headdim_qk + headdim_v);
  return causal ? f / 2.0 : f;
}

inline double attention_backward_flops(int64_t batch, int64_t heads_q, int64_t seqlen_q, int64_t seqlen_k,
                                       int64_t headdim_qk, int64_t headdim_v, bool causal) {
  return 2.5 * attention_forward_flops(batch, heads_q, seqlen_q, seqlen_k, headdim_qk, headdim_v, causal);
}

// softmax(X) @ V: one product of 2*d1*d2*d3 per batch (the exponentials are not counted).
inline double softmax_matmul_flops(int64_t batch, int64_t d1, int64_t d2, int64_t d3) {
  return 2.0 * double(batch) * double(d1) * double(d2) * double(d3);
}

}  // namespace tileattn
