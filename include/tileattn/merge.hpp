#pragma once
// Merge of two partial attention results over disjoint key sets, the step that context
// parallelism (ring or all-gather), split-KV decoding and key-blocked attention repeat.
//
// Attention of the same queries over key sets A and B, with A and B disjoint, gives (O_a, L_a)
// and (O_b, L_b) (O normalised, L the log-sum-exp, as forward() writes them). The result over
// A u B is
//     L = log(exp(L_a) + exp(L_b)),   O = exp(L_a - L) O_a + exp(L_b - L) O_b,
// which merge_attention() writes in place into (O_a, L_a). A side whose L is -inf (its keys are
// all masked for that row, or it holds no keys yet) contributes nothing, whatever its O holds: an
// accumulator may start with L = -inf and O uninitialised. +inf is such a side too (flash-attn's
// mark of a row without keys, which tileattn's flash-attn entries return). When both sides are
// empty, O = 0 and L = -inf, as forward() writes a row that sees no key. The arithmetic is fp32.
#include <cstdint>

#include "tileattn/error.hpp"
#include "tileattn/problem.hpp"

namespace tileattn {

struct MergeProblem {
  // ---- sizes ----------------------------------------------------------------------------
  // O is (batch, seqlen, heads, headdim) with the TensorView's strides; for a variable-length
  // batch, whose O is (total_tokens, heads, headdim) and L (heads, total_tokens), set batch = 1,
  // seqlen = total_tokens and leave the batch strides 0. A size of 0 merges nothing.
  int64_t batch = 0;
  int64_t seqlen = 0;
  int64_t heads = 0;
  int64_t headdim = 0;

  // ---- the accumulator, written in place ------------------------------------------------
  // Any strides with a contiguous headdim; must not overlap itself. f32 accumulates the merged
  // result without rounding it to 16 bits between merges; f16/bf16 need out_b of the same dtype.
  TensorView out;
  DType out_dtype = DType::f32;
  // fp32; element (b, h, i) at lse[b * lse_batch_stride + h * lse_head_stride + i]: forward()'s
  // contiguous (batch, heads, seqlen) L has lse_head_stride = seqlen and lse_batch_stride =
  // heads * seqlen. Strides let a caller merge into a slice of the rows of a larger L.
  float* lse = nullptr;
  int64_t lse_batch_stride = 0;
  int64_t lse_head_stride = 0;

  // ---- the other side, read only --------------------------------------------------------
  // Same sizes as out; any dtype (f32 when out is f32, else out's); any strides with a contiguous
  // headdim, zero ones included (an expanded tensor: one index read for all), lse_b's too.
  TensorView out_b;
  DType out_b_dtype = DType::f32;
  const float* lse_b = nullptr;
  int64_t lse_b_batch_stride = 0;
  int64_t lse_b_head_stride = 0;

  // ---- execution ------------------------------------------------------------------------
  Backend backend = Backend::automatic;  // automatic: follows the memory `out` lives in
  void* stream = nullptr;                // cudaStream_t for the CUDA backend
  int num_threads = 0;                   // CPU backend: 0 = all hardware threads
};

// Validates (tileattn::Error naming the argument and the rule) and merges (out_b, lse_b) into
// (out, lse). On CUDA it is one elementwise kernel on `stream`; it never synchronises.
void merge_attention(const MergeProblem& problem);

}  // namespace tileattn
