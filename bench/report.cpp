#include "report.hpp"

#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <vector>

#include "tileattn/attention.hpp"

namespace tileattn::bench {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string quoted = "\"";
  for (char c : s) quoted += c == '"' ? std::string("\"\"") : std::string(1, c);
  return quoted + "\"";
}

std::string significant(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

std::string fixed(double v, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

const char* kCsvHeader =
    "version,op,impl,pass,backend,device,dtype,layout,batch,seqlen_q,seqlen_k,heads_q,heads_kv,headdim,headdim_v,"
    "causal,window_left,window_right,softcap,varlen,d1,d2,d3,warmup,iters,median_ms,min_ms,tflops,bench_mib,"
    "rss_growth_mib";

}  // namespace

Report::Report(Backend backend, std::string device, const std::string& csv_path, std::string preamble)
    : backend_(backend), device_(std::move(device)), preamble_(std::move(preamble)) {
  if (csv_path.empty()) return;
  std::error_code ec;
  const bool fresh = !std::filesystem::exists(csv_path, ec) || std::filesystem::file_size(csv_path, ec) == 0;
  csv_.open(csv_path, std::ios::app);
  if (!csv_) throw std::runtime_error("--csv: cannot open '" + csv_path + "' for appending");
  csv_header_needed_ = fresh;
}

void Report::add(const Options& o, const Row& row) {
  const double tflops = row.flops / (row.m.median_ms * 1e-3) / 1e12;
  const std::string rss = row.m.rss_growth_bytes < 0 ? "-" : fixed(double(row.m.rss_growth_bytes) / kMiB, 1);
  if (!header_printed_) {
    std::fputs(preamble_.c_str(), stdout);
    std::printf("%-9s %-4s %-44s %10s %10s %8s %9s %9s\n", "impl", "pass", "problem", "median_ms", "min_ms", "TFLOP/s",
                "mem_MiB", "rss+_MiB");
    header_printed_ = true;
  }
  std::printf("%-9s %-4s %-44s %10.3f %10.3f %8.4g %9.1f %9s\n", row.impl.c_str(), row.pass.c_str(),
              row.problem.c_str(), row.m.median_ms, row.m.min_ms, tflops, double(row.m.bench_bytes) / kMiB,
              rss.c_str());
  std::fflush(stdout);

  if (!csv_.is_open()) return;
  if (csv_header_needed_) {
    csv_ << kCsvHeader << '\n';
    csv_header_needed_ = false;
  }
  const bool attention = o.op == Op::attention;
  const auto a = [&](int64_t v) { return attention ? std::to_string(v) : std::string(); };
  const auto s = [&](int64_t v) { return attention ? std::string() : std::to_string(v); };
  const std::vector<std::string> fields = {version(),
                                           attention ? "attention" : "softmax_matmul",
                                           row.impl,
                                           row.pass,
                                           backend_ == Backend::cuda ? "cuda" : "cpu",
                                           device_,
                                           dtype_name(o.dtype),
                                           attention ? layout_name(o.layout) : "",
                                           std::to_string(o.batch),
                                           a(o.seqlen_q),
                                           a(o.seqlen_k),
                                           a(o.heads),
                                           a(o.heads_kv > 0 ? o.heads_kv : o.heads),
                                           a(o.headdim),
                                           a(o.headdim_v > 0 ? o.headdim_v : o.headdim),
                                           a(o.causal),
                                           a(o.window_left),
                                           a(o.window_right),
                                           attention ? fixed(o.softcap, 3) : "",
                                           a(o.varlen),
                                           s(o.d1),
                                           s(o.d2),
                                           s(o.d3),
                                           std::to_string(o.warmup),
                                           std::to_string(o.iters),
                                           fixed(row.m.median_ms, 4),
                                           fixed(row.m.min_ms, 4),
                                           significant(tflops),
                                           fixed(double(row.m.bench_bytes) / kMiB, 2),
                                           row.m.rss_growth_bytes < 0 ? "" : rss};
  for (size_t i = 0; i < fields.size(); ++i) csv_ << (i ? "," : "") << csv_field(fields[i]);
  csv_ << '\n';
  csv_.flush();
}

}  // namespace tileattn::bench
