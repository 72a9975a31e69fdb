#include "cuda/fp32/forward_fp32.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/online_softmax.hpp"
#include "cuda/common/check.cuh"
#include "cuda/common/row_alignment.hpp"
#include "cuda/fp32/forward_fp32_kernel.cuh"
#include "cuda/sm90/fp32_fwd_kernel_sm90.cuh"
#include "cuda/sm90/hopper_available.hpp"
#include "cuda/sm90/tma_map.hpp"
#include "tileattn/error.hpp"

namespace tileattn::cuda {
namespace {

// A window side at or beyond what the lengths can reach masks nothing; clamping keeps the
// int arithmetic of Mask far from overflow.
int clamp_window(int64_t w, int64_t reach) { return w < 0 ? -1 : int(std::min(w, reach)); }

template <int kD, bool kExact>
void launch(const fp32::FwdParams& params, int64_t batch, int64_t seqlen_q, int64_t heads_q, cudaStream_t stream) {
  using Tile = fp32::FwdTile<kD, kExact>;
  const auto kernel = fp32::forward_fp32_kernel<kD, kExact>;
  const size_t smem = sizeof(float) * Tile::smem_floats();
  TA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const dim3 grid(unsigned((seqlen_q + Tile::kBlockM - 1) / Tile::kBlockM), unsigned(heads_q), unsigned(batch));
  kernel<<<grid, Tile::kThreads, smem, stream>>>(params);
  TA_CUDA_CHECK_LAUNCH("forward_fp32_kernel");
}

template <bool kExact>
void launch_bucket(int d, const fp32::FwdParams& params, int64_t batch, int64_t seqlen_q, int64_t heads_q,
                   cudaStream_t stream) {
  if (d <= 32) return launch<32, kExact>(params, batch, seqlen_q, heads_q, stream);
  if (d <= 64) return launch<64, kExact>(params, batch, seqlen_q, heads_q, stream);
  if (d <= 128) return launch<128, kExact>(params, batch, seqlen_q, heads_q, stream);
  return launch<256, kExact>(params, batch, seqlen_q, heads_q, stream);
}

// Q, K or V as (dim, rows, heads, batch); varlen buffers are one sequence of total rows.
sm90::TileMapShape map_shape(const AttentionProblem& pr, const TensorView& t, int64_t dim, int64_t seqlen, int64_t total,
                             int64_t heads, int box_rows) {
  sm90::TileMapShape s;
  const bool varlen = pr.is_varlen();
  s.dim = dim, s.rows = varlen ? total : seqlen, s.heads = heads, s.batch = varlen ? 1 : pr.batch;
  s.row_stride = t.seq_stride, s.head_stride = t.head_stride, s.batch_stride = varlen ? 0 : t.batch_stride;
  s.box_rows = box_rows;
  return s;
}

// The Hopper kernel for fast mode (TF32 wgmma); false when it cannot run this problem here (not
// Hopper, the portable kernels forced, no sm_90a code in the build, head dims over 128, or inputs
// TMA cannot describe).
template <int kD>
bool launch_sm90(const AttentionProblem& pr, const fp32::FwdParams& params, cudaStream_t stream) {
  using Tile = fp32::FwdSm90Tile<kD>;
  const auto kernel = fp32::forward_fp32_kernel_sm90<kD>;
  if (!sm90::has_sm90a_code(reinterpret_cast<const void*>(kernel))) return false;
  fp32::FwdSm90Params p{};
  p.fwd = params;
  if (!sm90::make_tile_map(&p.q, DType::f32, pr.q.data,
                           map_shape(pr, pr.q, pr.headdim_qk, pr.seqlen_q, pr.total_q, pr.heads_q, Tile::kBlockM)) ||
      !sm90::make_tile_map(&p.k, DType::f32, pr.k.data,
                           map_shape(pr, pr.k, pr.headdim_qk, pr.seqlen_k, pr.total_k, pr.heads_kv, Tile::kBlockN)) ||
      !sm90::make_tile_map(&p.v, DType::f32, pr.v.data,
                           map_shape(pr, pr.v, pr.headdim_v, pr.seqlen_k, pr.total_k, pr.heads_kv, Tile::kBlockN)))
    return false;
  TA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes));
  const dim3 grid(unsigned((pr.seqlen_q + Tile::kBlockM - 1) / Tile::kBlockM), unsigned(pr.heads_q),
                  unsigned(pr.batch));
  kernel<<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(p);
  TA_CUDA_CHECK_LAUNCH("forward_fp32_kernel_sm90");
  return true;
}

