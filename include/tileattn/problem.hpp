#pragma once
// The one description of an attention problem, read by every backend (the CPU oracle too).
//
// Layout follows flash-attn: Q, K, V, O, dO, dQ, dK, dV are (batch, seqlen, heads, headdim)
// with any strides in elements and a contiguous last dimension, so SDPA's
// (batch, heads, seqlen, headdim) is the same memory seen through other strides.
// With variable-length batches (cu_seqlens_q/k set) the tensors are (total_tokens, heads,
// headdim): sequence b occupies rows [cu_seqlens[b], cu_seqlens[b+1]) and batch_stride is unused.
#include <cstddef>
#include <cstdint>
#include <optional>

namespace tileattn {

enum class DType : int { f32 = 0, f16 = 1, bf16 = 2 };

enum class Backend : int { automatic = 0, cpu = 1, cuda = 2 };

// How fp32 inputs are multiplied. `exact` keeps every product in fp32 (the default); `fast`
// is an explicit opt-in to tensor cores (TF32 family), with the accuracy documented in docs/.
enum class Fp32Mode : int { exact = 0, fast = 1 };

// A strided (batch, seqlen, heads, headdim) tensor. Strides are in elements, not bytes.
struct TensorView {
  void* data = nullptr;
  int64_t batch_stride = 0;  // ignored for variable-length problems
  int64_t seq_stride = 0;
  int64_t head_stride = 0;
};

// The largest headdim_qk and headdim_v any backend takes.
inline constexpr int64_t kMaxHeadDim = 256;

struct AttentionProblem {
  // ---- sizes ----------------------------------------------------------------------------
  int64_t batch = 0;      // sequences in the batch (varlen: cu_seqlens have batch + 1 entries)
  int64_t seqlen_q = 0;   // fixed length, or the max over sequences for varlen
  int64_t seqlen_k = 0;
  int64_t heads_q = 0;
  int64_t heads_kv = 0;   // GQA/MQA: heads_q % heads_kv == 0; query head h reads kv head h / (heads_q / heads_kv)
  int64_t headdim_qk = 0; // 1..kMaxHeadDim
  int64_t headdim_v = 0;  // 1..kMaxHeadDim; may differ from headdim_qk
  DType dtype = DType::f16;  // of Q, K, V, O, dO, dQ, dK, dV alike; L is always fp32

  // ---- tensors --------------------------------------------------------------------------
  TensorView q, k, v;     // inputs
  TensorView o;           // forward output, backward input
  // Log-sum-exp of the scaled (soft-capped, ALiBi-biased) scores, natural log, fp32, contiguous:
  // (batch, heads_q, seqlen_q), or (heads_q, total_q) for varlen. -inf for rows that see no key.
  float* lse = nullptr;
  // Optional, fp32 on the CUDA backend only: two fp32 per row of L, in L's order ((batch, heads_q,
  // seqlen_q, 2), or (heads_q, total_q, 2) for varlen). The forward writes each row's max of the
  // scaled scores and the sum of exp(score - max) there where its kernel forms them as the exact
  // backward would (exact mode on Hopper, head dims up to 64, no soft cap or ALiBi; a row that sees
  // no key gets -inf and 0), and NaN elsewhere. The backward given the forward's buffer takes
  // those rows' statistics from it instead of recomputing each row's scores for them; its results
  // are the same to rounding.
  float* softmax_stats = nullptr;
  TensorView dout;        // backward inputs
  // Optional backward input: the loss's gradient with respect to L, fp32, in L's layout and memory
  // space; null where L carries none. L is the log-sum-exp of a row's scores, so its gradient is
  // the row's softmax: each score gets dL_i * P_ij on top of what dO gives it (rows that see no key
  // get nothing).
  const float* dlse = nullptr;
  TensorView dq, dk, dv;  // backward outputs; for GQA dK/dV sum over the query heads of each group

  // ---- variable length ------------------------------------------------------------------
  // When set, both are set: int32 offsets of batch + 1 entries, from 0 or more, non-decreasing,
  // in the same memory space as the tensors. total_q/total_k are the rows the buffers hold. Rows
  // before the first offset or from the last on belong to no sequence (flash-attn's kernels start
  // sequence b at cu_seqlens[b] too): they get the outputs of a row that sees no key (0, L = -inf).
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  int64_t total_q = 0;
  int64_t total_k = 0;
  // Host memory offsets are always checked against the rules above. Device offsets are checked
  // only on request: reading them needs a copy to the host and a stream synchronisation (and is
  // skipped while the stream is being captured into a CUDA graph). Unchecked, offsets that break
  // the rules give unspecified values but never an access outside the buffers (the kernels clamp).
  bool check_cu_seqlens = false;

