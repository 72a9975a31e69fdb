// The CUDA forward's contract beyond accuracy: memory-space errors through the public API,
// caller workspaces, streams, bitwise determinism and rows that see no key.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/gpu_test_util.cuh"
#include "tileattn/attention.hpp"

namespace tileattn::test {
namespace {

ProblemShape small_shape(DType dtype) {
  ProblemShape s;
  s.seqlen_q = 70;
  s.seqlen_k = 90;
  s.heads_q = 4;
  s.heads_kv = 2;
  s.headdim_qk = 64;
  s.dtype = dtype;
  s.with_backward = false;
  return s;
}

// Few queries, many keys: split-KV, so the workspace is not empty.
ProblemShape split_shape() {
  ProblemShape s;
  s.seqlen_q = 2;
  s.seqlen_k = 6000;
  s.heads_q = 2;
  s.heads_kv = 1;
  s.headdim_qk = 128;
  s.dtype = DType::bf16;
  s.with_backward = false;
  return s;
}

template <class F>
Error catch_error(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "expected a tileattn::Error";
  return Error(ErrorKind::device, "");
}

// Whether this build has the head-dim bucket of `shape` (a narrowed TILEATTN_HEADDIMS may not):
// the forward of a copy of the problem either runs or says "unsupported".
bool bucket_built(const ProblemShape& shape) {
  HostProblem hp(shape);
  DeviceProblem dp(hp);
  try {
    tileattn::forward(dp.problem);
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::unsupported) return false;
    throw;
  }
  return true;
}

TEST(ForwardApi, HostPointersWithCudaBackendAreRejected) {
  TA_SKIP_WITHOUT_GPU();
  HostProblem hp(small_shape(DType::f16));
  hp.problem.backend = Backend::cuda;
  const Error e = catch_error([&] { tileattn::forward(hp.problem); });
  EXPECT_EQ(e.kind(), ErrorKind::invalid_argument);
  EXPECT_NE(std::string(e.what()).find("q"), std::string::npos) << e.what();
  EXPECT_NE(std::string(e.what()).find("device"), std::string::npos) << e.what();
}

TEST(ForwardApi, OneHostTensorAmongDeviceTensorsIsNamed) {
  TA_SKIP_WITHOUT_GPU();
  HostProblem hp(small_shape(DType::bf16));
  DeviceProblem dp(hp);
  AttentionProblem p = dp.problem;
  p.v = hp.problem.v;  // host memory
  const Error e = catch_error([&] { tileattn::forward(p); });
  EXPECT_EQ(e.kind(), ErrorKind::invalid_argument);
  EXPECT_NE(std::string(e.what()).find("v"), std::string::npos) << e.what();
}

TEST(ForwardApi, CallerWorkspaceGivesTheSameBits) {
  TA_SKIP_WITHOUT_GPU();
  if (!bucket_built(split_shape())) GTEST_SKIP() << "head dim 128 is not in this build";
  HostProblem hp(split_shape());
  DeviceProblem dp(hp);
  const size_t bytes = tileattn::forward_workspace_size(dp.problem);
  ASSERT_GT(bytes, 0u);
  tileattn::forward(dp.problem);
  dp.download();
  const std::vector<std::byte> o_lib = hp.o.bytes;
  const std::vector<float> l_lib = hp.lse;

  dp.poison_outputs();
  DeviceBuffer workspace(bytes);
  AttentionProblem p = dp.problem;
  p.workspace = workspace.get();
  p.workspace_bytes = bytes;
  tileattn::forward(p);
  dp.download();
  EXPECT_EQ(std::memcmp(o_lib.data(), hp.o.bytes.data(), o_lib.size()), 0);
  EXPECT_EQ(std::memcmp(l_lib.data(), hp.lse.data(), l_lib.size() * sizeof(float)), 0);

  p.workspace_bytes = bytes - 1;
  const Error e = catch_error([&] { tileattn::forward(p); });
  EXPECT_EQ(e.kind(), ErrorKind::invalid_argument);
  EXPECT_NE(std::string(e.what()).find("workspace_bytes"), std::string::npos) << e.what();
}

TEST(ForwardApi, RunsOnTheGivenStream) {
  TA_SKIP_WITHOUT_GPU();
  if (!bucket_built(split_shape())) GTEST_SKIP() << "head dim 128 is not in this build";
  for (const ProblemShape& shape : {small_shape(DType::f16), split_shape()}) {
    HostProblem hp(shape);
    DeviceProblem dp(hp);
    tileattn::forward(dp.problem);
    dp.download();
    const std::vector<std::byte> o_default = hp.o.bytes;

    dp.poison_outputs();
    cudaStream_t stream;
    check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    AttentionProblem p = dp.problem;
    p.stream = stream;
    tileattn::forward(p);
    check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    check_cuda(cudaStreamDestroy(stream), "cudaStreamDestroy");
    dp.download();
    EXPECT_EQ(std::memcmp(o_default.data(), hp.o.bytes.data(), o_default.size()), 0) << "stream run differs";
  }
}

// seqlen_q > seqlen_k with a causal mask: the first sq - sk query rows see no key.
TEST(ForwardApi, RowsThatSeeNoKeyGiveZeroAndMinusInfinity) {
  TA_SKIP_WITHOUT_GPU();
  for (DType dtype : {DType::f16, DType::bf16}) {
    ProblemShape s = small_shape(dtype);
    s.seqlen_q = 150;
    s.seqlen_k = 20;
    s.causal = true;
    HostProblem hp(s);
    DeviceProblem dp(hp);
    tileattn::forward(dp.problem);
    dp.download();
    const std::vector<double> o = hp.o.gather();  // (rows, heads, dim)
    const std::vector<double> l = hp.gather_lse();  // (batch, heads, seqlen_q)
    const int64_t hq = s.heads_q, d = s.headdim_qk;
    for (int64_t i = 0; i < s.seqlen_q; ++i)
      for (int64_t h = 0; h < hq; ++h) {
        const double lse = l[size_t(h * s.seqlen_q + i)];
        const bool empty = i < s.seqlen_q - s.seqlen_k;
        if (empty) {
          EXPECT_TRUE(std::isinf(lse) && lse < 0) << "row " << i << " head " << h << " L=" << lse;
          for (int64_t c = 0; c < d; ++c) ASSERT_EQ(o[size_t((i * hq + h) * d + c)], 0.0) << "row " << i;
        } else {
          EXPECT_TRUE(std::isfinite(lse)) << "row " << i << " head " << h << " L=" << lse;
        }
      }
  }
}

}  // namespace
}  // namespace tileattn::test
