#pragma once
// Attention dropout's random numbers: Philox4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel random
// numbers: as easy as 1, 2, 3", SC 2011), a counter-based generator. Every keep/drop decision is a
// pure function of (seed, offset) and the element's coordinates, so the forward and the backward
// (which never stores the mask) draw the same mask, and any backend -- the CPU tiles, the float64
// oracle, a GPU kernel's fragments -- reproduces it bit for bit whatever its tiling.
//
// The mask rule (what a kernel must reproduce exactly):
//   key      k0 = lo32(seed), k1 = hi32(seed)
//   counter  c0 = uint32(col >> 2)                       col: key position in its sequence (0-based)
//            c1 = uint32(row)                            row: query position in its sequence (0-based)
//            c2 = lo32(n), c3 = hi32(n),  n = offset + (batch * heads + head)   (uint64, wrapping)
//   r = philox4x32_10(counter, key), four uint32 words r[0..3];  u = r[col & 3]
//   the element is dropped iff u < threshold, threshold = floor(dropout_p * 2^32) (dropout_p < 1)
// batch is the sequence index (varlen included), head the query head (GQA: not the kv head), heads
// the problem's heads_q; positions count from 0 within each sequence (after leftpad_k for keys), so
// a mask does not depend on layout, packing or paging. One Philox call covers four neighbouring
// keys of one row. Streams of different (batch, head) pairs are disjoint counter ranges; a caller
// that reuses a seed must advance offset by at least batch * heads between calls (the Python layer
// draws a fresh random seed and offset per call).
#include <cstdint>

#include "common/host_device.hpp"

namespace tileattn {

struct Philox4 {
  uint32_t x, y, z, w;
};

// The published constants: round multipliers and the Weyl key increments (golden ratio, sqrt 3 - 1).
constexpr uint32_t kPhiloxM0 = 0xD2511F53u, kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u, kPhiloxW1 = 0xBB67AE85u;

TA_HOST_DEVICE Philox4 philox4x32_10(Philox4 c, uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) k0 += kPhiloxW0, k1 += kPhiloxW1;
    const uint64_t p0 = uint64_t(kPhiloxM0) * c.x, p1 = uint64_t(kPhiloxM1) * c.z;
    c = Philox4{uint32_t(p1 >> 32) ^ c.y ^ k0, uint32_t(p1), uint32_t(p0 >> 32) ^ c.w ^ k1, uint32_t(p0)};
  }
  return c;
}

// The four draws of keys (col & ~3) .. (col | 3) of one row (the rule above).
TA_HOST_DEVICE Philox4 dropout_draws(uint64_t seed, uint64_t offset, int64_t batch, int64_t head, int64_t heads,
                                     int64_t row, int64_t col) {
  const uint64_t n = offset + uint64_t(batch * heads + head);
  return philox4x32_10(Philox4{uint32_t(uint64_t(col) >> 2), uint32_t(row), uint32_t(n), uint32_t(n >> 32)},
                       uint32_t(seed), uint32_t(seed >> 32));
}

TA_HOST_DEVICE uint32_t dropout_word(const Philox4& r, int64_t col) {
  switch (col & 3) {
    case 0: return r.x;
    case 1: return r.y;
    case 2: return r.z;
    default: return r.w;
  }
}

// Whether element (row, col) of (batch, head) is kept.
TA_HOST_DEVICE bool dropout_keep(uint64_t seed, uint64_t offset, int64_t batch, int64_t head, int64_t heads,
                                 int64_t row, int64_t col, uint32_t threshold) {
  return dropout_word(dropout_draws(seed, offset, batch, head, heads, row, col), col) >= threshold;
}

// floor(p * 2^32) for 0 <= p < 1: the drop probability is p rounded down to a multiple of 2^-32
// (flash-attn rounds it to a multiple of 1/255). Computed in double, where the product is exact.
inline uint32_t dropout_threshold(float p) {
  const double t = double(p) * 4294967296.0;
  return t <= 0.0 ? 0u : t >= 4294967295.0 ? 4294967295u : uint32_t(t);
}

// One problem's dropout, prepared once on the host from a validated problem (p < 1).
struct Dropout {
  bool on = false;           // dropout_p > 0
  uint64_t seed = 0, offset = 0;
  // {seed, offset} read when the mask is drawn, in place of the two fields above (null: use them).
  // A CUDA graph replays the kernels with the values in memory at replay, so a capture can draw a
  // fresh seed per replay; the backend's memory (device for CUDA, host for the CPU backend).
  const uint64_t* state = nullptr;
  int64_t heads = 1;         // heads_q: the (batch, head) stream index is batch * heads + head
  uint32_t threshold = 0;    // dropped iff the draw < threshold
  float scale = 1.0f;        // 1 / (1 - p), applied to the kept weights

  TA_HOST_DEVICE uint64_t seed_now() const { return state == nullptr ? seed : load(state); }
  TA_HOST_DEVICE uint64_t offset_now() const { return state == nullptr ? offset : load(state + 1); }
  TA_HOST_DEVICE Philox4 draws(int64_t batch, int64_t head, int64_t row, int64_t col) const {
    return dropout_draws(seed_now(), offset_now(), batch, head, heads, row, col);
  }
  TA_HOST_DEVICE bool keep(int64_t batch, int64_t head, int64_t row, int64_t col) const {
    return dropout_word(draws(batch, head, row, col), col) >= threshold;
  }
  // This dropout with the pair read now. A kernel resolves it where a tile's mask is drawn, so the
  // pair's registers live only there (held across a whole kernel, they cost the portable
  // backward, already at its register cap, spills even in calls without dropout).
  TA_HOST_DEVICE Dropout resolved() const {
    Dropout d = *this;
    d.seed = seed_now(), d.offset = offset_now(), d.state = nullptr;
    return d;
  }

 private:
  // Read-only for the whole kernel (the non-coherent path).
  TA_HOST_DEVICE static uint64_t load(const uint64_t* x) {
#ifdef __CUDA_ARCH__
    return __ldg(reinterpret_cast<const unsigned long long*>(x));
#else
    return *x;
#endif
  }
};

// state: see Dropout::state (null: seed and offset as given).
inline Dropout make_dropout(float p, uint64_t seed, uint64_t offset, int64_t heads_q,
                            const uint64_t* state = nullptr) {
  Dropout d;
  d.on = p > 0.0f;
  if (!d.on) return d;
  d.seed = seed, d.offset = offset, d.heads = heads_q, d.state = state;
  d.threshold = dropout_threshold(p);
  d.scale = float(1.0 / (1.0 - double(p)));
  return d;
}

}  // namespace tileattn