bool launch_sm90_bucket(int d, const AttentionProblem& pr, const fp32::FwdParams& params, cudaStream_t stream) {
  if (d > 128 || !sm90::hopper_kernels_enabled()) return false;
  if (d <= 32) return launch_sm90<32>(pr, params, stream);
  if (d <= 64) return launch_sm90<64>(pr, params, stream);
  return launch_sm90<128>(pr, params, stream);
}

}  // namespace

size_t forward_fp32_workspace_size(const AttentionProblem&) { return 0; }

void forward_fp32(const AttentionProblem& pr) {
  if (pr.batch == 0 || pr.seqlen_q == 0 || pr.heads_q == 0) return;
  if (pr.batch > 65535 || pr.heads_q > 65535)
    throw Error(ErrorKind::unsupported, "fp32 forward on CUDA: batch=" + std::to_string(pr.batch) +
                                            " and heads_q=" + std::to_string(pr.heads_q) + " must be <= 65535");
  const bool varlen = pr.is_varlen();
  fp32::FwdParams p{};
  p.q = static_cast<const float*>(pr.q.data);
  p.k = static_cast<const float*>(pr.k.data);
  p.v = static_cast<const float*>(pr.v.data);
  p.o = static_cast<float*>(pr.o.data);
  p.lse = pr.lse;
  p.q_batch_stride = pr.q.batch_stride, p.q_seq_stride = pr.q.seq_stride, p.q_head_stride = pr.q.head_stride;
  p.k_batch_stride = pr.k.batch_stride, p.k_seq_stride = pr.k.seq_stride, p.k_head_stride = pr.k.head_stride;
  p.v_batch_stride = pr.v.batch_stride, p.v_seq_stride = pr.v.seq_stride, p.v_head_stride = pr.v.head_stride;
  p.o_batch_stride = pr.o.batch_stride, p.o_seq_stride = pr.o.seq_stride, p.o_head_stride = pr.o.head_stride;
  p.cu_seqlens_q = varlen ? pr.cu_seqlens_q : nullptr;
  p.cu_seqlens_k = varlen ? pr.cu_seqlens_k : nullptr;
  p.total_q = pr.total_q;
  p.total_k = pr.total_k;
  p.seqlen_q = int(pr.seqlen_q);
  p.seqlen_k = int(pr.seqlen_k);
  p.heads_q = int(pr.heads_q);
  p.group = int(pr.heads_q / pr.heads_kv);
  p.dqk = int(pr.headdim_qk);
  p.dv = int(pr.headdim_v);
  const int64_t reach = pr.seqlen_q + pr.seqlen_k;
  p.window_left = clamp_window(pr.window_left, reach);
  p.window_right = clamp_window(pr.window_right, reach);
  p.scale = *pr.softmax_scale;
  p.scale_log2 = p.scale * kLog2e;
  p.softcap = pr.softcap;
  p.vec16 = pr.headdim_qk % 4 == 0 && pr.headdim_v % 4 == 0 && rows_aligned(pr.q, 4, 16, varlen) &&
            rows_aligned(pr.k, 4, 16, varlen) && rows_aligned(pr.v, 4, 16, varlen);

  const int d = int(std::max(pr.headdim_qk, pr.headdim_v));
  const auto stream = static_cast<cudaStream_t>(pr.stream);
  if (pr.fp32_mode == Fp32Mode::exact)  // fp64 products on the portable kernel everywhere
    launch_bucket<true>(d, p, pr.batch, pr.seqlen_q, pr.heads_q, stream);
  else if (!launch_sm90_bucket(d, pr, p, stream))
    launch_bucket<false>(d, p, pr.batch, pr.seqlen_q, pr.heads_q, stream);
}

}  // namespace tileattn::cuda