  // ---- key/value cache (flash-attn's flash_attn_with_kvcache, paged attention) ------------
  // Forward only. Every table is int32, in the same memory space as the tensors, and checked
  // like cu_seqlens (host memory always, device memory on request); unchecked device values that
  // break a rule give unspecified results but are clamped so that no access leaves the buffers.
  //
  // seqused_k (batch,): sequence b attends to its first seqused_k[b] keys: rows
  //   [leftpad_k[b], seqused_k[b]) of its cache row (fixed length; seqused_k[b] <= seqlen_k), or
  //   the first seqused_k[b] rows of its packed sequence (varlen; at most its length).
  // leftpad_k (batch,): fixed length only; sequence b's keys start at row leftpad_k[b] of its cache
  //   row (flash-attn's cache_leftpad), with seqused_k (or seqlen_k) the end. Positions in masks
  //   and ALiBi count from there: the sequence has seqused_k[b] - leftpad_k[b] keys.
  // kv_batch_idx (batch,): fixed length only; sequence b reads cache row kv_batch_idx[b] of K and
  //   V, which then have kv_batch rows (flash-attn's cache_batch_idx).
  // block_table (batch, pages_per_seq), row stride block_table_stride: paged K and V of shape
  //   (num_pages, page_size, heads_kv, headdim), their batch_stride the page stride. Key row r of
  //   sequence b lies at row r % page_size of page block_table[b * block_table_stride +
  //   r / page_size]; seqlen_k (the longest sequence) is at most pages_per_seq * page_size. With
  //   cu_seqlens the sequences' key lengths are cu_seqlens_k's (total_k is not used for K and V).
  const int32_t* seqused_k = nullptr;
  const int32_t* leftpad_k = nullptr;
  const int32_t* kv_batch_idx = nullptr;
  int64_t kv_batch = 0;
  const int32_t* block_table = nullptr;
  int64_t block_table_stride = 0;
  int64_t pages_per_seq = 0;
  int64_t page_size = 0;
  int64_t num_pages = 0;
  //
  // Appending (flash-attn's k and v): fixed length with seqused_k only. Before attending, the
  // forward writes k_new and v_new, (batch, seqlen_new, heads_kv, headdim) in the problem's dtype,
  // at rows [seqused_k[b] - seqlen_new, seqused_k[b]) of sequence b's cache row (through
  // kv_batch_idx or the page table), so K and V are written too. seqused_k counts the keys after
  // the append: flash-attn's cache_seqlens + seqlen_new. seqlen_new 0: nothing is appended.
  TensorView k_new, v_new;
  int64_t seqlen_new = 0;
  // Rotary embedding (needs seqused_k): q and the new keys are rotated before use, at absolute
  // cache rows: new key i of sequence b at row seqused_k[b] - seqlen_new + i; query i at that row
  // plus i when rotary_per_query, else every query at seqused_k[b] - seqlen_new. Unset, it is
  // flash-attn's rule: per query when the mask is causal or local (a window side below seqlen_k).
  // rotary_cos, rotary_sin: (rotary_seqlen, rotary_dim / 2), contiguous, in the problem's dtype,
  // rotary_seqlen >= seqlen_k; dims past rotary_dim pass through. Interleaved: pairs (2i, 2i + 1)
  // (GPT-J); else (i, i + rotary_dim / 2) (GPT-NeoX). Computed in fp32 and rounded once; q itself
  // is not written (its rotated copy lives in the workspace).
  const void* rotary_cos = nullptr;
  const void* rotary_sin = nullptr;
  int64_t rotary_dim = 0;
  int64_t rotary_seqlen = 0;
  bool rotary_interleaved = true;
  std::optional<bool> rotary_per_query;

