#pragma once
// How many blocks share the keys of one query tile (split-KV). Splitting pays only when the
// (batch x heads x query tiles) grid leaves SMs idle, e.g. decoding (seqlen_q 1..64) against a
// long cache; every split costs a partial O in fp32 and a combine pass.
#include <algorithm>
#include <cstdint>

namespace tileattn::cuda {

// The most splits a call may ask for (AttentionProblem::num_splits): bounds the partials'
// workspace and the combine's per-row weights.
constexpr int kMaxRequestedSplits = 256;

inline int fwd_num_splits(int64_t tiles, int key_blocks, int num_sms, int blocks_per_sm) {
  const int64_t capacity = int64_t(num_sms) * std::max(blocks_per_sm, 1);
  if (key_blocks < 2 || tiles >= capacity * 4 / 5) return 1;
  constexpr int kMaxSplits = 128;
  const int max_splits = std::min({kMaxSplits, key_blocks, int(capacity)});
  // Wave efficiency of s splits: the fraction of the last wave's slots that hold work.
  auto efficiency = [&](int s) {
    const int64_t work = tiles * s;
    const int64_t waves = (work + capacity - 1) / capacity;
    return double(work) / double(waves * capacity);
  };
  // Splits that give the same number of key blocks per split are the same work, only more combine.
  auto distinct = [&](int s) { return s == 1 || (key_blocks + s - 1) / s != (key_blocks + s - 2) / (s - 1); };
  double best = 0.0;
  for (int s = 1; s <= max_splits; ++s)
    if (distinct(s)) best = std::max(best, efficiency(s));
  // The fewest splits within 85% of the best efficiency: fewer splits, less combine traffic.
  for (int s = 1; s <= max_splits; ++s)
    if (distinct(s) && efficiency(s) >= 0.85 * best) return s;
  return 1;
}

// The decode kernel keeps its own K/V ring in flight, so one block per SM already draws full
// bandwidth from a contiguous cache; more splits only add partials and the combine (measured on an
// H100: 4 x 32 blocks beat 8 x 32, 16 x 8 beat 33 x 8). Split until the blocks about fill `slots`
// once (the SMs, times the blocks per SM the caller wants resident).
inline int decode_num_splits(int64_t tiles, int key_blocks, int slots) {
  constexpr int kMaxSplits = 128;
  if (tiles >= slots) return 1;
  const int splits = int(slots / std::max<int64_t>(tiles, 1));
  return std::max(1, std::min({splits, key_blocks, kMaxSplits}));
}

}  // namespace tileattn::cuda
