#pragma once
// out = softmax(X) @ V without materialising softmax(X): the attention forward with the scores
// given. One block owns kBlockM rows of X and a kBlockD3 slice of out's columns, and streams
// (X, V) tiles along d2 through a kStages-deep cp.async pipeline with an online softmax.
//
// Warps form a 4 (rows) x 2 (columns) grid. The two column warps of a row band both compute the
// band's softmax: recomputing exp is cheaper than exchanging P through shared memory. Blocks
// of the same rows but different column slices are adjacent in the grid, so they run together
// and the second read of an X tile is served from L2.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "common/online_softmax.hpp"
#include "cuda/arch/ptx_sm80.cuh"
#include "cuda/arch/async_copy.cuh"
#include "cuda/arch/mma_fp32.cuh"

namespace tileattn::cuda::smm {

struct Params {
  const void* x;
  const void* v;
  void* out;
  int64_t x_batch_stride, x_row_stride;
  int64_t v_batch_stride, v_row_stride;
  int64_t out_batch_stride, out_row_stride;
  int d1, d2, d3;
  int d3_blocks;  // column slices per row band
  bool vec16;     // X and V rows 16-byte aligned with d2, d3 multiples of the 16-byte vector
};

// Tile shapes. fp32 takes 8-deep k steps (fp64 or TF32 products, mma_fp32.cuh), 16-bit types
// 16-deep (m16n8k16). Accumulators per thread: kMTiles * kD3Tiles * 4 (128 floats for the wide
// slice); fp32 exact mode accumulates in fp64 and so takes at most 128-column slices.
template <class T, int kBlockD3, bool kExact>
struct SmmTile {
  static constexpr bool kF32 = std::is_same_v<T, float>;
  static constexpr int kWarpsM = 4, kWarpsN = 2, kWarps = kWarpsM * kWarpsN, kThreads = kWarps * 32;
  static constexpr int kMTiles = 2;  // 16-row MMA tiles per warp
  static constexpr int kBlockM = kWarpsM * kMTiles * 16;
  static constexpr int kD3Tiles = kBlockD3 / kWarpsN / 8;  // 8-column MMA tiles per warp
  static constexpr int kKStep = kF32 ? 8 : 16;
  static constexpr int kBlockN = 32;  // d2 columns per stage; scores take kMTiles * kBlockN / 2 registers
  static constexpr int kStages = 3;
  static constexpr int kVec = 16 / sizeof(T);  // elements per 16-byte copy
  // Pitches (elements): X fragments are read as 8-byte (fp32) or 4-byte pairs from rows g,
  // V as fp32 scalars from rows 2t, 2t+1 or by ldmatrix.trans (16-bit): these avoid conflicts.
  static constexpr int kXLd = kBlockN + 8;
  static constexpr int kVLd = kBlockD3 + (kF32 ? 4 : 8);
  static constexpr int kStageElems = kBlockM * kXLd + kBlockN * kVLd;
  static constexpr size_t smem_bytes() { return size_t(kStages) * kStageElems * sizeof(T); }
};

// Copies a rows x cols tile of 16-bit or fp32 elements (zero beyond the source).
template <int kRows, int kCols, int kLd, int kThreads, class T>
__device__ __forceinline__ void load_tile(T* smem, const T* gmem, int64_t ld, int rows, int cols, bool vec16) {
  constexpr int kVec = 16 / sizeof(T);
  if (vec16) {
    constexpr int kChunks = kCols / kVec;
#pragma unroll 4
    for (int idx = threadIdx.x; idx < kRows * kChunks; idx += kThreads) {
      const int r = idx / kChunks, c = (idx % kChunks) * kVec;
      const bool valid = r < rows && c < cols;
      cp_async_16(smem_address(smem + r * kLd + c), valid ? gmem + r * ld + c : gmem, valid ? 16 : 0);
    }
  } else if constexpr (sizeof(T) == 4) {
#pragma unroll 4
    for (int idx = threadIdx.x; idx < kRows * kCols; idx += kThreads) {
      const int r = idx / kCols, c = idx % kCols;
      const bool valid = r < rows && c < cols;
      fp32::cp_async_4(smem + r * kLd + c, valid ? gmem + r * ld + c : gmem, valid);
    }
  } else {
    // 2-byte elements have no cp.async size: plain loads for unaligned layouts.
    for (int idx = threadIdx.x; idx < kRows * kCols; idx += kThreads) {
      const int r = idx / kCols, c = idx % kCols;
      smem[r * kLd + c] = r < rows && c < cols ? gmem[r * ld + c] : T(0.0f);
    }
  }
}

template <class T>
__device__ __forceinline__ void store_pair(T* dst, float a, float b, bool second) {
  dst[0] = from_float<T>(a);
  if (second) dst[1] = from_float<T>(b);
}

template <class T, int kBlockD3, bool kExact>
__global__ void __launch_bounds__(SmmTile<T, kBlockD3, kExact>::kThreads, 1) softmax_matmul_kernel(const Params p) {
  using Tile = SmmTile<T, kBlockD3, kExact>;
  constexpr int kMT = Tile::kMTiles, kNT = Tile::kD3Tiles, kBN = Tile::kBlockN, kBM = Tile::kBlockM;
  constexpr int kKS = Tile::kKStep, kKT = kBN / kKS;  // k steps per stage
  constexpr int kE = Tile::kF32 ? 4 : 8;              // accumulator-layout elements per (m tile, k step)
  constexpr int kXLd = Tile::kXLd, kVLd = Tile::kVLd, kThreads = Tile::kThreads, kStages = Tile::kStages;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);

