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

struct AttentionProblem {
  // ---- sizes ----------------------------------------------------------------------------
  int64_t batch = 0;      // sequences in the batch (varlen: cu_seqlens have batch + 1 entries)
  int64_t seqlen_q = 0;   // fixed length, or the max over sequences for varlen
  int64_t seqlen_k = 0;
  int64_t heads_q = 0;
  int64_t heads_kv = 0;   // GQA/MQA: heads_q % heads_kv == 0; query head h reads kv head h / (heads_q / heads_kv)
  int64_t headdim_qk = 0; // 1..256
  int64_t headdim_v = 0;  // 1..256; may differ from headdim_qk
  DType dtype = DType::f16;  // of Q, K, V, O, dO, dQ, dK, dV alike; L is always fp32

  // ---- tensors --------------------------------------------------------------------------
  TensorView q, k, v;     // inputs
  TensorView o;           // forward output, backward input
  // Log-sum-exp of the scaled (soft-capped, ALiBi-biased) scores, natural log, fp32, contiguous:
  // (batch, heads_q, seqlen_q), or (heads_q, total_q) for varlen. -inf for rows that see no key.
  float* lse = nullptr;
  TensorView dout;        // backward inputs
  TensorView dq, dk, dv;  // backward outputs; for GQA dK/dV sum over the query heads of each group

  // ---- variable length ------------------------------------------------------------------
  // When set, both are set: int32 offsets of batch + 1 entries, starting at 0, non-decreasing,
  // in the same memory space as the tensors. total_q/total_k are the rows the buffers hold.
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  int64_t total_q = 0;
  int64_t total_k = 0;
  // Host memory offsets are always checked against the rules above. Device offsets are checked
  // only on request: reading them needs a copy to the host and a stream synchronisation (and is
  // skipped while the stream is being captured into a CUDA graph). Unchecked, offsets that break
  // the rules give unspecified values but never an access outside the buffers (the kernels clamp).
  bool check_cu_seqlens = false;

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
  Fp32Mode fp32_mode = Fp32Mode::exact;
  Backend backend = Backend::automatic;

  // ---- execution ------------------------------------------------------------------------
  void* stream = nullptr;        // cudaStream_t for the CUDA backend; nullptr = legacy default
  void* workspace = nullptr;     // optional caller scratch (size from *_workspace_size); nullptr:
  size_t workspace_bytes = 0;    // the library allocates on the stream
  int num_threads = 0;           // CPU backend: 0 = all hardware threads

  bool is_varlen() const { return cu_seqlens_q != nullptr || cu_seqlens_k != nullptr; }
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
};

}  // namespace tileattn
