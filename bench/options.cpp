#include "options.hpp"

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <stdexcept>

namespace tileattn::bench {
namespace {

constexpr const char* kHelp = R"(usage: tileattn-bench [flags]

Times tileattn forward and backward (or softmax(X)@V) on one problem, or on a sweep of
problems, and prints the median time, TFLOP/s and peak memory of each pass.

problem (attention; tensors are (batch, seqlen, heads, headdim)):
  --batch N            sequences (default 1)
  --seqlen N           sets --seqlen-q and --seqlen-k (default 1024)
  --seqlen-q N, --seqlen-k N
  --heads N            query heads (default 8)
  --heads-kv N         key/value heads, must divide --heads (default: --heads)
  --headdim N          Q/K head dim (default 64; the library takes 1 ... 256)
  --headdim-v N        V/O head dim (default: --headdim)
  Sizes (these, --batch, --seqlen* and --d1/2/3) are integers from 1 to 2147483647.
  --dtype f32|f16|bf16 (default f32)
  --causal             bottom-right aligned causal mask
  --window L,R         sliding window, each side >= 0, or -1 = unbounded side
  --softcap X          soft-capping of the scores, >= 0 (0 = off)
  --scale X            softmax scale, > 0 (default 1/sqrt(headdim))
  --varlen             variable-length batch: sequence lengths drawn in [N/2, N]
  --layout bshd|bhsd   memory layout (bhsd = PyTorch SDPA's), default bshd
  --deterministic      deterministic backward
  --pass fwd|bwd|both  (default both)
problem (softmax_matmul: softmax(X) @ V, X (batch, d1, d2), V (batch, d2, d3)):
  --op softmax_matmul  --d1 N --d2 N --d3 N (default 1024, 1024, 64; --batch applies)

run:
  --backend auto|cpu|cuda   auto: cuda when a device is present, else cpu
  --impl tileattn|naive|all naive: cuBLAS S=QK^T, softmax, O=PV (CUDA builds only); all runs
                            every implementation available on the backend (default)
  --fp32-mode exact|fast    fast: tensor-core products for fp32 inputs
  --threads N          CPU threads (default 0: all)
  --warmup N, --iters N     (default 1 and 10 on cpu, 5 and 20 on cuda)
  --seed N             input seed (default 1)
  --check              with several implementations, print the max difference of their outputs
  --csv FILE           append one row per measurement (header written when the file is new)
  --sweep KEY=V1,V2,.. run once per value; KEY: seqlen, seqlen-q, seqlen-k, batch, heads,
                       heads-kv, headdim, headdim-v, d1, d2, d3. Progress goes to stderr.
  --progress S         a run still going after S seconds prints a progress line to stderr,
                       then one every 5*S seconds (default 2; 0 = never)

Exit status: 0 when every run succeeded, 1 when one failed, 2 for a bad flag (one line on
stderr naming it). Nothing goes to stdout before the first result.

Time is the median over --iters runs. TFLOP/s counts 4*B*H*Nq*Nk*D for the forward (halved
when causal) and 2.5x that for the backward. Memory: host = the bench's tensors plus the peak
RSS growth during the timed runs; device = the bench's allocations (tensors and the workspace
it passes, so the library allocates nothing itself).
)";

int64_t parse_int(const std::string& flag, const std::string& text) {
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::out_of_range&) {
    throw std::invalid_argument(flag + " " + text + ": out of the range of a 64-bit integer");
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || text.empty()) throw std::invalid_argument(flag + ": '" + text + "' is not an integer");
  return v;
}

int64_t parse_int_in(const std::string& flag, const std::string& text, int64_t lo, int64_t hi, const char* why = "") {
  const int64_t v = parse_int(flag, text);
  if (v < lo) throw std::invalid_argument(flag + " " + text + ": must be >= " + std::to_string(lo) + why);
  if (v > hi) throw std::invalid_argument(flag + " " + text + ": must be <= " + std::to_string(hi) + why);
  return v;
}

// Sizes are int32 in the library (they index int32 offsets and grid coordinates), and an empty
// problem has nothing to time.
constexpr const char* kCountRule = " (sizes are 1 ... 2147483647)";
int64_t parse_count(const std::string& flag, const std::string& text) {
  return parse_int_in(flag, text, 1, INT32_MAX, kCountRule);
}

double parse_number(const std::string& flag, const std::string& text) {
  size_t used = 0;
  double v = 0.0;
  try {
    v = std::stod(text, &used);
  } catch (const std::out_of_range&) {
    throw std::invalid_argument(flag + " " + text + ": out of the range of a double");
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || text.empty()) throw std::invalid_argument(flag + ": '" + text + "' is not a number");
  return v;
}

