#pragma once
// Launch side of the sm90 forward: kernel instance (keys per step), tensor maps, grid shape,
// shared-memory opt-in, split decision.
// Included only by the generated instantiation units.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda/common/check.cuh"
#include "cuda/common/runtime_cache.hpp"
#include "cuda/forward/combine_fwd_sm80.cuh"
#include "cuda/common/split_heuristic.hpp"
#include "cuda/forward/fwd_kernel_sm90.cuh"
#include "cuda/forward/launch_fwd_sm90.hpp"
#include "cuda/arch/tma_map.hpp"
#include "tileattn/error.hpp"

namespace tileattn::cuda {

namespace fwd_sm90_detail {

template <class T, int kHeadDim, int kBlockN, bool kAlibi, bool kPersistent = false, int kConsumers = 2,
          bool kSoftcap = false>
void launch(const FwdSm90Params& params, int64_t tiles, cudaStream_t stream) {
  using Traits = FwdSm90Traits<T, kHeadDim, kBlockN, kPersistent, kConsumers>;
  const auto kernel = fwd_kernel_sm90<T, kHeadDim, kBlockN, kAlibi, kPersistent, kConsumers, kSoftcap>;
  allow_dynamic_smem(kernel, Traits::kSmemBytes);
  dim3 grid = fwd_grid(params.fwd, tiles);
  if constexpr (kPersistent)
    grid = dim3(unsigned(std::min<int64_t>(FwdUnits(params.fwd, Traits::kBlockM).count, device_props().sms)));
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(params);
  TA_CUDA_CHECK_LAUNCH("fwd_kernel_sm90");
}

// Blocks that walk several query tiles pay off where a tile is short (few keys), every unit of
// work is the same (one length, no mask but the causal one, which pairs tiles, no split, O stored
// by TMA) and there are more units than SMs; head dims up to 128 (at 192 and 256 a second Q buffer
// leaves one K/V stage). H100, bf16: non-causal N = 1k 6% faster, 2k 5-8%, 4k 2-6%, 8k and 16k
// even; causal (half the keys a tile on average) 16-18% faster at 1k, 6-7% at 2k, 0-3% at 4k
// (docs/perf-log.md). So both walk up to 4096 keys. ALiBi and soft-capping never ask: run() gives
// them their instances first.
constexpr int kFwdSm90PersistentMaxKeys = 4096;
inline bool fwd_sm90_persistent(const FwdSm90Params& params, int head_dim) {
  const FwdParams& p = params.fwd;
  // Causal rows see at least one key each only where the keys are at least as many.
  const bool causal = p.window_right == 0 && p.seqlen_q <= p.seqlen_k;
  const FwdUnits units(p, params.block_m());
  return head_dim <= 128 && params.o_by_tma && p.num_splits == 1 && p.window_left < 0 &&
         (p.window_right < 0 || causal) && p.cu_seqlens_q == nullptr && p.keys.cu_seqlens == nullptr &&
         !p.keys.paged() && p.keys.seqused == nullptr && p.keys.leftpad == nullptr && p.keys.batch_idx == nullptr &&
         p.seqlen_k > 0 && p.seqlen_k <= kFwdSm90PersistentMaxKeys &&
         units.count > device_props().sms && units.count <= INT32_MAX;
}

// Three consumer warpgroups (192-row query tiles) pay off at head dims up to 64, where a step's
// products are short beside its softmax, on problems without a mask but the causal one (which
// makes tiles unequal). Unmasked from 1024 rows: H200, bf16, D = 64, N = 1k +11% over two
// (D = 32 +13%), though 1024 rows fill five tiles and a third (H100: 2k and 4k +3%, 16k +7%).
// Causal from 4096 rows, or from 2048 past the persistent walk's key limit, walking too where the
// keys are few enough (H200, D = 64: 16k +10-12%, 4k +7%; 2k -5%, 1k -7%; docs/perf-log.md).
constexpr int kFwdSm90ThreeConsumerMinRows = 1024;
constexpr int kFwdSm90ThreeConsumerCausalMinRows = 4096;
constexpr int kFwdSm90ThreeConsumerLongKeysMinRows = 2048;  // causal, past the walk's key limit
constexpr int kFwdSm90ThreeConsumerCausalMinKeys = 1024;    // causal rows over fewer keys keep two
inline int fwd_sm90_consumers(const AttentionProblem& pr, int head_dim) {
  const bool unmasked = !pr.causal && pr.window_left < 0 && pr.window_right < 0;
  const bool causal = (pr.causal || pr.window_right == 0) && pr.window_left < 0;
  const bool long_causal = causal && pr.seqlen_q >= kFwdSm90ThreeConsumerLongKeysMinRows &&
                           pr.seqlen_k > kFwdSm90ThreeConsumerCausalMinKeys &&
                           (pr.seqlen_q >= kFwdSm90ThreeConsumerCausalMinRows ||
                            pr.seqlen_k > kFwdSm90PersistentMaxKeys);
  return head_dim <= 64 && ((unmasked && pr.seqlen_q >= kFwdSm90ThreeConsumerMinRows) || long_causal)
             ? 3
             : 2;
}

}  // namespace fwd_sm90_detail

template <class T, int kHeadDim>
bool FwdSm90<T, kHeadDim>::make_maps(const AttentionProblem& pr, FwdSm90Params& params) {
  using sm90::attention_map_shape;
  // ALiBi and soft-capping each run one instance (run(), which picks them first): two consumers,
  // 128-key steps, a block per tile. A second ALiBi instance would cost build time for a few
  // percent at long key ranges (D = 128 only).
  const bool own_instance = pr.alibi_slopes != nullptr || pr.softcap > 0.0f;
  params.block_n = fwd_sm90_block_n(kHeadDim, pr.seqlen_k >= kFwdSm90LongKeys && !own_instance);
  params.consumers = own_instance ? 2 : fwd_sm90_detail::fwd_sm90_consumers(pr, kHeadDim);
  // O in boxes of one consumer's 64 rows; without a map the kernel stores O directly.
  params.o_by_tma = sm90::make_store_map(&params.o, pr.dtype, pr.o.data,
                                        attention_map_shape(pr, pr.o, pr.headdim_v, pr.seqlen_q, pr.total_q, pr.heads_q, 64));
  return sm90::make_tile_map(&params.q, pr.dtype, pr.q.data,
                             attention_map_shape(pr, pr.q, pr.headdim_qk, pr.seqlen_q, pr.total_q, pr.heads_q, params.block_m())) &&
         sm90::make_tile_map(&params.k, pr.dtype, pr.k.data,
                             attention_map_shape(pr, pr.k, pr.headdim_qk, pr.seqlen_k, pr.total_k, pr.heads_kv, params.block_n)) &&
         sm90::make_tile_map(&params.v, pr.dtype, pr.v.data,
                             attention_map_shape(pr, pr.v, pr.headdim_v, pr.seqlen_k, pr.total_k, pr.heads_kv, params.block_n));
}

template <class T, int kHeadDim>
int FwdSm90<T, kHeadDim>::num_splits(const FwdSm90Params& params) {
  const FwdParams& p = params.fwd;
  const int sms = device_props().sms;
  const int64_t tiles = int64_t(p.batch) * p.heads_q * fwd_query_tiles(p, params.block_m());
  const int key_blocks = (p.seqlen_k + params.block_n - 1) / params.block_n;
  return fwd_num_splits(tiles, key_blocks, sms, 1);  // one block per SM (launch bounds)
}

template <class T, int kHeadDim>
void FwdSm90<T, kHeadDim>::run(const FwdSm90Params& params, cudaStream_t stream) {
  const FwdParams& p = params.fwd;
  const int64_t tiles = fwd_query_tiles(p, params.block_m());
  if (tiles == 0 || p.heads_q == 0 || p.batch == 0) return;
  constexpr int kShort = fwd_sm90_block_n(kHeadDim, false), kLong = fwd_sm90_block_n(kHeadDim, true);
  using fwd_sm90_detail::launch;
  if (p.mod.has_alibi()) launch<T, kHeadDim, kShort, true>(params, tiles, stream);
  else if (p.softcap_pre > 0.0f) launch<T, kHeadDim, kShort, false, false, 2, true>(params, tiles, stream);
  else if (kLong != kShort && params.block_n == kLong) launch<T, kHeadDim, kLong, false>(params, tiles, stream);
  else if (params.consumers == 3 && fwd_sm90_detail::fwd_sm90_persistent(params, kHeadDim))  // (head dims <= 64)
    launch<T, kHeadDim, kShort, false, kHeadDim <= 64, kHeadDim <= 64 ? 3 : 2>(params, tiles, stream);
  else if (params.consumers == 3)
    launch<T, kHeadDim, kShort, false, false, kHeadDim <= 64 ? 3 : 2>(params, tiles, stream);
  else if (fwd_sm90_detail::fwd_sm90_persistent(params, kHeadDim))
    launch<T, kHeadDim, kShort, false, kHeadDim <= 128>(params, tiles, stream);
  else launch<T, kHeadDim, kShort, false>(params, tiles, stream);
  launch_fwd_combine<T>(p, stream);
}

}  // namespace tileattn::cuda

#define TILEATTN_INSTANTIATE_FWD_SM90(T, D) template struct tileattn::cuda::FwdSm90<T, D>;
