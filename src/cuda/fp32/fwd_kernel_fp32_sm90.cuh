#pragma once
// fp32 attention forward on Hopper, fast mode (TF32) and exact mode (split TF32): one block per
// (128 query rows, head, sequence), three warpgroups, the shape of the 16-bit sm90 forward.
//
//   warpgroup 0      producer: one thread loads Q once and K(j), V(j) with TMA (K through two
//                    stages, V through two or, at head dim 128, one); all four warps rewrite each
//                    V tile K-major (the only B layout TF32 wgmma reads) into one of two
//                    transposed buffers.
//   warpgroups 1, 2  consumers, 64 query rows each: S = Q K^T (wgmma, both from shared memory),
//                    the online softmax, O += P V (wgmma, P from registers).
//
// P goes to the A fragment without moving between lanes: the transposed V holds its keys in the
// order that fragment wants (Tf32Transposed, tf32_operands_sm90.cuh).
//
// Exact mode (kExact, head dims up to 64) splits every operand, x = hi + lo (split_tf32, both
// halves rounded to nearest), and forms each product as a_lo b_hi + a_hi b_lo + a_hi b_hi; V
// takes a third part, so that a row that sees one key gets O = V exactly, as a naive kernel's
// does. Q_hi lives in registers and Q_lo over Q in shared memory; the producer writes K_hi over
// K, and K_lo and V^T's three parts into the transposed buffer. The tensor core's own sums drop
// bits toward zero, so few hi products meet in one accumulator: S sums the head dim in two halves
// of at most 32, and each tile's 64 keys of P V go into fresh accumulators that are added to O
// with fp32 adds (softmax(X)V's exact kernel measured 32 and 64 keys per accumulator at 0.6-0.7
// of the 2x bound, 128 failing it: docs/perf-log.md). The exponential is exp2f, as in the
// portable exact kernel.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/mask.hpp"
#include "common/online_softmax.hpp"
#include "common/varlen.hpp"
#include "cuda/arch/ptx_sm80.cuh"
#include "cuda/fp32/forward_fp32_kernel.cuh"
#include "cuda/arch/mma_fp32.cuh"
#include "cuda/arch/pipeline_sm90.cuh"
#include "cuda/arch/ptx_sm90.cuh"
#include "cuda/arch/tf32_operands_sm90.cuh"
#include "cuda/arch/wgmma_ops.cuh"

