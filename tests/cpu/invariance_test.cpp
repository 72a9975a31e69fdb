// Properties of the tiled CPU path that need no reference: results are bitwise identical run to
// run and across thread counts (each output element is produced by one task in a fixed order),
// and independent of the memory layout the same values are read through.
#include <gtest/gtest.h>

#include <cstring>

#include "cpu/gemm_kernels.hpp"
#include "support/host_problem.hpp"
#include "tileattn/attention.hpp"

namespace tileattn::test {
namespace {

struct Outputs {
  std::vector<double> o, lse, dq, dk, dv;
  bool operator==(const Outputs&) const = default;
};

Outputs run(HostProblem& hp, int threads) {
  hp.poison_outputs();
  hp.problem.backend = Backend::cpu;
  hp.problem.num_threads = threads;
  tileattn::forward(hp.problem);
  tileattn::backward(hp.problem);
  return {hp.o.gather(), hp.gather_lse(), hp.dq.gather(), hp.dk.gather(), hp.dv.gather()};
}

ProblemShape gqa_shape(DType dt) {
  ProblemShape s;
  s.seqlen_q = 190;
  s.seqlen_k = 257;
  s.heads_q = 8;
  s.heads_kv = 2;
  s.headdim_qk = 48;
  s.headdim_v = 24;
  s.causal = true;
  s.window_left = 100;
  s.dtype = dt;
  return s;
}

TEST(Invariance, BitwiseAcrossRunsAndThreadCounts) {
  HostProblem hp(gqa_shape(DType::bf16));
  const Outputs one = run(hp, 1);
  EXPECT_TRUE(one == run(hp, 1));
  EXPECT_TRUE(one == run(hp, 2));
  EXPECT_TRUE(one == run(hp, 5));
  EXPECT_TRUE(one == run(hp, 0));  // all hardware threads
}

// fp32 takes D = rowsum(O * dO) where 16-bit dtypes take rowsum(P * dP); with 3 sequences the
// backward runs its fused schedule at 1 and 2 threads and its split one at 5.
TEST(Invariance, BitwiseAcrossThreadCountsFp32BothSchedules) {
  ProblemShape s = gqa_shape(DType::f32);
  s.batch = 3;
  s.seqlen_q = 100;
  HostProblem hp(s);
  const Outputs one = run(hp, 1);
  EXPECT_TRUE(one == run(hp, 2));
  EXPECT_TRUE(one == run(hp, 5));
}

// Decoding with GQA packs a kv group's query heads into one tile, fewer of them where the tasks
// would leave threads idle (forward.cpp's packed_heads): 1, 5 and 16 threads pack 8, 4 and 2
// heads here (the problem is large enough for 16), and the results must not move.
TEST(Invariance, BitwiseAcrossThreadCountsPackedDecode) {
  for (DType dt : {DType::f32, DType::bf16}) {
    ProblemShape s;
    s.batch = 4;
    s.seqlen_q = 2;
    s.seqlen_k = 2048;
    s.heads_q = 16;
    s.heads_kv = 2;
    s.headdim_qk = 64;
    s.causal = true;
    s.dtype = dt;
    HostProblem hp(s);
    const Outputs one = run(hp, 1);
    EXPECT_TRUE(one == run(hp, 2));
    EXPECT_TRUE(one == run(hp, 5));
    EXPECT_TRUE(one == run(hp, 16));
  }
}

// The tile products' AVX-512 instance (taken where the CPU has it) and the build target's give the
// same outputs and gradients bit for bit, for fp32 and bf16, GQA, a window and unequal head dims.
TEST(Invariance, BitwiseAcrossTileProductInstances) {
  const cpu::GemmKernels in_use = cpu::gemm_kernels();
  if (!cpu::use_gemm_kernels(cpu::GemmKernels::avx512)) GTEST_SKIP() << "no AVX-512 in this build or on this CPU";
  for (DType dt : {DType::f32, DType::bf16}) {
    HostProblem hp(gqa_shape(dt));
    cpu::use_gemm_kernels(cpu::GemmKernels::avx512);
    const Outputs wide = run(hp, 2);
    cpu::use_gemm_kernels(cpu::GemmKernels::target);
    EXPECT_TRUE(wide == run(hp, 2)) << "dtype " << int(dt);
  }
  cpu::use_gemm_kernels(in_use);
}

// fp32 in (B, H, N, D) is read in place; strided fp32 and 16-bit rows go through per-call dense
// panels (the forward's K and V) or per-task copies.
TEST(Invariance, BitwiseAcrossLayouts) {
  for (DType dt : {DType::f16, DType::f32}) {
    ProblemShape s = gqa_shape(dt);
    HostProblem a(s);
    s.layout = Layout::bhsd;
    HostProblem b(s);
    s.layout = Layout::padded;
    HostProblem c(s);
    for (HostProblem* other : {&b, &c}) {
      other->q.scatter(a.q.gather());
      other->k.scatter(a.k.gather());
      other->v.scatter(a.v.gather());
      other->dout.scatter(a.dout.gather());
    }
    const Outputs ref = run(a, 2);
    const char* name = dt == DType::f32 ? "f32" : "f16";
    EXPECT_TRUE(ref == run(b, 2)) << "bhsd, " << name;
    EXPECT_TRUE(ref == run(c, 2)) << "padded, " << name;
  }
}

// The panels' memory stays with the calling thread between calls (row_panels.hpp): calls that
// need more, less, then more again get panels holding their own rows, whatever the previous call
// left there, and one thread count or another.
TEST(Invariance, PanelMemoryReusedAcrossCalls) {
  std::vector<Outputs> flash, dense;
  const int64_t lengths[] = {300, 70, 513};
  for (int64_t n : lengths) {
    ProblemShape s = gqa_shape(DType::f32);
    s.seqlen_q = s.seqlen_k = n;
    HostProblem a(s);  // flash-attn's layout: strided fp32 rows, copied into panels
    s.layout = Layout::bhsd;
    HostProblem b(s);  // read in place
    b.q.scatter(a.q.gather());
    b.k.scatter(a.k.gather());
    b.v.scatter(a.v.gather());
    b.dout.scatter(a.dout.gather());
    flash.push_back(run(a, n == 70 ? 1 : 2));
    dense.push_back(run(b, 2));
  }
  for (size_t i = 0; i < flash.size(); ++i) EXPECT_TRUE(flash[i] == dense[i]) << "length " << lengths[i];
}

}  // namespace
}  // namespace tileattn::test