  const int band = blockIdx.x / p.d3_blocks, slice = blockIdx.x % p.d3_blocks, b = blockIdx.y;
  const int r0 = band * kBM, c0 = slice * kBlockD3;
  const T* x = static_cast<const T*>(p.x) + b * p.x_batch_stride + r0 * p.x_row_stride;
  const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + c0;
  T* out = static_cast<T*>(p.out) + b * p.out_batch_stride + r0 * p.out_row_stride + c0;
  const int rows = min(kBM, p.d1 - r0), cols = min(kBlockD3, p.d3 - c0);
  const int n_tiles = (p.d2 + kBN - 1) / kBN;

  auto load_stage = [&](int tile) {
    T* xs = smem + (tile % kStages) * Tile::kStageElems;
    T* vs = xs + kBM * kXLd;
    const int n0 = tile * kBN;
    load_tile<kBM, kBN, kXLd, kThreads>(xs, x + n0, p.x_row_stride, rows, p.d2 - n0, p.vec16);
    load_tile<kBN, kBlockD3, kVLd, kThreads>(vs, v + n0 * p.v_row_stride, p.v_row_stride, p.d2 - n0, cols, p.vec16);
  };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int wm0 = (warp % Tile::kWarpsM) * kMT * 16;
  const int wn0 = (warp / Tile::kWarpsM) * kNT * 8;

  // fp32 exact mode accumulates in fp64 over all of d2 and rounds once, in the epilogue.
  using Acc = std::conditional_t<Tile::kF32 && kExact, double, float>;
  Acc acc[kMT][kNT][4];
  float row_max[kMT][2], row_sum[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.0f;
    row_max[mt][0] = row_max[mt][1] = -INFINITY;
    row_sum[mt][0] = row_sum[mt][1] = 0.0f;
  }

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_tiles) load_stage(s);
    cp_async_commit();
  }

  for (int tile = 0; tile < n_tiles; ++tile) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // this stage visible; the stage refilled below was consumed last step
    if (tile + kStages - 1 < n_tiles) load_stage(tile + kStages - 1);
    cp_async_commit();

    const T* xs = smem + (tile % kStages) * Tile::kStageElems;
    const T* vs = xs + kBM * kXLd;
    const int n0 = tile * kBN;

    // Scores in the accumulator layout; columns past d2 (last tile only) are masked. They stay
    // in the natural domain: log2(e) is folded into the exponent's FMA.
    // Element e of (mt, kt): row g + 8 * ((e / 2) % 2), column 2t + (e % 2) + 8 * (e / 4).
    float sc[kMT][kKT][kE];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int kt = 0; kt < kKT; ++kt) {
        const int r = wm0 + mt * 16 + g, c = kt * kKS + 2 * t;
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          if constexpr (Tile::kF32) {
            const float2 u = *reinterpret_cast<const float2*>(&xs[(r + 8 * hf) * kXLd + c]);
            sc[mt][kt][2 * hf] = u.x, sc[mt][kt][2 * hf + 1] = u.y;
          } else {
#pragma unroll
            for (int q = 0; q < 2; ++q) {
              const float2 u = unpack2<T>(*reinterpret_cast<const uint32_t*>(&xs[(r + 8 * hf) * kXLd + c + 8 * q]));
              sc[mt][kt][4 * q + 2 * hf] = u.x, sc[mt][kt][4 * q + 2 * hf + 1] = u.y;
            }
          }
        }
        if (n0 + kBN > p.d2) {
#pragma unroll
          for (int e = 0; e < kE; ++e)
            if (n0 + c + (e % 2) + 8 * (e / 4) >= p.d2) sc[mt][kt][e] = -INFINITY;
        }
      }

    // Online softmax; a row lives in the 4 lanes of a quad. Accumulators are rescaled only
    // when some row of the warp raised its max: after the first tiles that is rare.
    bool moved = false;
    float factor[kMT][2];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float mx = -INFINITY;