namespace tileattn::cuda::fp32 {

struct FwdSm90Params {
  FwdParams fwd;
  CUtensorMap q, k, v;  // (dim, rows, heads, batch); varlen: (dim, total rows, heads, 1)
};

template <int kD, bool kExact = false>
struct FwdSm90Tile {
  // The transpose's unit indices spill at 40 producer registers (head dim 128's four column
  // panels at 48).
  using Roles = sm90::WarpRoles<2, kD <= 64 ? 48 : 56, 224>;
  static constexpr int kConsumers = Roles::kConsumers;
  static constexpr int kThreads = Roles::kThreads;
  static constexpr int kBlockM = 64 * kConsumers;
  // Head dim 128 takes 64-key tiles and one raw V stage: Q alone is 64 KB there, and two K
  // stages, one V stage and two transposed buffers fill the rest of shared memory.
  // Exact mode: 64-key tiles, for its registers (P in two parts, two P V accumulators).
  static constexpr int kBlockN = kD <= 64 && !kExact ? 128 : 64;
  static constexpr int kVStages = kD <= 64 ? 2 : 1;
  // Q's A fragments in the consumers' registers up to head dim 64 (32 a thread).
  static constexpr bool kQInRegisters = kD <= 64;
  static constexpr int kPanels = kD / 32;  // 128-byte panels of 32 fp32 columns
  static constexpr int kQBytes = kPanels * kBlockM * 128;
  static constexpr int kKVPanelBytes = kBlockN * 128;
  static constexpr int kKVBytes = kPanels * kKVPanelBytes;
  using VT = sm90::Tf32Transposed<kBlockN, kD>;  // V rewritten K-major
  // A transposed buffer: V^T; exact mode: K_lo, then V^T in three parts (V_hi, V_lo, V_lo2).
  static constexpr int kKLoOffset = 0, kVOffset = kExact ? kKVBytes : 0;
  static constexpr int kTBytes = kExact ? kKVBytes + 3 * VT::kBytes : VT::kBytes;
  // K through two stages; raw V through kVStages (the producer warpgroup frees a stage itself,
  // behind a named barrier, so its empty barriers go unused); V transposed through two.
  using KRing = sm90::StageRing<2>;
  using VRing = sm90::StageRing<kVStages>;
  using TRing = sm90::StageRing<2>;
  enum Region { kQ, kK, kV, kT, kBarriers };
  using Smem = sm90::SmemRegions<kQBytes, 2 * kKVBytes, kVStages * kKVBytes, 2 * kTBytes,
                                 8 + KRing::kBarrierBytes + VRing::kBarrierBytes + TRing::kBarrierBytes>;
  static constexpr int kSmemBytes = Smem::kBytes;
  static_assert(kD == 32 || kD == 64 || kD == 128, "fp32 sm90 forward: head dims 32, 64 or 128");
  static_assert(kSmemBytes <= 227 * 1024, "fp32 sm90 forward: stages exceed shared memory");
  static_assert(!kExact || kD <= 64, "fp32 sm90 forward: exact mode takes head dims up to 64 (Q_hi in registers)");
};

// kAlibi: ALiBi's bias joins the scores after the cap and the mask, as in the portable fp32
// kernel; an instance of its own, so that the kernel without it keeps its machine code.
template <int kD, bool kExact, bool kAlibi>
__global__ void __launch_bounds__(FwdSm90Tile<kD, kExact>::kThreads, 1)
    forward_fp32_kernel_sm90(const __grid_constant__ FwdSm90Params params) {
#if defined(TILEATTN_SM90_ENABLED)
  using Tile = FwdSm90Tile<kD, kExact>;
  using Roles = typename Tile::Roles;
  constexpr int kBM = Tile::kBlockM, kBN = Tile::kBlockN;
  const FwdParams& p = params.fwd;

  extern __shared__ unsigned char smem_raw[];
  const typename Tile::Smem smem(smem_raw);
  unsigned char* sQ = smem.template at<Tile::kQ>();
  unsigned char* sK = smem.template at<Tile::kK>();
  unsigned char* sV = smem.template at<Tile::kV>();
  unsigned char* sT = smem.template at<Tile::kT>();
  uint64_t* q_full = smem.template at<Tile::kBarriers, uint64_t>();
  const typename Tile::KRing k_ring{q_full + 1};
  const typename Tile::VRing v_ring{k_ring.end()};
  const typename Tile::TRing t_ring{v_ring.end()};

  const int m_block = int(gridDim.x) - 1 - int(blockIdx.x);  // long causal rows first
  const int h = int(blockIdx.y), b = int(blockIdx.z);
  const int hk = h / p.group;
  int sq = p.seqlen_q, sk = p.seqlen_k, q_row0 = 0, k_row0 = 0, map_batch = b;
  int64_t o_off, lse_off;
  if (p.cu_seqlens_q != nullptr) {
    const SeqRange qr = varlen_range(p.cu_seqlens_q, b, p.total_q, p.seqlen_q);
    const SeqRange kr = varlen_range(p.cu_seqlens_k, b, p.total_k, p.seqlen_k);
    q_row0 = qr.begin, k_row0 = kr.begin, map_batch = 0;
    sq = qr.len;
    sk = kr.len;
    o_off = q_row0 * p.o_seq_stride;
    lse_off = int64_t(h) * p.total_q + q_row0;
  } else {
    o_off = b * p.o_batch_stride;
    lse_off = (int64_t(b) * p.heads_q + h) * sq;
  }
  const int i0 = m_block * kBM;
  if (i0 >= sq) return;
  const Mask mask{sq, sk, p.window_left, p.window_right};
  const int i1 = min(i0 + kBM, sq);
  const int n_begin = mask.tile_begin_key(i0), n_end = mask.tile_end_key(i1);
  const int full_begin = mask.full_begin_key(i1), full_end = mask.full_end_key(i0);
  const int n_tiles = n_begin < n_end ? (n_end - n_begin + kBN - 1) / kBN : 0;

  if (threadIdx.x == 0) {
    sm90::barrier_init(q_full, 1);
    k_ring.init(1, 4 * Tile::kConsumers);  // one release per consumer warp
    v_ring.init(1, 1);
    t_ring.init(4, 4 * Tile::kConsumers);  // one publish per producer warp
    sm90::barrier_init_fence();
  }
  __syncthreads();

  const Roles roles;
  const int warp = Roles::warp(), lane = Roles::lane();

  if (roles.warpgroup == 0) {
    Roles::enter_producer();
    if (n_tiles == 0) return;
    const int tid = int(threadIdx.x);
    constexpr int kVSt = Tile::kVStages;
    auto issue_k = [&](int j) {
      uint64_t* full = k_ring.acquire_bytes(j, Tile::kKVBytes);
#pragma unroll
      for (int c = 0; c < Tile::kPanels; ++c)
        sm90::tma_load_4d(sK + k_ring.slot(j) * Tile::kKVBytes + c * Tile::kKVPanelBytes, &params.k, full, 32 * c,
                          k_row0 + n_begin + j * kBN, hk, map_batch);
    };
    // V(j) into raw stage j % kVSt, which every producer thread has read before the named
    // barrier that ends the transpose of tile j - kVSt.
    auto issue_v = [&](int j) {
      uint64_t* full = v_ring.expect_bytes(j, Tile::kKVBytes);
#pragma unroll
      for (int c = 0; c < Tile::kPanels; ++c)
        sm90::tma_load_4d(sV + v_ring.slot(j) * Tile::kKVBytes + c * Tile::kKVPanelBytes, &params.v, full, 32 * c,
                          k_row0 + n_begin + j * kBN, hk, map_batch);
    };
    if (tid == 0) {
      sm90::barrier_arrive_expect_bytes(q_full, Tile::kQBytes);
#pragma unroll
      for (int c = 0; c < Tile::kPanels; ++c)
        sm90::tma_load_4d(sQ + c * Tile::kBlockM * 128, &params.q, q_full, 32 * c, q_row0 + i0, h, map_batch);
      issue_k(0);
      issue_v(0);
    }
    for (int j = 0; j < n_tiles; ++j) {
      if (tid == 0 && j + 1 < n_tiles) {
        issue_k(j + 1);
        if constexpr (kVSt == 2) issue_v(j + 1);
      }
      t_ring.acquire(j);
      unsigned char* dst = sT + t_ring.slot(j) * Tile::kTBytes;
      if constexpr (kExact) {
        // K_hi over K, K_lo beside V^T: the consumers read K(j) only once this buffer is published.
        k_ring.wait(j);
        float4* k = reinterpret_cast<float4*>(sK + k_ring.slot(j) * Tile::kKVBytes);
        float4* k_lo = reinterpret_cast<float4*>(dst + Tile::kKLoOffset);
#pragma unroll 4
        for (int idx = tid; idx < Tile::kKVBytes / 16; idx += 128) {
          float4 hi, lo;
          split_tf32(k[idx], hi, lo);
          k[idx] = hi;
          k_lo[idx] = tf32_rn(lo);
        }
      }
      v_ring.wait(j);
      const unsigned char* src = sV + v_ring.slot(j) * Tile::kKVBytes;
      if constexpr (kExact) Tile::VT::template write_split<3>(src, dst + Tile::kVOffset, tid, 128);
      else Tile::VT::write(src, dst, tid, 128);
      sm90::fence_shared_to_async();
      t_ring.publish_warp(j, lane);
      sm90::named_barrier_sync(sm90::kFp32VStageRead, 128);
      if constexpr (kVSt == 1)
        if (tid == 0 && j + 1 < n_tiles) issue_v(j + 1);
    }
    return;
  }

  Roles::enter_consumer();
  const int consumer = roles.consumer();
  const int g = lane / 4, t = lane % 4;
  const int wrow = 64 * consumer + 16 * warp + g;  // block row of (g, e < 2); +8 for e >= 2

  float acc_o[kD / 8][4];
#pragma unroll
  for (int dt = 0; dt < kD / 8; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_o[dt][e] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
  // Exact mode without a cap or bias: the row's largest raw score, whose scaled value is the max
  // the backward's statistics would find (the scaling is monotone and the products the same).
  [[maybe_unused]] float raw_max[2] = {-INFINITY, -INFINITY};

  if (n_tiles > 0) {
    // Q, read by every key tile, is rounded to TF32 once (each consumer its own 64 rows): into
    // registers as the A operand of every S product where they hold it (the product then reads
    // only K from shared memory, whose bandwidth bounds a TF32 product with both operands there),
    // else in place. K and V go in as fp32 bits, which the tensor core truncates.
    sm90::barrier_wait(q_full, 0);
    [[maybe_unused]] uint32_t qa[Tile::kQInRegisters ? kD / 8 : 1][4];
    if constexpr (kExact) {
      // Q_hi into registers, then Q_lo over Q (each consumer its own rows, each element by one
      // thread, once every warp of the consumer has read its Q_hi).
      sm90::tf32_a_fragments<kD>(qa, sQ, kBM, 64 * consumer + 16 * warp, lane);
      sm90::named_barrier_sync(sm90::kFp32QRoundedConsumer0 + consumer, 128);
      const int ctid = int(threadIdx.x) % 128;
#pragma unroll
      for (int c = 0; c < Tile::kPanels; ++c) {
        float4* rows = reinterpret_cast<float4*>(sQ + c * kBM * 128 + consumer * 64 * 128);
#pragma unroll
        for (int idx = ctid; idx < 64 * 8; idx += 128) {
          float4 hi, lo;
          split_tf32(rows[idx], hi, lo);
          rows[idx] = tf32_rn(lo);
        }
      }
      sm90::fence_shared_to_async();
      sm90::named_barrier_sync(sm90::kFp32QRoundedConsumer0 + consumer, 128);
    } else if constexpr (Tile::kQInRegisters) {
      sm90::tf32_a_fragments<kD>(qa, sQ, kBM, 64 * consumer + 16 * warp, lane);
    } else {
      const int ctid = int(threadIdx.x) % 128;
#pragma unroll
      for (int c = 0; c < Tile::kPanels; ++c) {
        float4* rows = reinterpret_cast<float4*>(sQ + c * kBM * 128 + consumer * 64 * 128);
#pragma unroll
        for (int idx = ctid; idx < 64 * 8; idx += 128) {
          float4 v = rows[idx];
          v.x = __uint_as_float(to_tf32(v.x)), v.y = __uint_as_float(to_tf32(v.y));
          v.z = __uint_as_float(to_tf32(v.z)), v.w = __uint_as_float(to_tf32(v.w));
          rows[idx] = v;
        }
      }
      sm90::fence_shared_to_async();
      sm90::named_barrier_sync(sm90::kFp32QRoundedConsumer0 + consumer, 128);
    }
    const uint32_t q_base = smem_address(sQ) + consumer * 64 * 128;
    const bool capped = p.softcap > 0.0f;
    const float to_log2 = capped ? 1.0f : p.scale_log2;

    for (int j = 0; j < n_tiles; ++j) {
      const int n0 = n_begin + j * kBN;

      // S = Q K^T; a k-step of 8 columns is 32 bytes along a 128-byte row of one panel.
      float acc_s[kBN / 8][4];
      const uint32_t k_base = smem_address(sK + k_ring.slot(j) * Tile::kKVBytes);
      const uint32_t t_base = smem_address(sT + t_ring.slot(j) * Tile::kTBytes);
      auto k_desc_at = [&](uint32_t base, int ks) {
        return sm90::k_major_descriptor(base + (ks / 4) * Tile::kKVPanelBytes + (ks % 4) * 32);
      };
      auto q_desc_at = [&](int ks) { return sm90::k_major_descriptor(q_base + (ks / 4) * kBM * 128 + (ks % 4) * 32); };
      if constexpr (kExact) {
        // Q_lo K_hi + Q_hi K_lo + Q_hi K_hi, the last in two accumulators of half the head dim each.
        constexpr int kHalf = kD / 16;
        float acc_s2[kBN / 8][4];
        t_ring.wait(j);
        sm90::wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kD / 8; ++ks)
          sm90::Wgmma<float, kBN>::ss(acc_s, q_desc_at(ks), k_desc_at(k_base, ks), ks > 0);
#pragma unroll
        for (int ks = 0; ks < kD / 8; ++ks)
          sm90::Wgmma<float, kBN>::rs(acc_s, qa[ks], k_desc_at(t_base + Tile::kKLoOffset, ks), 1);
#pragma unroll
        for (int ks = 0; ks < kHalf; ++ks) sm90::Wgmma<float, kBN>::rs(acc_s, qa[ks], k_desc_at(k_base, ks), 1);
#pragma unroll
        for (int ks = kHalf; ks < kD / 8; ++ks)
          sm90::Wgmma<float, kBN>::rs(acc_s2, qa[ks], k_desc_at(k_base, ks), ks > kHalf);
        sm90::wgmma_commit();
        sm90::wgmma_wait<0>();
        sm90::fence_registers(acc_s);
        sm90::fence_registers(acc_s2);
#pragma unroll
        for (int nt = 0; nt < kBN / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_s[nt][e] += acc_s2[nt][e];
      } else {
        k_ring.wait(j);
        sm90::wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kD / 8; ++ks) {
          if constexpr (Tile::kQInRegisters)
            sm90::Wgmma<float, kBN>::rs(acc_s, qa[ks], k_desc_at(k_base, ks), ks > 0);
          else
            sm90::Wgmma<float, kBN>::ss(acc_s, q_desc_at(ks), k_desc_at(k_base, ks), ks > 0);
        }
        sm90::wgmma_commit();
        sm90::wgmma_wait<0>();
        sm90::fence_registers(acc_s);
      }
      k_ring.release_warp(j, lane);

      const bool need_mask = n0 < full_begin || n0 + kBN > full_end;
      prepare_scores(acc_s, p, mask, need_mask, kAlibi, kAlibi ? p.mod.slope(b, h) : 0.0f, i0 + wrow, n0 + 2 * t);
      float factor[2];
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < kBN / 8; ++nt) mx = fmaxf(mx, fmaxf(acc_s[nt][2 * hf], acc_s[nt][2 * hf + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        if constexpr (kExact && !kAlibi) raw_max[hf] = fmaxf(raw_max[hf], mx);
        mx = fmaxf(row_max[hf], mx * to_log2);
        factor[hf] = rescale_factor(row_max[hf], mx);
        row_max[hf] = mx;
        const float base = safe_row_max(mx);
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < kBN / 8; ++nt)
#pragma unroll
          for (int e = 2 * hf; e < 2 * hf + 2; ++e) {
            // Exact mode rounds the product on its own, as the row max was rounded: contracted
            // into the subtraction, the row's largest score kept its rounding residual in the
            // exponent, so a row's only visible key could get P = 1 - 2^-24 and O a unit off V.
            const float arg = kExact ? __fmul_rn(acc_s[nt][e], to_log2) - base : fmaf(acc_s[nt][e], to_log2, -base);
            acc_s[nt][e] = kExact ? exp2f(arg) : exp2_fast(arg);
            sum += acc_s[nt][e];
          }
        row_sum[hf] = row_sum[hf] * factor[hf] + sum;
      }
      if constexpr (kExact) {
        // O += P_hi V_hi + (P_hi V_lo2 + P_lo V_hi + P_hi V_lo), the two sums in fresh accumulators
        // added in fp32: a row that sees one key gets V_hi + (V_lo2 + V_lo) = V exactly (the three
        // parts of V, each sum exact in the tensor core), as a naive kernel's O = 1 * V.
        uint32_t pa[kBN / 8][4], pl[kBN / 8][4];
#pragma unroll
        for (int kk = 0; kk < kBN / 8; ++kk)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float x = acc_s[kk][(i % 2) * 2 + i / 2];  // A fragment i: (row, k) of C element 2(i%2) + i/2
            float hi, lo;
            split_tf32(x, hi, lo);
            pa[kk][i] = __float_as_uint(hi), pl[kk][i] = tf32_bits(lo);
          }
        const uint32_t v_hi = t_base + Tile::kVOffset, v_lo = v_hi + Tile::VT::kBytes, v_lo2 = v_lo + Tile::VT::kBytes;
        using Mma = sm90::Wgmma<float, kD>;
        float o_hi[kD / 8][4], o_lo[kD / 8][4];
        sm90::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBN / 8; ++kk) Mma::rs(o_lo, pa[kk], Tile::VT::k_major(v_lo2, kk), kk > 0);
#pragma unroll
        for (int kk = 0; kk < kBN / 8; ++kk) Mma::rs(o_lo, pl[kk], Tile::VT::k_major(v_hi, kk), 1);
#pragma unroll
        for (int kk = 0; kk < kBN / 8; ++kk) Mma::rs(o_lo, pa[kk], Tile::VT::k_major(v_lo, kk), 1);
#pragma unroll
        for (int kk = 0; kk < kBN / 8; ++kk) Mma::rs(o_hi, pa[kk], Tile::VT::k_major(v_hi, kk), kk > 0);
        sm90::wgmma_commit();
        sm90::wgmma_wait<0>();
        sm90::fence_registers(o_hi);
        sm90::fence_registers(o_lo);
#pragma unroll
        for (int dt = 0; dt < kD / 8; ++dt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_o[dt][e] = fmaf(acc_o[dt][e], factor[e / 2], o_hi[dt][e] + o_lo[dt][e]);
      } else {
#pragma unroll
        for (int dt = 0; dt < kD / 8; ++dt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_o[dt][e] *= factor[e / 2];

        uint32_t pa[kBN / 8][4];
#pragma unroll
        for (int kk = 0; kk < kBN / 8; ++kk) {
          pa[kk][0] = to_tf32(acc_s[kk][0]), pa[kk][1] = to_tf32(acc_s[kk][2]);
          pa[kk][2] = to_tf32(acc_s[kk][1]), pa[kk][3] = to_tf32(acc_s[kk][3]);
        }

        // O += P V; k-step kk is 32 bytes along the rows of transposed panel kk / 4.
        t_ring.wait(j);
        sm90::fence_registers(acc_o);
        sm90::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBN / 8; ++kk)
          sm90::Wgmma<float, kD>::rs(acc_o, pa[kk], Tile::VT::k_major(t_base, kk), 1);
        sm90::wgmma_commit();
        sm90::wgmma_wait<0>();
        sm90::fence_registers(acc_o);
      }
      t_ring.release_warp(j, lane);
    }
  }