  // ---- options --------------------------------------------------------------------------
  std::optional<float> softmax_scale;  // default 1/sqrt(headdim_qk); must be finite and > 0
  bool causal = false;                 // bottom-right aligned when seqlen_q != seqlen_k
  // Sliding window, flash-attn semantics: query i (bottom-right aligned) sees keys j with
  // i + (sk - sq) - window_left <= j <= i + (sk - sq) + window_right; -1 means unbounded.
  // causal == true sets window_right to 0 whatever it was (as flash-attn does); window_left stays.
  int64_t window_left = -1;
  int64_t window_right = -1;
  float softcap = 0.0f;                // > 0: scores become softcap * tanh(scores / softcap)
  // ALiBi (flash-attn 2 semantics): fp32 slopes, in the same memory space as the tensors, at
  // alibi_slopes[b * alibi_batch_stride + h] for sequence b, query head h (alibi_batch_stride 0:
  // one slope per head for the whole batch, flash-attn's (heads_q,) shape). The (soft-capped)
  // score of query i and key j gets  -slope * |i + sk - sq - j|  added in natural units, with sq, sk
  // the lengths of the sequence (bottom-right aligned, per sequence for varlen). Gradients flow to
  // Q, K, V only. L then is the LSE of the biased scores, except in flash-attn's causal form
  // (window_right == 0 and no left bound, or one reaching every key), where flash-attn's kernel adds
  // slope * j instead: the softmax is the same, and L, like its softmax_lse, is that LSE plus
  // slope * (i + sk - sq). nullptr: no bias.
  const float* alibi_slopes = nullptr;
  int64_t alibi_batch_stride = 0;
  bool deterministic = false;          // backward: bitwise identical gradients run to run
  // Backward only: O and L cover more keys than this call's K and V. The call is one part of a
  // problem whose keys were split (context parallelism, tileattn.distributed): O and L are the
  // whole problem's, and the gradients are this part's share -- dQ summed over the parts and dK,
  // dV of each part's keys are the whole problem's. P is then exp(S - L) from the given L and
  // D = rowsum(dO * O) from the given O, as the fp16/bf16 CUDA backward always forms them;
  // without it the CUDA fp32 backward, and the CPU backward for fp16/bf16 inputs, headdim_qk <= 8
  // or ALiBi's causal form, rebuild the row's softmax from the call's own keys, which is more
  // accurate for a whole problem (docs/accuracy.md) and wrong for a part. Masks, ALiBi and dropout
  // keep the call's own positions: give each part the window and lengths that place its keys.
  bool partial_keys = false;
  // Attention dropout, flash-attn 2 semantics: P = softmax(S) gets a keep mask M ~ Bernoulli(1 - p)
  // per (sequence, query head, query row, key column): O = (P * M / (1 - p)) V, while L stays the
  // LSE of the undropped scores. The backward regenerates M from (seed, offset) -- it is never
  // stored -- so forward and backward must get the same three values: dV = (P * M / (1 - p))^T dO,
  // dP = (dO V^T) * M / (1 - p), dS = P * (dP - D) with D = rowsum(dO * O), O the dropped output.
  // The mask rule (Philox4x32-10 over seed, offset and the coordinates) is src/common/philox.hpp's.
  // 0 <= dropout_p < 1 (p = 1 would drop everything: the Python layer returns zeros for it).
  float dropout_p = 0.0f;
  uint64_t dropout_seed = 0, dropout_offset = 0;
  // Optional: two uint64 {seed, offset} read when the kernels run, in place of the two fields
  // above; in the backend's memory (device memory for CUDA, host memory for the CPU backend).
  // A CUDA graph that captured the call then replays it with whatever the two words hold at
  // replay, so a seed drawn on the device inside the graph gives a fresh mask every replay.
  const uint64_t* dropout_rng_state = nullptr;
  // CUDA forward: how many parts the keys of a row may be split into (split-KV, combined after):
  // 0 lets the library choose, 1 never splits, n > 1 at most n. Results differ only by rounding.
  int num_splits = 0;
  Fp32Mode fp32_mode = Fp32Mode::exact;
  Backend backend = Backend::automatic;

  // ---- execution ------------------------------------------------------------------------
  void* stream = nullptr;        // cudaStream_t for the CUDA backend; nullptr = legacy default
  void* workspace = nullptr;     // optional caller scratch (size from *_workspace_size); nullptr:
  size_t workspace_bytes = 0;    // the library allocates on the stream
  int num_threads = 0;           // CPU backend: 0 = all hardware threads
  // Planning asks the CUDA runtime, for every pointer, whether it is the backend's memory (one
  // query each, about half a microsecond). A caller that already knows each buffer's device (the
  // Python bindings) may turn this off; a pointer of the wrong space is then undefined behaviour.
  bool check_memory_spaces = true;

  bool is_varlen() const { return cu_seqlens_q != nullptr || cu_seqlens_k != nullptr; }
  bool is_paged() const { return block_table != nullptr; }
  bool appends() const { return seqlen_new > 0; }
  bool has_rotary() const { return rotary_cos != nullptr || rotary_sin != nullptr; }
  // Keys addressed through any of the cache fields above (rather than one range per sequence).
  bool has_kv_cache() const {
    return seqused_k != nullptr || leftpad_k != nullptr || kv_batch_idx != nullptr || block_table != nullptr;
  }
};

// softmax(X, dim=-1) @ V for X (batch, d1, d2), V (batch, d2, d3), out (batch, d1, d3).
// Strides in elements; the last dimension of each is contiguous. A row of X that is -inf
// throughout (every key masked) gives a zero row of out, as a fully masked attention row does
// (PyTorch's softmax gives NaN there).
struct SoftmaxMatmulProblem {
  int64_t batch = 0, d1 = 0, d2 = 0, d3 = 0;
  DType dtype = DType::f32;
  const void* x = nullptr;
  int64_t x_batch_stride = 0, x_row_stride = 0;
  const void* v = nullptr;
  int64_t v_batch_stride = 0, v_row_stride = 0;
  void* out = nullptr;
  int64_t out_batch_stride = 0, out_row_stride = 0;
  Fp32Mode fp32_mode = Fp32Mode::exact;
  Backend backend = Backend::automatic;
  void* stream = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  int num_threads = 0;
  bool check_memory_spaces = true;  // as AttentionProblem's
};

}  // namespace tileattn
