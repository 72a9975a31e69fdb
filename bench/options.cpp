#include "options.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>
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
  --headdim N          Q/K head dim (default 64)
  --headdim-v N        V/O head dim (default: --headdim)
  --dtype f32|f16|bf16 (default f32)
  --causal             bottom-right aligned causal mask
  --window L,R         sliding window, -1 = unbounded side
  --softcap X          soft-capping of the scores (0 = off)
  --scale X            softmax scale (default 1/sqrt(headdim))
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
  --threads N          CPU threads (default: all)
  --warmup N, --iters N     (default 1 and 10 on cpu, 5 and 20 on cuda)
  --seed N             input seed (default 1)
  --check              with several implementations, print the max difference of their outputs
  --csv FILE           append one row per measurement (header written when the file is new)
  --sweep KEY=V1,V2,.. run once per value; KEY: seqlen, seqlen-q, seqlen-k, batch, heads,
                       heads-kv, headdim, d1, d2, d3. Progress goes to stderr.

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
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || text.empty()) throw std::invalid_argument(flag + ": '" + text + "' is not an integer");
  return v;
}

float parse_float(const std::string& flag, const std::string& text) {
  size_t used = 0;
  float v = 0.0f;
  try {
    v = std::stof(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || text.empty()) throw std::invalid_argument(flag + ": '" + text + "' is not a number");
  return v;
}

std::vector<int64_t> parse_int_list(const std::string& flag, const std::string& text) {
  std::vector<int64_t> values;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = text.find(',', start);
    const size_t end = comma == std::string::npos ? text.size() : comma;
    values.push_back(parse_int(flag, text.substr(start, end - start)));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return values;
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
  if (key == "seqlen") {
    o.seqlen_q = o.seqlen_k = value;
  } else if (key == "seqlen-q") {
    o.seqlen_q = value;
  } else if (key == "seqlen-k") {
    o.seqlen_k = value;
  } else if (key == "batch") {
    o.batch = value;
  } else if (key == "heads") {
    o.heads = value;
  } else if (key == "heads-kv") {
    o.heads_kv = value;
  } else if (key == "headdim") {
    o.headdim = value;
  } else if (key == "d1") {
    o.d1 = value;
  } else if (key == "d2") {
    o.d2 = value;
  } else if (key == "d3") {
    o.d3 = value;
  } else {
    throw std::invalid_argument("--sweep: unknown key '" + key + "' (see --help)");
  }
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
    auto next = [&]() -> std::string {
      if (has_value) return value;
      if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a value");
      return argv[++i];
    };
    auto next_int = [&] { return parse_int(flag, next()); };

    if (flag == "--help" || flag == "-h") {
      std::fputs(kHelp, stdout);
      std::exit(0);
    } else if (flag == "--op") {
      const std::string v = next();
      if (v == "attention") o.op = Op::attention;
      else if (v == "softmax_matmul" || v == "softmax-matmul") o.op = Op::softmax_matmul;
      else throw std::invalid_argument("--op: '" + v + "' is not attention or softmax_matmul");
    } else if (flag == "--batch") {
      o.batch = next_int();
    } else if (flag == "--seqlen") {
      o.seqlen_q = o.seqlen_k = next_int();
    } else if (flag == "--seqlen-q") {
      o.seqlen_q = next_int();
    } else if (flag == "--seqlen-k") {
      o.seqlen_k = next_int();
    } else if (flag == "--heads") {
      o.heads = next_int();
    } else if (flag == "--heads-kv") {
      o.heads_kv = next_int();
    } else if (flag == "--headdim") {
      o.headdim = next_int();
    } else if (flag == "--headdim-v") {
      o.headdim_v = next_int();
    } else if (flag == "--dtype") {
      o.dtype = parse_dtype(next());
    } else if (flag == "--causal") {
      o.causal = true;
    } else if (flag == "--window") {
      const std::vector<int64_t> w = parse_int_list(flag, next());
      if (w.size() != 2) throw std::invalid_argument("--window takes L,R");
      o.window_left = w[0];
      o.window_right = w[1];
    } else if (flag == "--softcap") {
      o.softcap = parse_float(flag, next());
    } else if (flag == "--scale") {
      o.scale = parse_float(flag, next());
    } else if (flag == "--varlen") {
      o.varlen = true;
    } else if (flag == "--layout") {
      const std::string v = next();
      if (v == "bshd") o.layout = Layout::bshd;
      else if (v == "bhsd") o.layout = Layout::bhsd;
      else throw std::invalid_argument("--layout: '" + v + "' is not bshd or bhsd");
    } else if (flag == "--deterministic") {
      o.deterministic = true;
    } else if (flag == "--pass") {
      const std::string v = next();
      if (v != "fwd" && v != "bwd" && v != "both")
        throw std::invalid_argument("--pass: '" + v + "' is not fwd, bwd or both");
      o.run_forward = v != "bwd";
      o.run_backward = v != "fwd";
    } else if (flag == "--d1") {
      o.d1 = next_int();
    } else if (flag == "--d2") {
      o.d2 = next_int();
    } else if (flag == "--d3") {
      o.d3 = next_int();
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
      o.threads = int(next_int());
    } else if (flag == "--warmup") {
      o.warmup = int(next_int());
      if (o.warmup < 0) throw std::invalid_argument("--warmup must be >= 0");
    } else if (flag == "--iters") {
      o.iters = int(next_int());
      if (o.iters < 1) throw std::invalid_argument("--iters must be >= 1");
    } else if (flag == "--seed") {
      o.seed = uint64_t(next_int());
    } else if (flag == "--check") {
      o.check = true;
    } else if (flag == "--csv") {
      o.csv = next();
    } else if (flag == "--sweep") {
      const std::string v = next();
      const size_t eq = v.find('=');
      if (eq == std::string::npos) throw std::invalid_argument("--sweep takes KEY=V1,V2,...");
      o.sweep_key = v.substr(0, eq);
      o.sweep_values = parse_int_list(flag, v.substr(eq + 1));
      Options probe;
      apply_sweep_value(probe, o.sweep_key, 1);  // rejects an unknown key now, not mid-sweep
    } else {
      throw std::invalid_argument("unknown flag '" + flag + "' (try --help)");
    }
  }
  return o;
}

}  // namespace tileattn::bench
