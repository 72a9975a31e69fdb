// AttentionProblem::partial_keys: a backward option (O and L of more keys than the call's), so the
// forward refuses it with a message naming it; the backward takes it with every other option.
#include <gtest/gtest.h>

#include "host/valid_problems.hpp"
#include "host/validate.hpp"

namespace tileattn::test {
namespace {

using host::Pass;
using host::validate_attention;

TEST(ValidatePartialKeys, ForwardRefusesIt) {
  ValidAttention a;
  a.p.partial_keys = true;
  expect_error([&] { validate_attention(a.p, Pass::forward, Backend::cpu); }, ErrorKind::invalid_argument,
               {"partial_keys is a backward option", "pass partial_keys=false to forward"});
}

TEST(ValidatePartialKeys, BackwardTakesItAndKeepsIt) {
  ValidAttention a;
  a.p.partial_keys = true;
  a.p.causal = true;
  a.p.softcap = 3.0f;
  a.p.deterministic = true;
  const AttentionProblem n = validate_attention(a.p, Pass::backward, Backend::cpu);
  EXPECT_TRUE(n.partial_keys);
  a.p.partial_keys = false;
  EXPECT_FALSE(validate_attention(a.p, Pass::backward, Backend::cpu).partial_keys);
}

}  // namespace
}  // namespace tileattn::test
