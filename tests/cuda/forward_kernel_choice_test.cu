// Which forward kernel runs: Hopper takes the TMA + wgmma kernel whenever the copy engine can
// describe the inputs, falls back to the portable kernel when it cannot, and both agree.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "cuda/cuda_backend.hpp"
#include "cuda/gpu_test_util.cuh"
#include "tileattn/attention.hpp"

namespace tileattn::test {
namespace {

ProblemShape shape(int64_t headdim) {
  ProblemShape s;
  s.batch = 2;
  s.seqlen_q = 200;
  s.seqlen_k = 300;
  s.heads_q = 4;
  s.heads_kv = 2;
  s.headdim_qk = headdim;
  s.dtype = DType::bf16;
  s.with_backward = false;
  return s;
}

TEST(ForwardKernelChoice, HopperRunsTheTmaKernelForAlignedInputs) {
  TA_SKIP_WITHOUT_GPU();
  if (!hopper_kernels_run()) GTEST_SKIP() << "not a compute capability 9.0 device, or the portable kernels forced";
  for (int64_t d : {64, 128, 256}) {
    HostProblem hp(shape(d));
    DeviceProblem dp(hp);
    try {
      EXPECT_STREQ(cuda::forward_kernel_name(dp.problem), "sm90") << "head dim " << d;
    } catch (const Error& e) {
      // A narrowed build (TILEATTN_HEADDIMS) lacks the bucket.
      if (e.kind() != ErrorKind::unsupported) throw;
    }
  }
}

// ALiBi runs on the Hopper kernels too, forward and backward, its bias and L's causal-form offset
// in instances of their own; the accuracy sweeps (forward_accuracy_test.cu, backward_sweep_test.cu)
// check their numbers.
TEST(ForwardKernelChoice, HopperRunsAlibiOnTheTmaKernels) {
  TA_SKIP_WITHOUT_GPU();
  if (!hopper_kernels_run()) GTEST_SKIP() << "not a compute capability 9.0 device, or the portable kernels forced";
  for (DType dtype : {DType::f16, DType::bf16})
    for (int64_t d : {64, 128, 256})
      for (bool causal : {false, true}) {
        ProblemShape s = shape(d);
        s.dtype = dtype;
        s.causal = causal;
        s.alibi = ProblemShape::Alibi::per_head;
        s.with_backward = true;
        HostProblem hp(s);
        DeviceProblem dp(hp);
        SCOPED_TRACE(s.describe());
        try {
          EXPECT_STREQ(tileattn::plan_forward(dp.problem).kernel_name(), "sm90");
          EXPECT_STREQ(tileattn::plan_backward(dp.problem).kernel_name(), "sm90");
        } catch (const Error& e) {
          if (e.kind() != ErrorKind::unsupported) throw;
        }
      }
}

TEST(ForwardKernelChoice, UnalignedRowStrideFallsBackAndStaysAccurate) {
  TA_SKIP_WITHOUT_GPU();
  ProblemShape s = shape(64);
  s.headdim_qk = 60;  // rows of 120 bytes: not a multiple of 16, so no tensor map
  HostProblem hp(s);
  DeviceProblem dp(hp);
  EXPECT_STREQ(cuda::forward_kernel_name(dp.problem), "sm80");
  tileattn::forward(dp.problem);
  dp.download();
  expect_forward_within_2x(hp, dp);
}

TEST(ForwardKernelChoice, EnvironmentForcesThePortableKernel) {
  TA_SKIP_WITHOUT_GPU();
  HostProblem hp(shape(128));
  DeviceProblem dp(hp);
  const char* old = std::getenv("TILEATTN_CUDA_KERNELS");
  const std::string saved = old ? old : "";
  setenv("TILEATTN_CUDA_KERNELS", "sm80", 1);
  std::string name;
  bool built = true;
  try {
    name = cuda::forward_kernel_name(dp.problem);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::unsupported) throw;
    built = false;  // a narrowed build (TILEATTN_HEADDIMS) lacks the bucket
  }
  if (old) setenv("TILEATTN_CUDA_KERNELS", saved.c_str(), 1);
  else unsetenv("TILEATTN_CUDA_KERNELS");
  if (!built) GTEST_SKIP() << "head dim 128 is not in this build";
  EXPECT_EQ(name, "sm80");
}

}  // namespace
}  // namespace tileattn::test
