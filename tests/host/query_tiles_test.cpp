// The backward's key-block/query-tile arithmetic (cuda/common/query_tiles.hpp): the count of key
// blocks that add into a query tile, which the Hopper backward counts down to find the block that
// writes the tile's dQ, equals the key blocks whose spans hold the tile, for every mask.
#include <gtest/gtest.h>

#include "cuda/common/query_tiles.hpp"

namespace {

using tileattn::Mask;
using tileattn::cuda::bwd::key_block_queries;
using tileattn::cuda::bwd::query_tile_key_blocks;
using tileattn::cuda::bwd::TileSpan;

// By enumeration: the key blocks whose span holds tile t.
int spans_holding(const Mask& m, int t, int block_n, int block_m) {
  int n = 0;
  for (int j = 0; j * block_n < m.seqlen_k; ++j) {
    const TileSpan s = key_block_queries(m, j, block_n, block_m);
    n += s.count > 0 && s.first <= t && t < s.first + s.count;
  }
  return n;
}

TEST(QueryTiles, KeyBlockCountMatchesTheSpansForEveryMask) {
  const int lengths[] = {0, 1, 63, 64, 65, 127, 128, 129, 200, 256, 300, 513};
  const int sides[] = {-1, 0, 1, 7, 64, 100, 129, 600};
  int nonzero = 0, zero = 0;
  for (int sq : lengths)
    for (int sk : lengths)
      for (int left : sides)
        for (int right : sides)
          for (int block_m : {64, 128})
            for (int block_n : {64, 128, 192}) {
              const Mask m{sq, sk, left, right};
              for (int t = 0; t * block_m < sq + block_m; ++t) {
                const int want = spans_holding(m, t, block_n, block_m);
                ASSERT_EQ(query_tile_key_blocks(m, t, block_n, block_m), want)
                    << "sq " << sq << " sk " << sk << " left " << left << " right " << right << " tile " << t
                    << " block_m " << block_m << " block_n " << block_n;
                (want > 0 ? nonzero : zero) += 1;
              }
            }
  // Both kinds of tile occur: masks that hide a tile from every key, and tiles many blocks add into.
  EXPECT_GT(zero, 1000);
  EXPECT_GT(nonzero, 1000);
}

TEST(QueryTiles, UnmaskedTilesCountEveryKeyBlock) {
  const Mask m{1024, 1000, -1, -1};
  for (int t = 0; t < 8; ++t) EXPECT_EQ(query_tile_key_blocks(m, t, 128, 128), 8);
  EXPECT_EQ(query_tile_key_blocks(m, 8, 128, 128), 0);  // past the queries
}

TEST(QueryTiles, CausalTilesCountTheBlocksUpToTheirDiagonal) {
  // seqlen_q == seqlen_k: tile t of 64 rows sees keys up to 64 t + 63, the key blocks 0..(64 t + 63) / 128.
  const Mask m{1024, 1024, -1, 0};
  for (int t = 0; t < 16; ++t) EXPECT_EQ(query_tile_key_blocks(m, t, 128, 64), (64 * t + 63) / 128 + 1) << t;
  // More queries than keys (bottom-right aligned): the first 512 rows see no key.
  const Mask tall{1536, 1024, -1, 0};
  for (int t = 0; t < 8; ++t) EXPECT_EQ(query_tile_key_blocks(tall, t, 128, 64), 0) << t;
  EXPECT_EQ(query_tile_key_blocks(tall, 8, 128, 64), 1);
}

}  // namespace
