// tileattn-bench's flag rules: every bad value is refused with a message naming the flag and the
// rule, before anything runs; explicit values are never replaced by defaults.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "options.hpp"

namespace tileattn::bench {
namespace {

Options parse(std::vector<std::string> args) {
  args.insert(args.begin(), "tileattn-bench");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  return parse_options(int(argv.size()), argv.data());
}

// The message of the std::invalid_argument that parsing `args` throws; fails the test if none.
std::string refusal(std::vector<std::string> args) {
  try {
    parse(args);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  ADD_FAILURE() << "accepted";
  return "";
}

TEST(BenchOptions, SizesMustBePositive) {
  for (const char* flag : {"--batch", "--seqlen", "--seqlen-q", "--seqlen-k", "--heads", "--heads-kv", "--headdim",
                           "--headdim-v", "--d1", "--d2", "--d3"}) {
    EXPECT_EQ(refusal({flag, "0"}), std::string(flag) + " 0: must be >= 1 (sizes are 1 ... 2147483647)");
    EXPECT_EQ(refusal({flag, "-5"}), std::string(flag) + " -5: must be >= 1 (sizes are 1 ... 2147483647)");
    EXPECT_EQ(refusal({flag, "2147483648"}),
              std::string(flag) + " 2147483648: must be <= 2147483647 (sizes are 1 ... 2147483647)");
  }
}

TEST(BenchOptions, ExplicitHeadsKvAndHeaddimVAreKept) {
  const Options o = parse({"--heads", "8", "--heads-kv", "2", "--headdim", "64", "--headdim-v", "32"});
  EXPECT_EQ(o.heads_kv, 2);
  EXPECT_EQ(o.headdim_v, 32);
  const Options max = parse({"--seqlen", "2147483647"});
  EXPECT_EQ(max.seqlen_q, 2147483647);
  EXPECT_EQ(max.seqlen_k, 2147483647);
}

TEST(BenchOptions, MissingValueIsNotTakenFromTheNextFlag) {
  EXPECT_EQ(refusal({"--csv", "--causal"}), "--csv needs a value, but the next argument is --causal");
  EXPECT_EQ(refusal({"--seqlen", "--heads", "4"}), "--seqlen needs a value, but the next argument is --heads");
  EXPECT_EQ(refusal({"--causal", "--dtype"}), "--dtype needs a value");
  // A negative number is a value, not a flag.
  EXPECT_EQ(parse({"--window", "-1,4"}).window_right, 4);
}

TEST(BenchOptions, SwitchesTakeNoValue) {
  EXPECT_EQ(refusal({"--causal=1"}), "--causal takes no value (got '1')");
  EXPECT_EQ(refusal({"--deterministic=no"}), "--deterministic takes no value (got 'no')");
}

TEST(BenchOptions, NumbersOutOfRange) {
  EXPECT_EQ(refusal({"--scale", "0"}), "--scale 0: must be finite and > 0");
  EXPECT_EQ(refusal({"--scale", "nan"}), "--scale nan: must be finite and > 0");
  EXPECT_EQ(refusal({"--scale", "1e40"}), "--scale 1e40: outside float32's normal range");
  EXPECT_EQ(refusal({"--softcap", "-1"}), "--softcap -1: must be finite and >= 0");
  EXPECT_EQ(parse({"--softcap", "0"}).softcap, 0.0f);
  EXPECT_EQ(refusal({"--window", "-2,0"}), "--window (left) -2: must be >= -1 (-1 = unbounded)");
  EXPECT_EQ(refusal({"--window", "3"}), "--window 3: takes L,R (two integers, -1 = unbounded)");
  EXPECT_EQ(refusal({"--iters", "0"}), "--iters 0: must be >= 1");
  EXPECT_EQ(refusal({"--iters", "4294967297"}), "--iters 4294967297: must be <= 2147483647");
  EXPECT_EQ(refusal({"--warmup", "-1"}), "--warmup -1: must be >= 0");
  EXPECT_EQ(refusal({"--threads", "-2"}), "--threads -2: must be >= 0 (0 = all hardware threads)");
  EXPECT_EQ(refusal({"--seqlen", "99999999999999999999"}),
            "--seqlen 99999999999999999999: out of the range of a 64-bit integer");
  EXPECT_EQ(refusal({"--seqlen", "12x"}), "--seqlen: '12x' is not an integer");
  EXPECT_EQ(refusal({"--progress", "-1"}), "--progress -1: must be finite and >= 0 (seconds; 0 = never)");
}

TEST(BenchOptions, SweepValuesAreCheckedUpFront) {
  EXPECT_EQ(refusal({"--sweep", "seqlen=64,-5"}), "--sweep seqlen=-5: must be >= 1 (sizes are 1 ... 2147483647)");
  EXPECT_EQ(refusal({"--sweep", "heads-kv=0"}), "--sweep heads-kv=0: must be >= 1 (sizes are 1 ... 2147483647)");
  EXPECT_EQ(refusal({"--sweep", "color=1"}), "--sweep: unknown key 'color' (see --help)");
  EXPECT_EQ(refusal({"--sweep", "seqlen"}), "--sweep seqlen: takes KEY=V1,V2,...");
  const Options o = parse({"--sweep", "headdim-v=16,32"});
  EXPECT_EQ(o.sweep_values, (std::vector<int64_t>{16, 32}));
  Options point = o;
  apply_sweep_value(point, "seqlen", 77);
  EXPECT_EQ(point.seqlen_q, 77);
  EXPECT_EQ(point.seqlen_k, 77);
  apply_sweep_value(point, "headdim-v", 16);
  EXPECT_EQ(point.headdim_v, 16);
}

TEST(BenchOptions, UnknownFlag) { EXPECT_EQ(refusal({"--seqlenq", "4"}), "unknown flag '--seqlenq' (try --help)"); }

}  // namespace
}  // namespace tileattn::bench