// The library takes the scale and softcap as float: a value float cannot hold is refused here
// rather than turned into inf or 0.
float parse_float(const std::string& flag, const std::string& text, bool zero_allowed) {
  const double v = parse_number(flag, text);
  const char* rule = zero_allowed ? ": must be finite and >= 0" : ": must be finite and > 0";
  if (!std::isfinite(v) || v < 0.0 || (v == 0.0 && !zero_allowed)) throw std::invalid_argument(flag + " " + text + rule);
  if (v > double(std::numeric_limits<float>::max()) || (v > 0.0 && v < double(std::numeric_limits<float>::min()))) {
    throw std::invalid_argument(flag + " " + text + ": outside float32's normal range");
  }
  return float(v);
}

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> items;
  size_t start = 0;
  while (true) {
    const size_t comma = text.find(',', start);
    items.push_back(text.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) return items;
    start = comma + 1;
  }
}

DType parse_dtype(const std::string& text) {
  if (text == "f32" || text == "fp32" || text == "float32") return DType::f32;
  if (text == "f16" || text == "fp16" || text == "float16") return DType::f16;
  if (text == "bf16" || text == "bfloat16") return DType::bf16;
  throw std::invalid_argument("--dtype: '" + text + "' is not f32, f16 or bf16");
}

}  // namespace

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
  }
  return "?";
}

const char* layout_name(Layout layout) { return layout == Layout::bshd ? "bshd" : "bhsd"; }

void apply_sweep_value(Options& o, const std::string& key, int64_t value) {
  int64_t* field = nullptr;
  if (key == "seqlen" || key == "seqlen-q") field = &o.seqlen_q;
  else if (key == "seqlen-k") field = &o.seqlen_k;
  else if (key == "batch") field = &o.batch;
  else if (key == "heads") field = &o.heads;
  else if (key == "heads-kv") field = &o.heads_kv;
  else if (key == "headdim") field = &o.headdim;
  else if (key == "headdim-v") field = &o.headdim_v;
  else if (key == "d1") field = &o.d1;
  else if (key == "d2") field = &o.d2;
  else if (key == "d3") field = &o.d3;
  else throw std::invalid_argument("--sweep: unknown key '" + key + "' (see --help)");
  if (value < 1 || value > INT32_MAX) {
    throw std::invalid_argument("--sweep " + key + "=" + std::to_string(value) + ": must be " +
                                (value < 1 ? ">= 1" : "<= 2147483647") + kCountRule);
  }
  *field = value;
  if (key == "seqlen") o.seqlen_k = value;
}

