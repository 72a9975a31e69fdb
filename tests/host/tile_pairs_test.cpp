// The persistent Hopper kernels' unit arithmetic (cuda/common/tile_pairs.hpp): every tile of a
// head in exactly one unit, the heavier first, and paired units of equal work.
#include <gtest/gtest.h>

#include <vector>

#include "cuda/common/tile_pairs.hpp"

namespace {

using tileattn::cuda::TilePairs;

TEST(TilePairs, EveryTileInExactlyOneUnitHeavierFirst) {
  for (int tiles = 1; tiles <= 41; ++tiles)
    for (bool paired : {false, true}) {
      const TilePairs pairs(tiles, paired);
      std::vector<int> seen(size_t(tiles), 0);
      for (int i = 0; i < pairs.per_head; ++i) {
        const int n = pairs.count(i);
        ASSERT_TRUE(n == 1 || (paired && n == 2)) << "tiles " << tiles << " unit " << i;
        for (int half = 0; half < n; ++half) {
          const int r = pairs.rank(i, half);
          ASSERT_GE(r, 0);
          ASSERT_LT(r, tiles);
          ++seen[size_t(r)];
        }
        if (n == 2) EXPECT_LT(pairs.rank(i, 0), pairs.rank(i, 1)) << "tiles " << tiles << " unit " << i;
      }
      for (int r = 0; r < tiles; ++r) EXPECT_EQ(seen[size_t(r)], 1) << "tiles " << tiles << " rank " << r;
    }
}

TEST(TilePairs, PairedUnitsAreEqualWork) {
  // Work falling by one step per rank from the heaviest (a causal head's tiles): rank r costs
  // tiles - r, so a pair costs tiles + 1 and only an odd count's middle tile is alone.
  for (int tiles = 1; tiles <= 41; ++tiles) {
    const TilePairs pairs(tiles, true);
    EXPECT_EQ(pairs.per_head, (tiles + 1) / 2);
    int alone = 0;
    for (int i = 0; i < pairs.per_head; ++i) {
      if (pairs.count(i) == 1) {
        ++alone;
        EXPECT_EQ(2 * pairs.rank(i, 0) + 1, tiles) << "tiles " << tiles;
        continue;
      }
      EXPECT_EQ((tiles - pairs.rank(i, 0)) + (tiles - pairs.rank(i, 1)), tiles + 1) << "tiles " << tiles;
    }
    EXPECT_EQ(alone, tiles % 2) << "tiles " << tiles;
  }
}

}  // namespace
