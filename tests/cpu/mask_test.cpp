// The shared Mask (src/common/mask.hpp) against the flash-attn visibility rule written out
// directly, including the tile ranges the tiled paths rely on to skip and to skip masking.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "common/mask.hpp"
#include "support/host_problem.hpp"

namespace tileattn {
namespace {

bool rule(int i, int j, int sq, int sk, int left, int right) {
  const int diag = i + sk - sq;
  if (j < 0 || j >= sk) return false;
  if (left >= 0 && j < diag - left) return false;
  if (right >= 0 && j > diag + right) return false;
  return true;
}

TEST(Mask, MatchesRuleAndTileRangesAreTight) {
  std::mt19937 rng(test::fresh_seed() & 0xffffffffu);
  SCOPED_TRACE("seed via TILEATTN_TEST_SEED");
  for (int trial = 0; trial < 400; ++trial) {
    const int sq = 1 + int(rng() % 40), sk = 1 + int(rng() % 40);
    const int left = int(rng() % 50) - 1, right = int(rng() % 50) - 1;
    const Mask m{sq, sk, left, right};
    SCOPED_TRACE(testing::Message() << "sq=" << sq << " sk=" << sk << " left=" << left << " right=" << right);
    for (int i = 0; i < sq; ++i)
      for (int j = 0; j < sk; ++j) ASSERT_EQ(m.visible(i, j), rule(i, j, sq, sk, left, right)) << i << " " << j;
    // Query tiles: every visible key lies in [tile_begin_key, tile_end_key); every key in
    // [full_begin_key, full_end_key) is visible to every row of the tile.
    for (int i0 = 0; i0 < sq; ++i0)
      for (int i1 = i0 + 1; i1 <= sq; ++i1) {
        for (int i = i0; i < i1; ++i)
          for (int j = 0; j < sk; ++j) {
            if (rule(i, j, sq, sk, left, right)) {
              ASSERT_GE(j, m.tile_begin_key(i0));
              ASSERT_LT(j, m.tile_end_key(i1));
            }
            if (j >= m.full_begin_key(i1) && j < m.full_end_key(i0)) {
              ASSERT_TRUE(rule(i, j, sq, sk, left, right));
            }
          }
      }
    // Key tiles: every query that sees a key of [j0, j1) lies in [tile_begin_query, tile_end_query).
    for (int j0 = 0; j0 < sk; ++j0)
      for (int j1 = j0 + 1; j1 <= sk; ++j1)
        for (int i = 0; i < sq; ++i)
          for (int j = j0; j < j1; ++j)
            if (rule(i, j, sq, sk, left, right)) {
              ASSERT_GE(i, m.tile_begin_query(j0));
              ASSERT_LT(i, m.tile_end_query(j1));
            }
  }
}

// visible_keys counts each row's keys by the rule, and fewest_visible_keys of every row range is the
// least of those counts (the Hopper exact backward picks each tile's statistics by it).
TEST(Mask, FewestVisibleKeysIsTheLeastOverTheRows) {
  std::mt19937 rng(test::fresh_seed() & 0xffffffffu);
  SCOPED_TRACE("seed via TILEATTN_TEST_SEED");
  for (int trial = 0; trial < 400; ++trial) {
    const int sq = 1 + int(rng() % 60), sk = 1 + int(rng() % 60);
    const int left = int(rng() % 70) - 1, right = int(rng() % 70) - 1;
    const Mask m{sq, sk, left, right};
    SCOPED_TRACE(testing::Message() << "sq=" << sq << " sk=" << sk << " left=" << left << " right=" << right);
    std::vector<int> count(size_t(sq), 0);
    for (int i = 0; i < sq; ++i) {
      for (int j = 0; j < sk; ++j) count[size_t(i)] += rule(i, j, sq, sk, left, right);
      ASSERT_EQ(m.visible_keys(i), count[size_t(i)]) << "row " << i;
    }
    for (int i0 = 0; i0 < sq; ++i0)
      for (int i1 = i0 + 1; i1 <= sq; ++i1)
        ASSERT_EQ(m.fewest_visible_keys(i0, i1), *std::min_element(count.begin() + i0, count.begin() + i1))
            << "rows [" << i0 << ", " << i1 << ")";
  }
}

}  // namespace
}  // namespace tileattn