Options parse_options(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    std::string value;
    bool has_value = false;
    if (const size_t eq = flag.find('='); flag.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
      has_value = true;
    }
    // No value starts with "--" (negative numbers have one dash), so a flag there means this
    // flag's value was left out; taking the flag as the value would silently drop it.
    auto next = [&]() -> std::string {
      if (has_value) return value;
      if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a value");
      const std::string v = argv[i + 1];
      if (v.rfind("--", 0) == 0) throw std::invalid_argument(flag + " needs a value, but the next argument is " + v);
      ++i;
      return v;
    };
    auto no_value = [&] {
      if (has_value) throw std::invalid_argument(flag + " takes no value (got '" + value + "')");
    };
    auto next_count = [&] { return parse_count(flag, next()); };

    if (flag == "--help" || flag == "-h") {
      no_value();
      std::fputs(kHelp, stdout);
      std::exit(0);
    } else if (flag == "--op") {
      const std::string v = next();
      if (v == "attention") o.op = Op::attention;
      else if (v == "softmax_matmul" || v == "softmax-matmul") o.op = Op::softmax_matmul;
      else throw std::invalid_argument("--op: '" + v + "' is not attention or softmax_matmul");
    } else if (flag == "--batch") {
      o.batch = next_count();
    } else if (flag == "--seqlen") {
      o.seqlen_q = o.seqlen_k = next_count();
    } else if (flag == "--seqlen-q") {
      o.seqlen_q = next_count();
    } else if (flag == "--seqlen-k") {
      o.seqlen_k = next_count();
    } else if (flag == "--heads") {
      o.heads = next_count();
    } else if (flag == "--heads-kv") {
      o.heads_kv = next_count();
    } else if (flag == "--headdim") {
      o.headdim = next_count();
    } else if (flag == "--headdim-v") {
      o.headdim_v = next_count();
    } else if (flag == "--dtype") {
      o.dtype = parse_dtype(next());
    } else if (flag == "--causal") {
      no_value();
      o.causal = true;
    } else if (flag == "--window") {
      const std::string v = next();
      const std::vector<std::string> w = split_list(v);
      if (w.size() != 2) throw std::invalid_argument("--window " + v + ": takes L,R (two integers, -1 = unbounded)");
      o.window_left = parse_int_in("--window (left)", w[0], -1, INT32_MAX, " (-1 = unbounded)");
      o.window_right = parse_int_in("--window (right)", w[1], -1, INT32_MAX, " (-1 = unbounded)");
    } else if (flag == "--softcap") {
      o.softcap = parse_float(flag, next(), /*zero_allowed=*/true);
    } else if (flag == "--scale") {
      o.scale = parse_float(flag, next(), /*zero_allowed=*/false);
    } else if (flag == "--varlen") {
      no_value();
      o.varlen = true;
    } else if (flag == "--layout") {
      const std::string v = next();
      if (v == "bshd") o.layout = Layout::bshd;
      else if (v == "bhsd") o.layout = Layout::bhsd;
      else throw std::invalid_argument("--layout: '" + v + "' is not bshd or bhsd");
    } else if (flag == "--deterministic") {
      no_value();
      o.deterministic = true;
    } else if (flag == "--pass") {
      const std::string v = next();
      if (v != "fwd" && v != "bwd" && v != "both")
        throw std::invalid_argument("--pass: '" + v + "' is not fwd, bwd or both");
      o.run_forward = v != "bwd";
      o.run_backward = v != "fwd";
    } else if (flag == "--d1") {
      o.d1 = next_count();
    } else if (flag == "--d2") {
      o.d2 = next_count();
    } else if (flag == "--d3") {
      o.d3 = next_count();
    } else if (flag == "--fp32-mode") {
      const std::string v = next();
      if (v == "exact") o.fp32_mode = Fp32Mode::exact;
      else if (v == "fast") o.fp32_mode = Fp32Mode::fast;
      else throw std::invalid_argument("--fp32-mode: '" + v + "' is not exact or fast");
    } else if (flag == "--backend") {
      const std::string v = next();
      if (v == "auto") o.backend = Backend::automatic;
      else if (v == "cpu") o.backend = Backend::cpu;
      else if (v == "cuda") o.backend = Backend::cuda;
      else throw std::invalid_argument("--backend: '" + v + "' is not auto, cpu or cuda");
    } else if (flag == "--impl") {
      o.impl = next();
      if (o.impl != "tileattn" && o.impl != "naive" && o.impl != "all") {
        throw std::invalid_argument("--impl: '" + o.impl + "' is not tileattn, naive or all");
      }
    } else if (flag == "--threads") {
      o.threads = int(parse_int_in(flag, next(), 0, INT_MAX, " (0 = all hardware threads)"));
    } else if (flag == "--warmup") {
      o.warmup = int(parse_int_in(flag, next(), 0, INT_MAX));
    } else if (flag == "--iters") {
      o.iters = int(parse_int_in(flag, next(), 1, INT_MAX));
    } else if (flag == "--seed") {
      o.seed = uint64_t(parse_int_in(flag, next(), 0, INT64_MAX));
    } else if (flag == "--check") {
      no_value();
      o.check = true;
    } else if (flag == "--csv") {
      o.csv = next();
      if (o.csv.empty()) throw std::invalid_argument("--csv needs a file name");
    } else if (flag == "--progress") {
      const std::string v = next();
      o.progress_s = parse_number(flag, v);
      if (!std::isfinite(o.progress_s) || o.progress_s < 0) {
        throw std::invalid_argument("--progress " + v + ": must be finite and >= 0 (seconds; 0 = never)");
      }
    } else if (flag == "--sweep") {
      const std::string v = next();
      const size_t eq = v.find('=');
      if (eq == std::string::npos) throw std::invalid_argument("--sweep " + v + ": takes KEY=V1,V2,...");
      o.sweep_key = v.substr(0, eq);
      o.sweep_values.clear();
      for (const std::string& item : split_list(v.substr(eq + 1))) {
        o.sweep_values.push_back(parse_int("--sweep " + o.sweep_key, item));
      }
      // Every value is applied once to a scratch copy, so an unknown key or an out-of-range value
      // fails now rather than mid-sweep.
      for (int64_t value : o.sweep_values) {
        Options probe;
        apply_sweep_value(probe, o.sweep_key, value);
      }
    } else {
      throw std::invalid_argument("unknown flag '" + flag + "' (try --help)");
    }
  }
  return o;
}

}  // namespace tileattn::bench
