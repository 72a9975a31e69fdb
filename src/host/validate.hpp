#pragma once
// The only place the API's rules live. Each function throws tileattn::Error naming the argument
// and the rule, and returns the problem in the normalised form every backend consumes:
//  - softmax_scale is set (default 1/sqrt(headdim_qk));
//  - causal is folded into the window: causal => window_right == 0 whatever window_right was given
//    (flash-attn's rule: the right bound becomes 0, the left bound stays; causal stays true as a hint);
//  - a window side reaching past the sequence (window_left > seqlen_k, window_right > seqlen_q)
//    is clamped to that length: it masks nothing either way, and Mask's int32 arithmetic stays exact.
#include "tileattn/problem.hpp"

namespace tileattn::host {

enum class Pass { forward, backward };

// `backend` is the resolved backend (cpu or cuda): it decides whether cu_seqlens can be read
// in place or must be copied from the device to be checked.
AttentionProblem validate_attention(const AttentionProblem& problem, Pass pass, Backend backend);
SoftmaxMatmulProblem validate_softmax_matmul(const SoftmaxMatmulProblem& problem, Backend backend);

}  // namespace tileattn::host
