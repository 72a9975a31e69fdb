// tileattn-bench: times tileattn (and, in CUDA builds, a naive cuBLAS peer on the same inputs)
// on one problem or a sweep. See --help.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cases.hpp"
#include "memory.hpp"
#include "options.hpp"
#include "progress.hpp"
#include "report.hpp"
#include "tileattn/tileattn.hpp"
#include "timing.hpp"

#ifdef TILEATTN_WITH_CUDA
#include "device.hpp"
#include "naive_cublas.hpp"
#endif

namespace tileattn::bench {
namespace {

// Outputs of one implementation, widened to float64, for --check.
struct Snapshot {
  std::string impl;
  std::vector<std::pair<const char*, std::vector<double>>> tensors;
};

// Largest |a - b| with equal infinities (L of an empty row) counted as exact and NaN as infinite.
double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] == b[i]) continue;
    const double d = std::fabs(a[i] - b[i]);
    worst = std::isnan(d) ? INFINITY : std::max(worst, d);
  }
  return worst;
}

double max_abs(const std::vector<double>& a) {
  double m = 0;
  for (double x : a) {
    if (std::isfinite(x)) m = std::max(m, std::fabs(x));
  }
  return m;
}

void print_check(const std::vector<Snapshot>& snapshots) {
  if (snapshots.size() < 2) {
    std::printf("check: needs two implementations on this backend; nothing compared\n");
    return;
  }
  const Snapshot& ref = snapshots.front();
  for (size_t s = 1; s < snapshots.size(); ++s) {
    std::printf("check %s vs %s:", snapshots[s].impl.c_str(), ref.impl.c_str());
    for (size_t t = 0; t < ref.tensors.size(); ++t) {
      const auto& [name, want] = ref.tensors[t];
      std::printf(" %s max|diff| %.3g (max|%s| %.3g)%s", name, max_abs_diff(snapshots[s].tensors[t].second, want), name,
                  max_abs(want), t + 1 < ref.tensors.size() ? "," : "");
    }
    std::printf("\n");
  }
}

std::vector<std::string> implementations(const Options& o, Backend backend) {
  std::vector<std::string> impls;
  if (o.impl == "tileattn" || o.impl == "all") impls.push_back("tileattn");
  const bool naive_here = backend == Backend::cuda && o.op == Op::attention;
  if (o.impl == "naive" && !naive_here) {
    throw std::invalid_argument("--impl naive needs a CUDA build, --backend cuda and --op attention");
  }
  if ((o.impl == "naive" || o.impl == "all") && naive_here) impls.push_back("naive");
  return impls;
}

