// The persistent Hopper kernels' unit arithmetic (cuda/common/tile_pairs.hpp): every tile of a
// head in exactly one unit, the heavier first, paired units of equal work, and a walk's units
// stepped as digits landing where dividing their numbers would.
#include <gtest/gtest.h>

#include <vector>

#include "cuda/common/tile_pairs.hpp"

namespace {

using tileattn::cuda::TilePairs;
using tileattn::cuda::UnitDigits;

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

TEST(UnitDigits, SteppedWalkMatchesDividedUnitNumbers) {
  // Every block's walk a grid apart, digits carried by adds, against each unit number divided out;
  // grids below, at and above a head's and a batch entry's units (carries in one or both digits).
  for (int per_head : {1, 2, 3, 4, 7, 8, 33})
    for (int heads : {1, 2, 3, 16, 32})
      for (int grid : {1, 5, 66, 132, 133, 264}) {
        const int count = per_head * heads * 5;
        const UnitDigits step = UnitDigits::of(grid, per_head, heads);
        std::vector<int> seen(size_t(count), 0);
        for (int block = 0; block < grid && block < count; ++block) {
          UnitDigits at = UnitDigits::of(block, per_head, heads);
          for (int unit = block; unit < count; unit += grid) {
            const UnitDigits want = UnitDigits::of(unit, per_head, heads);
            ASSERT_EQ(at.i, want.i) << per_head << " " << heads << " grid " << grid << " unit " << unit;
            ASSERT_EQ(at.head, want.head) << per_head << " " << heads << " grid " << grid << " unit " << unit;
            ASSERT_EQ(at.batch, want.batch) << per_head << " " << heads << " grid " << grid << " unit " << unit;
            ASSERT_EQ((at.batch * heads + at.head) * per_head + at.i, unit);
            ++seen[size_t(unit)];
            at.add(step, per_head, heads);
          }
        }
        for (int u = 0; u < count; ++u) ASSERT_EQ(seen[size_t(u)], 1) << "unit " << u;
      }
}

}  // namespace
