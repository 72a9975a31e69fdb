// common/delta_rule.hpp: where every backward forms D from its own P and dP instead of
// rowsum(O * dO) (docs/accuracy.md).
#include <gtest/gtest.h>

#include "common/delta_rule.hpp"
#include "host/valid_problems.hpp"

namespace tileattn::test {
namespace {

TEST(DeltaRule, SmallHeaddimQkTakesDFromPAndDp) {
  EXPECT_TRUE(delta_from_p_and_dp(ValidAttention(1, 5, 7, 2, 2, 8, 64).p));
  EXPECT_TRUE(delta_from_p_and_dp(ValidAttention(1, 5, 7, 2, 2, 1, 256).p));
  EXPECT_FALSE(delta_from_p_and_dp(ValidAttention(1, 5, 7, 2, 2, 9, 64).p));
}

TEST(DeltaRule, KeysOrValuesRepeatedAlongTheSequence) {
  ValidAttention v(2, 5, 7, 2, 1, 64, 64);
  v.p.v.seq_stride = 0;
  EXPECT_TRUE(delta_from_p_and_dp(v.p));
  ValidAttention k(2, 5, 7, 2, 1, 64, 64);
  k.p.k.seq_stride = 0;
  EXPECT_TRUE(delta_from_p_and_dp(k.p));
  ValidAttention one_key(2, 5, 1, 2, 1, 64, 64);  // a single key repeats nothing
  one_key.p.v.seq_stride = 0;
  EXPECT_FALSE(delta_from_p_and_dp(one_key.p));
}

TEST(DeltaRule, NeverOverPartOfTheKeys) {
  ValidAttention a(1, 5, 7, 2, 2, 4, 64);
  a.p.partial_keys = true;
  EXPECT_FALSE(delta_from_p_and_dp(a.p));
}

}  // namespace
}  // namespace tileattn::test
