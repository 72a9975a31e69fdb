#pragma once
// Command-line options of tileattn-bench.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tileattn/problem.hpp"

namespace tileattn::bench {

enum class Op { attention, softmax_matmul };
enum class Layout { bshd, bhsd };

struct Options {
  Op op = Op::attention;

  // attention
  int64_t batch = 1;
  int64_t seqlen_q = 1024;
  int64_t seqlen_k = 1024;
  int64_t heads = 8;
  int64_t heads_kv = 0;  // 0: same as heads (the flags take only values >= 1)
  int64_t headdim = 64;
  int64_t headdim_v = 0;  // 0: same as headdim (the flags take only values >= 1)
  bool causal = false;
  int64_t window_left = -1, window_right = -1;
  float softcap = 0.0f;
  std::optional<float> scale;
  bool varlen = false;
  Layout layout = Layout::bshd;
  bool deterministic = false;
  bool run_forward = true, run_backward = true;

  // softmax_matmul
  int64_t d1 = 1024, d2 = 1024, d3 = 64;

  DType dtype = DType::f32;
  Fp32Mode fp32_mode = Fp32Mode::exact;
  Backend backend = Backend::automatic;
  std::string impl = "all";  // tileattn, naive or all
  int threads = 0;
  int warmup = -1, iters = -1;  // -1: backend defaults
  uint64_t seed = 1;
  bool check = false;
  std::string csv;
  double progress_s = 2.0;  // a run still going after this many seconds reports to stderr; 0: never

  // --sweep KEY=V1,V2,...: the problem is run once per value.
  std::string sweep_key;
  std::vector<int64_t> sweep_values;
};

// Parses argv; prints help and exits 0 on --help, throws std::invalid_argument on bad flags with a
// one-line message naming the flag and the rule it breaks. Every value is checked here, sweep
// values included, so that a bad flag fails before anything runs or prints.
Options parse_options(int argc, char** argv);

// Sets the option `key` (a --sweep key) to `value`; throws std::invalid_argument for an unknown
// key or a value outside the key's range.
void apply_sweep_value(Options& options, const std::string& key, int64_t value);

const char* dtype_name(DType dtype);
const char* layout_name(Layout layout);

}  // namespace tileattn::bench
