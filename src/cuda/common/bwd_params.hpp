#pragma once
// What the backward kernels read: the validated problem flattened into device-friendly fields,
// plus the workspace they share (all three kernels index it the same way).
#include <cstdint>

#include "common/mask.hpp"
#include "common/philox.hpp"
#include "common/score_mod.hpp"
#include "common/varlen.hpp"
#include "tileattn/problem.hpp"

namespace tileattn::cuda::bwd {

struct Strided {
  void* ptr;
  int64_t batch, seq, head;  // element strides; batch unused for varlen
};

struct BwdParams {
  Strided q, k, v, o, dout, dq, dk, dv;
  const float* lse;             // the forward's L: (batch, heads_q, seqlen_q) or (heads_q, total_q)
  const float* dlse;            // the loss's gradient with respect to L, in L's layout, or null
  const int32_t* cu_seqlens_q;  // both null unless varlen
  const int32_t* cu_seqlens_k;
  int batch, seqlen_q, seqlen_k;  // varlen: the max over sequences
  int64_t total_q, total_k;
  int heads_q, heads_kv, group;  // group = heads_q / heads_kv
  int headdim_qk, headdim_v;
  int window_left, window_right;  // -1 = unbounded; causal is folded in (right = 0)

  float scale;           // softmax scale
  float scale_log2;      // scale * log2(e): P = exp2(s * scale_log2 - lse2)
  float softcap;         // 0 = off
  float scale_over_cap;  // scale / softcap: capped = softcap * tanh(s * scale_over_cap)
  ScoreMod mod;          // the one preparation the four fields above are copied from; ALiBi
  Dropout dropout;       // the forward's mask (common/philox.hpp), redrawn; portable kernels only

  // 16-byte copies are legal for every tensor (head dims and strides multiples of 8 elements,
  // 16-byte aligned bases); otherwise tiles are gathered element by element.
  bool vec_io;
  // dQ, dK and dV keep element pairs 4-byte aligned (bases and strides), so pairs store as one word.
  bool pair_grads;
  // fp32 takes the row statistics as given: lse2 holds L (natural domain, less ALiBi's offset),
  // row_sum 1 and dsum rowsum(O * dO), as the preprocess writes them, with no row-statistics pass.
  // Set for problem.hpp's partial_keys (the call sees part of each row, so the given L and O are
  // the row's) and for the fast mode (TF32 products: the pass's accuracy would be lost on them).
  bool given_stats;
  // 16-bit only: D = rowsum(P dP) / rowsum(P) from a pass of its own (bwd_row_stats.cuh) instead of
  // the preprocess's rowsum(O dO), where that is not accurate enough (common/delta_rule.hpp).
  bool consistent_delta;
  bool fp32_fast;  // fp32 products as one TF32 product each (Fp32Mode::fast), else exact
  // fp32 exact on Hopper: D = rowsum(O * dO), summed in double by the preprocess, for query tiles
  // whose rows all see at least kDeltaFromOutMinKeys keys; their statistics pass forms S alone (the
  // row's max and sum). Tiles with a row that sees fewer keep D = rowsum(P dP) / rowsum(P) from the
  // gradient passes' own P and dP, where dS cancels most (docs/accuracy.md). Off where
  // delta_from_p_and_dp holds (common/delta_rule.hpp).
  bool delta_from_out;
  // With delta_from_out: the forward's (max, sum) per row of L (AttentionProblem::softmax_stats),
  // NaN where it wrote none. The preprocess takes the rows that hold them, and blocks of
  // ExactPass::max_sum whose rows all do have nothing to compute.
  const float* fwd_stats;
  int dkdv_stages;  // query-tile buffers of the dK/dV kernel: 2 where shared memory allows, else 1
  int dq_stages;    // key-tile buffers of the dQ pass, likewise

