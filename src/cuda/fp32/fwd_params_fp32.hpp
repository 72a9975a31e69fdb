#pragma once
// What the fp32 forward kernels read: pointers, strides in elements, lengths and the prepared
// score constants.
#include <cstdint>

#include "common/key_rows.hpp"
#include "common/philox.hpp"
#include "common/score_mod.hpp"

namespace tileattn::cuda::fp32 {

struct FwdParams {
  const float* q;
  const float* k;
  const float* v;
  float* o;
  float* lse;
  // Where the exact Hopper kernel hands each row's (max, sum) to the backward (AttentionProblem::
  // softmax_stats); null where the call's kernel does not form them (the host fills the caller's
  // buffer with NaN then).
  float* softmax_stats;
  int64_t q_batch_stride, q_seq_stride, q_head_stride;
  int64_t k_batch_stride, k_seq_stride, k_head_stride;
  int64_t v_batch_stride, v_seq_stride, v_head_stride;
  int64_t o_batch_stride, o_seq_stride, o_head_stride;
  const int32_t* cu_seqlens_q;  // null for fixed-length batches
  const int32_t* cu_seqlens_k;
  int64_t total_q, total_k;
  KeyLayout keys;  // where each sequence's keys are (common/key_rows.hpp)
  int seqlen_q, seqlen_k;  // fixed lengths (varlen: the maxima)
  int heads_q, group;      // group = heads_q / heads_kv
  int dqk, dv;
  int window_left, window_right;  // clamped to what the lengths can reach; -1 = unbounded
  float scale;                    // natural-domain softmax scale (soft-capping works there)
  float scale_log2;               // scale * log2(e)
  float softcap;
  ScoreMod mod;  // the one preparation the three fields above are copied from; ALiBi
  // Attention dropout (common/philox.hpp): the weights are dropped after the row statistics, and
  // O is scaled by dropout.scale with the row sum. The portable kernel only.
  Dropout dropout;
  bool vec16;  // every tensor row 16-byte aligned and head dims % 4 == 0
};

}  // namespace tileattn::cuda::fp32