#pragma unroll
        for (int kt = 0; kt < kKT; ++kt)
#pragma unroll
          for (int e = 0; e < kE; ++e)
            if ((e / 2) % 2 == hf) mx = fmaxf(mx, sc[mt][kt][e]);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        mx = fmaxf(row_max[mt][hf], mx * kLog2e);  // row_max is in the log2 domain
        factor[mt][hf] = rescale_factor(row_max[mt][hf], mx);
        moved |= mx != row_max[mt][hf];
        row_max[mt][hf] = mx;
        const float base = safe_row_max(mx);
        float sum = 0.0f;
#pragma unroll
        for (int kt = 0; kt < kKT; ++kt)
#pragma unroll
          for (int e = 0; e < kE; ++e)
            if ((e / 2) % 2 == hf) {
              const float arg = fmaf(sc[mt][kt][e], kLog2e, -base);
              const float pe = Tile::kF32 && kExact ? exp2f(arg) : exp2_fast(arg);
              sc[mt][kt][e] = pe;
              sum += pe;
            }
        row_sum[mt][hf] = row_sum[mt][hf] * factor[mt][hf] + sum;
      }
    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mt][nt][e] *= factor[mt][e / 2];
    }

    // out += P V
#pragma unroll
    for (int kt = 0; kt < kKT; ++kt) {
      if constexpr (Tile::kF32 && kExact) {
        double pd[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
          pd[mt][0] = sc[mt][kt][0], pd[mt][1] = sc[mt][kt][2], pd[mt][2] = sc[mt][kt][1], pd[mt][3] = sc[mt][kt][3];
        const float* vrow = vs + (kt * 8 + 2 * t) * kVLd + wn0 + g;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          const double vb[2] = {vrow[nt * 8], vrow[kVLd + nt * 8]};
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) fp32::mma_16x8x8_f64(acc[mt][nt], pd[mt], vb);
        }
      } else if constexpr (Tile::kF32) {
        uint32_t a[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          a[mt][0] = fp32::to_tf32(sc[mt][kt][0]), a[mt][1] = fp32::to_tf32(sc[mt][kt][2]);
          a[mt][2] = fp32::to_tf32(sc[mt][kt][1]), a[mt][3] = fp32::to_tf32(sc[mt][kt][3]);
        }
        const float* vrow = vs + (kt * 8 + 2 * t) * kVLd + wn0 + g;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          // V goes in as fp32 bits (the tensor core truncates to TF32): a rounding per element
          // per warp would cost as many instructions as the products.
          const uint32_t vb[2] = {__float_as_uint(vrow[nt * 8]), __float_as_uint(vrow[kVLd + nt * 8])};
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) fp32::mma_16x8x8_tf32(acc[mt][nt], a[mt], vb);
        }
      } else {
        uint32_t a[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int q = 0; q < 4; ++q) a[mt][q] = pack2<T>(sc[mt][kt][2 * q], sc[mt][kt][2 * q + 1]);
        // ldmatrix.trans: matrix i of 4 covers keys +8*(i%2) and columns +8*(i/2).
        const int mi = lane / 8;
        const T* vrow = vs + (kt * 16 + (mi % 2) * 8 + lane % 8) * kVLd + wn0 + (mi / 2) * 8;
#pragma unroll
        for (int nt = 0; nt < kNT; nt += 2) {
          uint32_t bfr[4];
          ldmatrix_x4_trans(bfr, smem_address(vrow + nt * 8));
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            mma_m16n8k16<T>(acc[mt][nt], a[mt], bfr[0], bfr[1]);
            mma_m16n8k16<T>(acc[mt][nt + 1], a[mt], bfr[2], bfr[3]);
          }
        }
      }
    }
  }
  cp_async_wait<0>();

#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float sum = row_sum[mt][hf];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const float inv = inverse_row_sum(sum);
      const int r = wm0 + mt * 16 + g + 8 * hf;
      if (r >= rows) continue;
      T* orow = out + int64_t(r) * p.out_row_stride;
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        const int c = wn0 + nt * 8 + 2 * t;
        if (c < cols)
          store_pair<T>(orow + c, float(acc[mt][nt][2 * hf] * inv), float(acc[mt][nt][2 * hf + 1] * inv), c + 1 < cols);
      }
    }
}

}  // namespace tileattn::cuda::smm