  // ---- workspace: rows (batch, heads_q, seqlen_q_rounded), padding rows inert ------------
  int seqlen_q_rounded;
  int dq_accum_dim;  // row length of dq_accum (the kernel's head-dim bucket)
  // fp16/bf16: L * log2(e). fp32: the row max of the scaled scores, natural domain (recomputed by
  // the statistics pass: backward/bwd_row_stats.cuh, on Hopper bwd_kernel_exact_sm90.cuh), or L
  // itself with given_stats. +inf for padding and for rows that see no key, so P = 0.
  float* lse2;
  float* row_sum;   // fp32 only: sum of exp(score - row max); 1 where P = 0; null otherwise
  float* dsum;      // D = rowsum(O * dO); 0 for padding
  float* dq_accum;  // fp32 dQ / scale, summed by atomics; null when dQ has its own pass
  // The deterministic mode's fused dQ (Hopper, launch_bwd_sm90.cuh): per 64 workspace rows, how
  // many of a query tile's dQ additions have landed, so that each lands in a fixed order
  // (BwdKeyBlock::dq_rank); null when dQ tiles land in any order or dQ has its own pass.
  int* dq_order;
};

// The fewest keys a row sees for its D to come from O (delta_from_out above).
constexpr int kDeltaFromOutMinKeys = 256;

struct SeqInfo {
  int64_t row_q;  // row of the sequence's first query in varlen's (heads_q, total_q) L
  int64_t row_k;  // row of its first key in the packed K and V (varlen; 0 otherwise)
  int sq, sk;
};

#if defined(__CUDACC__)
// Element offset of sequence b's first row in tensor t (q-side rows when qside).
__device__ __forceinline__ int64_t seq_base(const BwdParams& p, const Strided& t, int b, bool qside) {
  if (p.cu_seqlens_q != nullptr)
    return int64_t(qside ? varlen_range(p.cu_seqlens_q, b, p.total_q, p.seqlen_q).begin
                         : varlen_range(p.cu_seqlens_k, b, p.total_k, p.seqlen_k).begin) *
           t.seq;
  return int64_t(b) * t.batch;
}

// Row i of sequence b, head h of a query-side tensor (O, dO, dQ); T const for the inputs.
template <class T>
__device__ __forceinline__ T* query_row(const BwdParams& p, const Strided& t, int b, int h, int i) {
  return static_cast<T*>(t.ptr) + seq_base(p, t, b, true) + int64_t(i) * t.seq + int64_t(h) * t.head;
}

__device__ __forceinline__ SeqInfo seq_info(const BwdParams& p, int b) {
  SeqInfo s;
  if (p.cu_seqlens_q != nullptr) {
    const SeqRange q = varlen_range(p.cu_seqlens_q, b, p.total_q, p.seqlen_q);
    const SeqRange k = varlen_range(p.cu_seqlens_k, b, p.total_k, p.seqlen_k);
    s.sq = q.len;
    s.sk = k.len;
    s.row_q = q.begin;
    s.row_k = k.begin;
  } else {
    s.sq = p.seqlen_q;
    s.sk = p.seqlen_k;
    s.row_q = 0;
    s.row_k = 0;
  }
  return s;
}

// Index of L for (b, h, row i of the sequence).
__device__ __forceinline__ int64_t lse_index(const BwdParams& p, const SeqInfo& s, int b, int h, int i) {
  if (p.cu_seqlens_q != nullptr) return int64_t(h) * p.total_q + s.row_q + i;
  return (int64_t(b) * p.heads_q + h) * p.seqlen_q + i;
}

// dL of (b, h, row i of the sequence) (problem.hpp's dlse), 0 without one. dS = P (dP - D + dL), so
// it comes off D where D is written (the preprocess, the row-statistics passes), once a row.
__device__ __forceinline__ float lse_grad(const BwdParams& p, const SeqInfo& s, int b, int h, int i) {
  return p.dlse != nullptr ? p.dlse[lse_index(p, s, b, h, i)] : 0.0f;
}

// First workspace row of (b, h).
__device__ __forceinline__ int64_t ws_row(const BwdParams& p, int b, int h) {
  return (int64_t(b) * p.heads_q + h) * p.seqlen_q_rounded;
}

__device__ __forceinline__ Mask seq_mask(const BwdParams& p, const SeqInfo& s) {
  return Mask{s.sq, s.sk, p.window_left, p.window_right};
}

// The tiles of `width` rows that cover [begin, end): the first one's index and how many
// (none when the mask leaves the range empty).
struct TileSpan {
  int first, count;
};
__device__ __forceinline__ TileSpan tile_span(int begin, int end, int width) {
  const int first = begin / width;
  return {first, end > begin ? (end + width - 1) / width - first : 0};
}
#endif

}  // namespace tileattn::cuda::bwd
