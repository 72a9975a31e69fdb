#pragma once
// Tile sizes of the backward kernels, decided here and nowhere else.
//
// dK/dV kernel: a block owns kBlockN keys of one (batch, kv head) and walks query tiles of
// kBlockM rows. Its live registers are the dK and dV accumulators (kBlockN x D each, spread over
// the block), so kBlockN shrinks as D grows: 128 keys up to D = 128, 64 beyond. Up to D = 64 the
// accumulators leave room for 128-row query tiles: half the barriers and per-tile overhead per
// FLOP, and twice the independent mma per k-step in the S^T and dP^T products.
// dQ kernel (deterministic pass): a block owns kBlockM queries and walks key tiles of kBlockN.
// fp32 tiles are half as long on one side (the same shared memory holds half the values), except
// that up to D = 128 the query tiles of the dK/dV kernel and the key tiles of the dQ pass (and of
// the fp32 row statistics) stay 64 long: the fp32 tensor-core products read every operand from
// shared memory, and 64 x 64 products give each warp a 32 x 16 tile, a third fewer operand loads
// per product than a 16 x 16 one.
// The streamed tiles (Q/dO, resp. K/V) get a second buffer where the device's shared memory
// holds it (chosen at launch: smem_bytes(2) against the opt-in limit).
#include "cuda/arch/warp_mma_sm80.cuh"

namespace tileattn::cuda::bwd {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;

// A grid of warps over an M x N product: WM warps down, kWarps / WM across, each warp tile 16k
// rows by gn*k columns (16-bit tensor cores read B 16 columns at a time, fp32 ones 8);
// among those, the one reading the fewest operand rows per step.
struct WarpGrid {
  int wm, wn, tm, tn;  // warps down/across, warp tile rows/columns
};
constexpr WarpGrid warp_grid(int m, int n, int gn) {
  WarpGrid best{0, 0, 0, 0};
  for (int wm = 1; wm <= kWarps; wm *= 2) {
    const int wn = kWarps / wm;
    if (m % (16 * wm) != 0 || n % (gn * wn) != 0) continue;
    const WarpGrid g{wm, wn, m / wm, n / wn};
    if (best.wm == 0 || g.tm + g.tn < best.tm + best.tn) best = g;
  }
  return best;
}

// Row padding of shared tiles: 16 bytes keeps ldmatrix's eight row reads on distinct banks and
// keeps every row 16-byte aligned for cp.async.
template <class T>
constexpr int kPad = 16 / int(sizeof(T));
template <class T>
constexpr int kGranN = sizeof(T) == 2 ? 16 : 8;

template <class T, int D>
struct DkdvTile {
  static constexpr int kBlockN = (sizeof(T) == 2 ? (D <= 128 ? 128 : 64) : (D <= 64 ? 64 : 32));
  static constexpr int kBlockM = (sizeof(T) == 2 ? (D <= 64 ? 128 : 64) : (D <= 128 ? 64 : 32));
  static constexpr int kLd = D + kPad<T>;                                     // K, V, Q, dO rows
  static constexpr int kLdP = kBlockM + kPad<T>;                              // P^T, dS^T rows (one per key)
  static constexpr WarpGrid kGridS = warp_grid(kBlockN, kBlockM, kGranN<T>);  // S^T, dP^T
  static constexpr WarpGrid kGridKV = warp_grid(kBlockN, D, kGranN<T>);       // dK, dV
  static constexpr WarpGrid kGridQ = warp_grid(kBlockM, D, kGranN<T>);        // dQ partial
  // K, V, P^T, dS^T, then 1 or 2 stages of (Q, dO, L, D, row sum).
  static constexpr int kFixedBytes = (2 * kBlockN * kLd + 2 * kBlockN * kLdP) * int(sizeof(T));
  static constexpr int kStageBytes = 2 * kBlockM * kLd * int(sizeof(T)) + 3 * kBlockM * int(sizeof(float));
  static constexpr int smem_bytes(int stages) { return kFixedBytes + stages * kStageBytes; }
  static_assert(kGridS.wm && kGridKV.wm && kGridQ.wm, "no warp grid fits these tiles");
};

template <class T, int D>
struct DqTile {
  static constexpr int kBlockM = (sizeof(T) == 2 ? (D <= 128 ? 128 : 64) : (D <= 64 ? 64 : 32));
  static constexpr int kBlockN = (sizeof(T) == 2 || D <= 128 ? 64 : 32);
  static constexpr int kLd = D + kPad<T>;
  static constexpr int kLdS = kBlockN + kPad<T>;
  static constexpr WarpGrid kGridS = warp_grid(kBlockM, kBlockN, kGranN<T>);  // S, dP
  static constexpr WarpGrid kGridQ = warp_grid(kBlockM, D, kGranN<T>);        // dQ
  // Q, dO, dS, (L, D, row sum), then 1 or 2 stages of (K, V).
  static constexpr int kFixedBytes =
      (2 * kBlockM * kLd + kBlockM * kLdS) * int(sizeof(T)) + 3 * kBlockM * int(sizeof(float));
  static constexpr int kStageBytes = 2 * kBlockN * kLd * int(sizeof(T));
  static constexpr int smem_bytes(int stages) { return kFixedBytes + stages * kStageBytes; }
  static_assert(kGridS.wm && kGridQ.wm, "no warp grid fits these tiles");
};

}  // namespace tileattn::cuda::bwd
