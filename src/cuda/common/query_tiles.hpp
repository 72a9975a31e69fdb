#pragma once
// Which query tiles a block of keys works on in the backward, and, turned around, how many key
// blocks work on one query tile: the Hopper backward's fused dQ counts a tile's additions down
// from that number, and the block that adds last turns the tile into dQ.
#include "common/host_device.hpp"
#include "common/mask.hpp"

namespace tileattn::cuda::bwd {

// The tiles of `width` rows that cover [begin, end): the first one's index and how many
// (none when the mask leaves the range empty).
struct TileSpan {
  int first, count;
};
TA_HOST_DEVICE TileSpan tile_span(int begin, int end, int width) {
  const int first = begin / width;
  return {first, end > begin ? (end + width - 1) / width - first : 0};
}

// The query tiles (block_m rows) that key block j (block_n keys) of one (sequence, head) sees.
TA_HOST_DEVICE TileSpan key_block_queries(const Mask& m, int j, int block_n, int block_m) {
  const int k0 = j * block_n, k1 = k0 + block_n < m.seqlen_k ? k0 + block_n : m.seqlen_k;
  return tile_span(m.tile_begin_query(k0), m.tile_end_query(k1), block_m);
}

// How many key blocks' spans (key_block_queries) hold query tile t. Both ends of a span move
// forward with j, so the blocks holding t are a run: those whose span starts before the tile ends,
// less those whose span ends at or before the tile starts. Each count is a binary search over the
// key blocks. A span is empty only where the mask shows its keys to no query, and its ends then
// meet at 0 or at seqlen_q, which the two tests below leave out.
TA_HOST_DEVICE int query_tile_key_blocks(const Mask& m, int t, int block_n, int block_m) {
  const int blocks = (m.seqlen_k + block_n - 1) / block_n;
  const int tile_end = (t + 1) * block_m < m.seqlen_q ? (t + 1) * block_m : m.seqlen_q;
  // The first j in [0, blocks) where pred(j) fails, pred true on a prefix.
  auto prefix = [&](auto pred) {
    int lo = 0, hi = blocks;
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (pred(mid)) lo = mid + 1;
      else hi = mid;
    }
    return lo;
  };
  const int starts_before_end = prefix([&](int j) { return m.tile_begin_query(j * block_n) < tile_end; });
  const int ends_before_start = prefix([&](int j) {
    const int k1 = (j + 1) * block_n < m.seqlen_k ? (j + 1) * block_n : m.seqlen_k;
    return m.tile_end_query(k1) <= t * block_m;
  });
  return starts_before_end > ends_before_start ? starts_before_end - ends_before_start : 0;
}

}  // namespace tileattn::cuda::bwd
