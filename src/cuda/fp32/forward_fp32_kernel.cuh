#pragma once
// fp32 attention forward: one block owns kBlockM query rows of one (sequence, head) and walks
// the key tiles its mask leaves visible, FlashAttention-2 style; each warp owns kMTiles x 16
// rows. Products run on tensor cores: fp64 in exact mode, TF32 in fast mode (mma_fp32.cuh).
//
// Pipeline (one K and one V buffer): the V tile loads while S = Q K^T is computed, and the
// next K tile loads while O += P V is computed.
//
// Dropout (kDropout, its own instance so that the Philox code's registers never weigh on the
// plain kernel) zeroes the dropped weights after the row statistics, as the 16-bit kernels do.
#include <cstdint>
#include <type_traits>

#include "common/mask.hpp"
#include "common/score_mod.hpp"
#include "common/online_softmax.hpp"
#include "common/varlen.hpp"
#include "cuda/arch/ptx_sm80.cuh"
#include "cuda/arch/async_copy.cuh"
#include "cuda/arch/mma_fp32.cuh"
#include "cuda/common/dropout_weights.cuh"
#include "cuda/fp32/fwd_params_fp32.hpp"

namespace tileattn::cuda::fp32 {

// Tile shapes, the one place they are chosen. kD is the head-dim bucket (max of qk and v).
// Registers per thread ~ O (kMTiles*kD/2 floats) + S (kMTiles*kBlockN/2, doubles in exact
// mode): exact mode and large head dims take 16 rows per warp and 32-key tiles. Exact mode
// at d=64 measured 13.5 ms with 16 rows per warp (4 blocks per SM) against 17.9 ms with 32
// (2 blocks per SM) on the H100 benchmark shape: the fp64 pipe wants the occupancy.
template <int kD, bool kExact>
struct FwdTile {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kMTiles = !kExact && kD <= 64 ? 2 : 1;
  static constexpr int kBlockM = kWarps * 16 * kMTiles;
  static constexpr int kBlockN = !kExact && kD <= 64 ? 64 : 32;
  // Row pitches in floats. Q and K are read as float2 (rows g, columns 2t): a pitch of 8 mod 32
  // words spreads a half-warp over all banks. V is read as scalars from rows 2t and 2t+1:
  // pitch 4 mod 32 does the same.
  static constexpr int kQLd = kD + 8;
  static constexpr int kKLd = kD + 8;
  static constexpr int kVLd = kD + 4;
  static constexpr int smem_floats() { return kBlockM * kQLd + kBlockN * (kKLd + kVLd); }
};

__device__ __forceinline__ int round_up8(int x) { return (x + 7) & ~7; }

// One 16-row strip of a score tile in the accumulator layout (thread (g, t): row `row` for
// e < 2 and row + 8 for e >= 2, column col0 + 8 nt + (e & 1) with col0 = n0 + 2t), made ready
// for the online softmax: soft-capped into the log2 domain (else left raw, scale * log2(e) folded
// into the exponent), -inf outside the mask where `need_mask` (tiles crossing a mask edge or the
// key end), then ALiBi's bias in the scores' units (finite, so masked scores stay -inf). Each
// step is a loop of its own behind one uniform branch: a branch per element inside the unrolled
// loop makes every element a taken jump, and the instruction-fetch stalls after those jumps were
// 37% of the Hopper TF32 forward's warp samples (docs/perf-log.md).
template <int kNT>
__device__ __forceinline__ void prepare_scores(float (&x)[kNT][4], const FwdParams& p, const Mask& mask,
                                               bool need_mask, bool alibi, float slope, int row, int col0) {
  if (p.softcap > 0.0f) {
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) x[nt][e] = apply_softcap(x[nt][e] * p.scale, p.softcap) * kLog2e;
  }
  if (need_mask) {
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (!mask.visible(row + (e >= 2 ? 8 : 0), col0 + nt * 8 + (e & 1))) x[nt][e] = -INFINITY;
  }
  if (alibi) {
    const float slope_x = p.softcap > 0.0f ? slope * kLog2e : slope / p.scale;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        x[nt][e] += ScoreMod::alibi_bias(slope_x, row + (e >= 2 ? 8 : 0), col0 + nt * 8 + (e & 1), mask.seqlen_q,
                                         mask.seqlen_k);
  }
}