// Returns the number of implementations that failed at run time (unsupported on this device,
// out of memory); an invalid problem throws instead, before anything runs.
int run_attention(const Options& o, Backend backend, Report& report, Progress& progress) {
  AttentionCase c = [&] {
    ProgressTask task(&progress, "preparing the inputs");
    return make_attention_case(o, backend);
  }();
  std::vector<Snapshot> snapshots;
  int failures = 0;
  for (const std::string& impl : implementations(o, backend)) {
    allocation_stats(backend).reset_peak();
    AttentionProblem p = c.problem;
    const bool ours = impl == "tileattn";
    AttentionOutputs out = bind_outputs(p, backend, o.layout, o.run_backward, ours && backend == Backend::cuda);
    // The workspace queries validate, so every implementation runs only problems the library accepts.
    forward_workspace_size(p);
    if (o.run_backward) backward_workspace_size(p);
    std::function<void()> fwd = [&] { forward(p); };
    std::function<void()> bwd = [&] { backward(p); };
#ifdef TILEATTN_WITH_CUDA
    std::unique_ptr<NaiveAttention> naive;
    if (!ours) {
      if (const std::string why = NaiveAttention::unsupported_reason(p); !why.empty()) {
        std::fprintf(stderr, "naive: skipped (%s are not supported)\n", why.c_str());
        continue;
      }
      fwd = [&] {
        if (!naive) naive = std::make_unique<NaiveAttention>(p);
        naive->forward();
      };
      bwd = [&] { naive->backward(); };
    }
#endif
    // One implementation failing (a kernel this device lacks, a peer's score matrices not fitting
    // in memory) leaves the others' measurements standing.
    try {
      if (o.run_forward) {
        report.add(o, {impl, "fwd", c.describe, c.forward_flops,
                       measure(backend, o.warmup, o.iters, fwd, &progress, impl + " fwd " + c.describe)});
      } else {
        ProgressTask task(&progress, impl + " fwd " + c.describe + " (for the backward's O and L)");
        fwd();
      }
      if (o.run_backward) {
        report.add(o, {impl, "bwd", c.describe, c.backward_flops,
                       measure(backend, o.warmup, o.iters, bwd, &progress, impl + " bwd " + c.describe)});
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s: failed: %s\n", impl.c_str(), e.what());
      ++failures;
      continue;
    }
    if (o.check) {
      Snapshot snap{impl, {}};
      snap.tensors.emplace_back("O", to_double(out.o, p.dtype));
      snap.tensors.emplace_back("L", to_double(out.lse, DType::f32));
      if (o.run_backward) {
        snap.tensors.emplace_back("dQ", to_double(out.dq, p.dtype));
        snap.tensors.emplace_back("dK", to_double(out.dk, p.dtype));
        snap.tensors.emplace_back("dV", to_double(out.dv, p.dtype));
      }
      snapshots.push_back(std::move(snap));
    }
  }
  if (o.check) print_check(snapshots);
  return failures;
}

void run_softmax_matmul(const Options& o, Backend backend, Report& report, Progress& progress) {
  allocation_stats(backend).reset_peak();
  SoftmaxMatmulCase c = [&] {
    ProgressTask task(&progress, "preparing the inputs");
    return make_softmax_matmul_case(o, backend);
  }();
  report.add(o, {"tileattn", "fwd", c.describe, c.flops,
                 measure(
                     backend, o.warmup, o.iters, [&] { softmax_matmul(c.problem); }, &progress,
                     "tileattn softmax_matmul " + c.describe)});
  if (o.check) std::printf("check: needs two implementations on this backend; nothing compared\n");
}

std::string describe_device(Backend backend, int threads) {
#ifdef TILEATTN_WITH_CUDA
  if (backend == Backend::cuda) return device::describe();
#endif
  (void)backend;
  const unsigned n = threads > 0 ? unsigned(threads) : std::max(1u, std::thread::hardware_concurrency());
  return "cpu, " + std::to_string(n) + " threads";
}

int run(Options o) {
  Backend backend = o.backend;
  if (backend == Backend::automatic) backend = cuda_available() ? Backend::cuda : Backend::cpu;
  if (backend == Backend::cuda && !cuda_available()) {
    throw Error(ErrorKind::device, "--backend cuda: this build has no CUDA backend or no CUDA device is visible");
  }
  implementations(o, backend);  // an --impl this backend lacks fails before any output
  const bool gpu = backend == Backend::cuda;
  if (o.warmup < 0) o.warmup = gpu ? 5 : 1;
  if (o.iters < 0) o.iters = gpu ? 20 : 10;

  const std::string device = describe_device(backend, o.threads);
  char preamble[1024];
  std::snprintf(preamble, sizeof preamble,
                "tileattn-bench %s | %s | %s | %s%s | warmup %d, iters %d\n"
                "mem_MiB: peak %s memory the bench allocated (inputs, outputs, workspace, peer scratch)%s\n",
                version(), device.c_str(), dtype_name(o.dtype),
                o.op == Op::attention ? layout_name(o.layout) : "softmax_matmul",
                o.dtype == DType::f32 && o.fp32_mode == Fp32Mode::fast ? " | fp32 fast" : "", o.warmup, o.iters,
                gpu ? "device" : "host", gpu ? "" : "; rss+_MiB: peak RSS growth during the runs");
  Report report(backend, device, o.csv, preamble);
  Progress progress(o.progress_s);

  const bool sweep = !o.sweep_values.empty();
  const size_t points = sweep ? o.sweep_values.size() : 1;
  int failures = 0;
  for (size_t i = 0; i < points; ++i) {
    Options point = o;
    const auto t0 = std::chrono::steady_clock::now();
    if (sweep) {
      apply_sweep_value(point, o.sweep_key, o.sweep_values[i]);
      std::fprintf(stderr, "[%zu/%zu] %s=%lld ...\n", i + 1, points, o.sweep_key.c_str(),
                   static_cast<long long>(o.sweep_values[i]));
    }
    try {
      if (point.op == Op::attention) {
        failures += run_attention(point, backend, report, progress);
      } else {
        run_softmax_matmul(point, backend, report, progress);
      }
    } catch (const std::exception& e) {
      if (!sweep) throw;
      // One invalid point of a sweep does not stop the others.
      std::fprintf(stderr, "[%zu/%zu] %s=%lld: %s\n", i + 1, points, o.sweep_key.c_str(),
                   static_cast<long long>(o.sweep_values[i]), e.what());
      ++failures;
      continue;
    }
    if (sweep) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::fprintf(stderr, "[%zu/%zu] %s=%lld done in %.1f s\n", i + 1, points, o.sweep_key.c_str(),
                   static_cast<long long>(o.sweep_values[i]), s);
    }
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace tileattn::bench

int main(int argc, char** argv) {
  using namespace tileattn::bench;
  Options options;
  try {
    options = parse_options(argc, argv);
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "tileattn-bench: %s\n", e.what());
    return 2;
  }
  try {
    return run(options);
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "tileattn-bench: error: out of host memory\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tileattn-bench: error: %s\n", e.what());
    return 1;
  }
}
