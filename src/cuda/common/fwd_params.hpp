#pragma once
// Everything the sm80 forward kernels read, filled once on the host from a validated problem.
// Plain data (no CUDA types) so that the dispatcher needs no kernel headers.
#include <cstdint>

#include "common/key_rows.hpp"
#include "common/philox.hpp"
#include "common/score_mod.hpp"

namespace tileattn::cuda {

struct FwdParams {
  // Q, K, V, O in the problem's dtype; (batch, seqlen, heads, dim), or (total, heads, dim) for
  // varlen. Strides in elements; the last dimension is contiguous.
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;
  int64_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;
  float* lse = nullptr;  // (batch, heads_q, seqlen_q), or (heads_q, total_q) for varlen

  // Varlen offsets (both set or both null); seqlen_q/k are then the maxima.
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  int64_t total_q = 0, total_k = 0;
  // Where each sequence's keys are (packed, a cache row, pages): common/key_rows.hpp.
  KeyLayout keys;

  int batch = 0, heads_q = 0, heads_kv = 0;
  int seqlen_q = 0, seqlen_k = 0;
  int headdim_qk = 0, headdim_v = 0;
  int window_left = -1, window_right = -1;  // normalised: causal is window_right == 0
  // GQA packing (decode): the `pack` query heads of a kv group share one query tile, row r of a
  // sequence's packed rows being position r / pack of query head kv_head * pack + r % pack, so each
  // K/V tile is read once per group instead of once per query head. 1: off (rows are positions
  // of one query head, the grid's y).
  int pack = 1;

  // Scores stay in raw units (q.k) inside the kernel; scale_log2 = softmax_scale * log2(e) turns
  // them into the log2 domain inside one FFMA before exp2.
  float scale_log2 = 0.0f;
  // Soft-capping in raw units: s -> softcap_post * tanh(s * softcap_pre), with
  // softcap_pre = scale / softcap and softcap_post = softcap / scale (0: off).
  float softcap_pre = 0.0f, softcap_post = 0.0f;
  // The problem's one preparation (src/common/score_mod.hpp): the fields above are copied from it,
  // and ALiBi's slopes and LSE form are read from it.
  ScoreMod mod;
  // Attention dropout (common/philox.hpp): the weights are dropped after the row statistics, and
  // O is scaled by dropout.scale with the row sum (1 when off). Portable kernels only.
  Dropout dropout;

  // 16-byte loads are legal: 16-byte aligned base, strides multiple of 8, dim multiple of 8.
  bool vec_q = false, vec_k = false, vec_v = false;
  // 4-byte stores of element pairs are legal for O.
  bool pair_o = false;

  // Split-KV: each split writes fp32 O (already divided by its own row sum) and its LSE to the
  // workspace; a second kernel combines them. Index [split][batch][head][row (< seqlen_q)].
  int num_splits = 1;
  float* o_partial = nullptr;    // ... x headdim_v
  float* lse_partial = nullptr;
};

}  // namespace tileattn::cuda
