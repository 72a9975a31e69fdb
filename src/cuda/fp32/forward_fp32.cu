#include "cuda/fp32/forward_fp32.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/online_softmax.hpp"
#include "common/score_mod.hpp"
#include "cuda/common/check.cuh"
#include "cuda/common/row_alignment.hpp"
#include "cuda/arch/hopper_available.hpp"
#include "cuda/fp32/launch_fwd_fp32.hpp"
#include "cuda/head_dims_built.hpp"
#include "tileattn/error.hpp"

namespace tileattn::cuda {
namespace {

// A window side at or beyond what the lengths can reach masks nothing; clamping keeps the
// int arithmetic of Mask far from overflow.
int clamp_window(int64_t w, int64_t reach) { return w < 0 ? -1 : int(std::min(w, reach)); }

}  // namespace

void forward_fp32(const AttentionProblem& pr) {
  if (pr.batch > 65535 || pr.heads_q > 65535)
    throw Error(ErrorKind::unsupported, "fp32 forward on CUDA: batch=" + std::to_string(pr.batch) +
                                            " and heads_q=" + std::to_string(pr.heads_q) + " must be <= 65535");
  const bool varlen = pr.is_varlen();
  fp32::FwdParams p{};
  p.keys = key_layout(pr);
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
  p.mod = score_mod(pr);
  p.scale = p.mod.scale;
  p.scale_log2 = p.mod.scale_log2;
  p.softcap = p.mod.softcap;
  // Only the exact Hopper kernel without a cap or bias forms the backward's row statistics: it is
  // handed the buffer where it does, and writes it where it is handed it.
  const bool forms_stats = pr.fp32_mode == Fp32Mode::exact && pr.alibi_slopes == nullptr && p.softcap == 0.0f;
  p.softmax_stats = forms_stats ? pr.softmax_stats : nullptr;
  p.dropout = make_dropout(pr.dropout_p, pr.dropout_seed, pr.dropout_offset, pr.heads_q, pr.dropout_rng_state);
  p.vec16 = pr.headdim_qk % 4 == 0 && pr.headdim_v % 4 == 0 && rows_aligned(pr.q, 4, 16, varlen) &&
            rows_aligned(pr.k, 4, 16, varlen && !pr.is_paged()) &&
            rows_aligned(pr.v, 4, 16, varlen && !pr.is_paged());

  const int d = int(std::max(pr.headdim_qk, pr.headdim_v));
  const auto stream = static_cast<cudaStream_t>(pr.stream);
  // The Hopper kernel runs where it can (TF32, or split TF32 in exact mode up to head dim 64);
  // everything it declines runs the portable kernel (fp64 products in exact mode).
  bool done = false;
  if (!pr.has_kv_cache() && sm90::hopper_kernels_enabled())
    with_bucket(FwdFp32Sm90HeadDims{}, d,
                [&](auto b) { done = fp32::FwdFp32Sm90<decltype(b)::value>::run(pr, p, stream); });
  if (pr.softmax_stats != nullptr && !(done && forms_stats)) {
    const int64_t rows = pr.heads_q * (varlen ? pr.total_q : pr.batch * pr.seqlen_q);
    TA_CUDA_CHECK(cudaMemsetAsync(pr.softmax_stats, 0xff, size_t(rows) * 2 * sizeof(float), stream));  // NaN
  }
  if (done) return;
  const bool found = with_bucket(FwdFp32HeadDims{}, d, [&](auto b) {
    fp32::FwdFp32<decltype(b)::value>::run(p, pr.fp32_mode == Fp32Mode::exact, pr.batch, pr.seqlen_q, pr.heads_q,
                                            stream);
  });
  if (!found)
    throw Error(ErrorKind::unsupported, "fp32 forward on CUDA: head dim " + std::to_string(d) +
                                            " exceeds every fp32 head-dim bucket of this build (TILEATTN_HEADDIMS=" +
                                            kBuiltHeadDims + ")");
}

}  // namespace tileattn::cuda
