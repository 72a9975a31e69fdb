#pragma once
// Appending to a key/value cache on the GPU (problem.hpp's k_new, v_new and rotary fields), run
// on the forward's stream before the attention kernels. A plan forms the kernel's arguments once
// (kv_append_args); each run supplies the workspace for q's rotated copy.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/key_rows.hpp"
#include "tileattn/problem.hpp"

namespace tileattn::cuda {

// A (batch, rows, heads, dim) tensor of the problem's dtype; strides in elements.
struct AppendRows {
  const void* data;
  int64_t batch_stride, row_stride, head_stride;
};

// What the append kernel reads, from the validated problem.
struct KvAppendArgs {
  bool active;  // the problem appends to its cache or rotates q; nothing else is set otherwise
  DType dtype;
  KeyLayout keys;
  AppendRows k_new, v_new, q;
  AppendRows q_rot;  // rotated_q_view's strides; its data comes with each run
  void* k;
  void* v;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  bool rotary;
  const void* cos;
  const void* sin;
  int rotary_dim, rotary_rows;
  bool interleaved, per_query;
  int seqlen_new, seqlen_q, heads_kv, heads_q, dqk, dv;
  int64_t k_elements, v_elements, q_elements;  // the three parts of the kernel's index space, in order
};

KvAppendArgs kv_append_args(const AttentionProblem& p);

// Writes k_new and v_new into the cache (the new keys rotated when the problem has rotary) and,
// with rotary, q's rotated copy at `rotated_q` (common/kv_append.hpp's rotated_q_view). One kernel.
void launch_kv_append(const KvAppendArgs& args, void* rotated_q, cudaStream_t stream);

}  // namespace tileattn::cuda