  // Epilogue: O / sum and L; rows that saw no key get O = 0 and L = -inf.
  float* o = p.o + o_off + int64_t(h) * p.o_head_stride;
  float* lse = p.lse + lse_off;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    float sum = row_sum[hf];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const float inv = inverse_row_sum(sum);
    const int i = i0 + wrow + 8 * hf;
    if (i >= sq) continue;
    float* orow = o + int64_t(i) * p.o_seq_stride;
#pragma unroll
    for (int dt = 0; dt < kD / 8; ++dt) {
      const int c = dt * 8 + 2 * t;
      if (c < p.dv) orow[c] = acc_o[dt][0 + 2 * hf] * inv;
      if (c + 1 < p.dv) orow[c + 1] = acc_o[dt][1 + 2 * hf] * inv;
    }
    if constexpr (kAlibi) {
      // ALiBi's causal form: L as flash-attn returns it (ScoreMod::lse_offset).
      float l = finish_lse(row_max[hf], sum);
      if (p.mod.alibi_lse_offset && l != -INFINITY) l += p.mod.lse_offset(p.mod.slope(b, h), i, sq, sk);
      if (t == 0) lse[i] = l;
    } else {
      if (t == 0) lse[i] = finish_lse(row_max[hf], sum);
      // The backward's natural-units max (scaled as bwd::stats_score scales) and this row's sum,
      // where the host hands the buffer over (no cap, no bias: forward_fp32.cu).
      if constexpr (kExact)
        if (p.softmax_stats != nullptr && t == 0) {
          float* stats = p.softmax_stats + 2 * (lse_off + i);
          stats[0] = raw_max[hf] == -INFINITY ? -INFINITY : __fmul_rn(raw_max[hf], p.scale);
          stats[1] = sum;
        }
    }
  }
#endif
}

}  // namespace tileattn::cuda::fp32
