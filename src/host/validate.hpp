#pragma once
// The only place the API's rules live. Each function throws tileattn::Error naming the argument
// and the rule, and returns the problem in the normalised form every backend consumes:
//  - softmax_scale is set (default 1/sqrt(headdim_qk));
//  - causal is folded into the window: causal => window_right == 0 whatever window_right was given
//    (flash-attn's rule: the right bound becomes 0, the left bound stays; causal stays true as a hint);
//  - a window side reaching past the sequence (window_left > seqlen_k, window_right > seqlen_q)
//    is clamped to that length: it masks nothing either way, and Mask's int32 arithmetic stays exact.
#include <cstdint>

#include "tileattn/merge.hpp"
#include "tileattn/problem.hpp"

namespace tileattn::host {

enum class Pass { forward, backward };

// Device cu_seqlens (and key/value cache tables) copied to the host, for the rules on their values,
// where the caller asked for the check (check_cu_seqlens); else null, and the rules that need the
// values are not checked (the kernels clamp every access). On the CPU backend the problem's own
// tables are read.
struct HostOffsets {
  const int32_t* q = nullptr;
  const int32_t* k = nullptr;
  // The key/value cache tables, copied on the same request (each null when the problem has none).
  const int32_t* seqused_k = nullptr;
  const int32_t* leftpad_k = nullptr;
  const int32_t* kv_batch_idx = nullptr;
  const int32_t* block_table = nullptr;  // batch rows of block_table_stride entries
};

// `backend` is the resolved backend (cpu or cuda). Validation reads no device memory and calls no
// backend: whether the backend is present and the pointers are its memory is src/host/api.cpp's
// check, made before this one.
AttentionProblem validate_attention(const AttentionProblem& problem, Pass pass, Backend backend,
                                    HostOffsets offsets = {});
SoftmaxMatmulProblem validate_softmax_matmul(const SoftmaxMatmulProblem& problem, Backend backend);

// merge_attention's sizes, checked first: a negative one throws, and a zero one makes an empty
// merge, which reads and writes nothing and needs no pointer (true). An invalid backend enum
// throws here too.
bool merge_is_empty(const MergeProblem& problem);
// The rest of the merge's rules, for a problem that is not empty. A merge has no normalised form.
void validate_merge(const MergeProblem& problem, Backend backend);

}  // namespace tileattn::host