template <int kD, bool kExact, bool kDropout>
__global__ void __launch_bounds__(FwdTile<kD, kExact>::kThreads) forward_fp32_kernel(const FwdParams p) {
  using Tile = FwdTile<kD, kExact>;
  using Acc = std::conditional_t<kExact, double, float>;
  constexpr int kBM = Tile::kBlockM, kBN = Tile::kBlockN, kMT = Tile::kMTiles;
  constexpr int kNT = kBN / 8, kDT = kD / 8;
  constexpr int kQLd = Tile::kQLd, kKLd = Tile::kKLd, kVLd = Tile::kVLd, kThreads = Tile::kThreads;

  extern __shared__ __align__(16) float smem[];
  float* q_s = smem;
  float* k_s = q_s + kBM * kQLd;
  float* v_s = k_s + kBN * kKLd;

  // Blocks of long causal rows go first so the short ones fill the tail of the grid.
  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z;
  const int hk = h / p.group;

  int sq = p.seqlen_q;
  int64_t q_off, o_off, lse_off;
  if (p.cu_seqlens_q != nullptr) {
    const SeqRange qr = varlen_range(p.cu_seqlens_q, b, p.total_q, p.seqlen_q);
    const int q_start = qr.begin;
    sq = qr.len;
    q_off = q_start * p.q_seq_stride;
    o_off = q_start * p.o_seq_stride;
    lse_off = int64_t(h) * p.total_q + q_start;
  } else {
    q_off = b * p.q_batch_stride;
    o_off = b * p.o_batch_stride;
    lse_off = (int64_t(b) * p.heads_q + h) * sq;
  }
  const KeySpan key = key_span(p.keys, b);
  const int sk = key.len;
  const int64_t k_off = key_offset(p.keys, key, 0, p.k_batch_stride, p.k_seq_stride);
  const int64_t v_off = key_offset(p.keys, key, 0, p.v_batch_stride, p.v_seq_stride);
  const int i0 = m_block * kBM;
  if (i0 >= sq) return;
  const float* q = p.q + q_off + h * p.q_head_stride + i0 * p.q_seq_stride;
  const float* k = p.k + k_off + hk * p.k_head_stride;
  const float* v = p.v + v_off + hk * p.v_head_stride;
  float* o = p.o + o_off + h * p.o_head_stride + i0 * p.o_seq_stride;
  float* lse = p.lse + lse_off + i0;

  const Mask mask{sq, sk, p.window_left, p.window_right};
  const bool alibi = p.mod.has_alibi();
  const float slope = p.mod.slope(b, h);  // natural units; 0 without ALiBi
  const int i1 = min(i0 + kBM, sq);
  // dropout_weights draws one Philox call per even key pair: with dropout the tiles start at an
  // even key (the extra column lies before full_begin, so its tile is masked).
  const int n_begin = kDropout ? mask.tile_begin_key(i0) & ~1 : mask.tile_begin_key(i0);
  const int n_end = mask.tile_end_key(i1);
  const int full_begin = mask.full_begin_key(i1), full_end = mask.full_end_key(i0);
  const int dqk8 = round_up8(p.dqk), dv8 = round_up8(p.dv);

  // K or V rows [n0, n0 + kBN): one strided block, or through the page table.
  auto load_keys = [&](float* tile, const float* base, int64_t batch_stride, int64_t seq_stride, int n0, int cols,
                       int cols_fill, auto ld) {
    constexpr int kLd = decltype(ld)::value;
    if (!key.pages) {
      load_tile_async<kBN, kD, kLd, kThreads>(tile, base + int64_t(n0) * seq_stride, seq_stride, sk - n0, cols,
                                              cols_fill, p.vec16);
    } else {
      const float* head0 = base - key_offset(p.keys, key, 0, batch_stride, seq_stride);
      auto row_address = [&](int r) { return head0 + key_offset(p.keys, key, n0 + r, batch_stride, seq_stride); };
      load_tile_async_rows<kBN, kD, kLd, kThreads>(tile, row_address, sk - n0, cols, cols_fill, p.vec16);
    }
  };
  auto load_k = [&](int n0) {
    load_keys(k_s, k, p.k_batch_stride, p.k_seq_stride, n0, p.dqk, dqk8, std::integral_constant<int, kKLd>{});
  };
  auto load_v = [&](int n0) {
    load_keys(v_s, v, p.v_batch_stride, p.v_seq_stride, n0, p.dv, dv8, std::integral_constant<int, kVLd>{});
  };

  load_tile_async<kBM, kD, kQLd, kThreads>(q_s, q, p.q_seq_stride, i1 - i0, p.dqk, dqk8, p.vec16);
  cp_async_commit();
  if (n_begin < n_end) load_k(n_begin);
  cp_async_commit();
  if constexpr (!kExact) {
    // Q (read by every key tile) is rounded to TF32 once; K and V go in as fp32 bits, which
    // the tensor core truncates to TF32: rounding each fragment would cost an instruction per
    // element per warp, the scarcest resource of this loop.
    cp_async_wait<1>();
    __syncthreads();
    for (int idx = threadIdx.x; idx < kBM * kD; idx += kThreads) {
      const int r = idx / kD, c = idx % kD;
      if (c < dqk8) q_s[r * kQLd + c] = __uint_as_float(to_tf32(q_s[r * kQLd + c]));
    }
  }

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int wm0 = warp * kMT * 16;

  float acc[kMT][kDT][4];
  float row_max[kMT][2], row_sum[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][dt][e] = 0.0f;
    row_max[mt][0] = row_max[mt][1] = -INFINITY;
    row_sum[mt][0] = row_sum[mt][1] = 0.0f;
  }

  for (int n0 = n_begin; n0 < n_end; n0 += kBN) {
    cp_async_wait<0>();
    __syncthreads();  // K tile (and, first time, Q) visible; V buffer free
    load_v(n0);
    cp_async_commit();

    // S = Q K^T
    Acc sa[kMT][kNT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) sa[mt][nt][e] = Acc(0);
#pragma unroll
    for (int ks = 0; ks < kDT; ++ks) {
      if (ks * 8 >= dqk8) break;
      float qa[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        const int r = wm0 + mt * 16 + g;
        const float2 x0 = *reinterpret_cast<const float2*>(&q_s[r * kQLd + ks * 8 + 2 * t]);
        const float2 x1 = *reinterpret_cast<const float2*>(&q_s[(r + 8) * kQLd + ks * 8 + 2 * t]);
        qa[mt][0] = x0.x, qa[mt][1] = x1.x, qa[mt][2] = x0.y, qa[mt][3] = x1.y;
      }
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        const float2 kv = *reinterpret_cast<const float2*>(&k_s[(nt * 8 + g) * kKLd + ks * 8 + 2 * t]);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          if constexpr (kExact) {
            const double ad[4] = {qa[mt][0], qa[mt][1], qa[mt][2], qa[mt][3]}, bd[2] = {kv.x, kv.y};
            mma_16x8x8_f64(sa[mt][nt], ad, bd);
          } else {
            const uint32_t au[4] = {__float_as_uint(qa[mt][0]), __float_as_uint(qa[mt][1]),
                                    __float_as_uint(qa[mt][2]), __float_as_uint(qa[mt][3])};
            const uint32_t bu[2] = {__float_as_uint(kv.x), __float_as_uint(kv.y)};
            mma_16x8x8_tf32(sa[mt][nt], au, bu);
          }
        }
      }
    }

    const bool capped = p.softcap > 0.0f;
    const float to_log2 = capped ? 1.0f : p.scale_log2;
    const bool need_mask = n0 < full_begin || n0 + kBN > full_end;
    float s[kMT][kNT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = float(sa[mt][nt][e]);
      prepare_scores(s[mt], p, mask, need_mask, alibi, slope, i0 + wm0 + mt * 16 + g, n0 + 2 * t);
    }

    // Online softmax: each row lives in the 4 lanes of a quad; row_max is in the log2 domain.
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * hf], s[mt][nt][2 * hf + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        mx = fmaxf(row_max[mt][hf], mx * to_log2);
        const float factor = rescale_factor(row_max[mt][hf], mx);
        row_max[mt][hf] = mx;
        const float base = safe_row_max(mx);
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int e = 2 * hf; e < 2 * hf + 2; ++e) {
            const float arg = fmaf(s[mt][nt][e], to_log2, -base);
            const float pe = kExact ? exp2f(arg) : exp2_fast(arg);
            s[mt][nt][e] = pe;
            sum += pe;
          }
        row_sum[mt][hf] = row_sum[mt][hf] * factor + sum;
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) {
          acc[mt][dt][2 * hf] *= factor;
          acc[mt][dt][2 * hf + 1] *= factor;
        }
      }
    // The statistics above stay undropped: only P V sees the mask.
    if constexpr (kDropout) dropout_weights(s, p.dropout, b, h, i0 + wm0 + g, n0);

    cp_async_wait<0>();
    __syncthreads();  // V tile visible; every warp is done with this K tile
    if (n0 + kBN < n_end) load_k(n0 + kBN);
    cp_async_commit();

    // O += P V; the S accumulator layout is the A fragment layout (see mma_fp32.cuh).
    if constexpr (kExact) {
      // Each 8-column slice of this tile's P V is summed in fp64 and rounded into O once.
      double pd[kMT][kNT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int kk = 0; kk < kNT; ++kk) {
          pd[mt][kk][0] = s[mt][kk][0], pd[mt][kk][1] = s[mt][kk][2];
          pd[mt][kk][2] = s[mt][kk][1], pd[mt][kk][3] = s[mt][kk][3];
        }
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt) {
        if (dt * 8 >= dv8) break;
        double part[kMT][4] = {};
#pragma unroll
        for (int kk = 0; kk < kNT; ++kk) {
          const double vb[2] = {v_s[(kk * 8 + 2 * t) * kVLd + dt * 8 + g], v_s[(kk * 8 + 2 * t + 1) * kVLd + dt * 8 + g]};
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) mma_16x8x8_f64(part[mt], pd[mt][kk], vb);
        }
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mt][dt][e] += float(part[mt][e]);
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < kNT; ++kk) {
        uint32_t pa[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          pa[mt][0] = to_tf32(s[mt][kk][0]), pa[mt][1] = to_tf32(s[mt][kk][2]);
          pa[mt][2] = to_tf32(s[mt][kk][1]), pa[mt][3] = to_tf32(s[mt][kk][3]);
        }
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) {
          if (dt * 8 >= dv8) break;
          const uint32_t vb[2] = {__float_as_uint(v_s[(kk * 8 + 2 * t) * kVLd + dt * 8 + g]),
                                  __float_as_uint(v_s[(kk * 8 + 2 * t + 1) * kVLd + dt * 8 + g])};
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) mma_16x8x8_tf32(acc[mt][dt], pa[mt], vb);
        }
      }
    }
  }

  // Epilogue: O / sum and L; rows that saw no key get O = 0 and L = -inf.
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float sum = row_sum[mt][hf];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      float inv = inverse_row_sum(sum);
      if constexpr (kDropout) inv *= p.dropout.scale;
      const int r = wm0 + mt * 16 + g + hf * 8;
      if (i0 + r >= sq) continue;
      float* orow = o + int64_t(r) * p.o_seq_stride;
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt) {
        const int c = dt * 8 + 2 * t;
        if (c < p.dv) orow[c] = acc[mt][dt][2 * hf] * inv;
        if (c + 1 < p.dv) orow[c + 1] = acc[mt][dt][2 * hf + 1] * inv;
      }
      float l = finish_lse(row_max[mt][hf], sum);
      // ALiBi's causal form: L as flash-attn returns it (ScoreMod::lse_offset).
      if (p.mod.alibi_lse_offset && l != -INFINITY) l += p.mod.lse_offset(slope, i0 + r, sq, sk);
      if (t == 0) lse[r] = l;
    }
}

}  // namespace tileattn::cuda::fp32
