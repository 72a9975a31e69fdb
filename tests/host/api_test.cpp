// The public entry points around validation: backend resolution, workspace queries, version,
// and that every entry point validates before it dispatches.
#include <gtest/gtest.h>

#include <cctype>
#include <string>

#include "host/valid_problems.hpp"
#include "tileattn/attention.hpp"

namespace tileattn::test {
namespace {

TEST(Api, AutomaticResolvesToCpuForHostMemory) {
  ValidAttention a;
  a.p.backend = Backend::automatic;
  EXPECT_EQ(resolve_backend(a.p), Backend::cpu);
}

TEST(Api, ExplicitBackendIsKept) {
  ValidAttention a;
  a.p.backend = Backend::cpu;
  EXPECT_EQ(resolve_backend(a.p), Backend::cpu);
  a.p.backend = Backend::cuda;
  EXPECT_EQ(resolve_backend(a.p), Backend::cuda);
}

TEST(Api, CudaAvailableOnlyInACudaBuild) {
#ifndef TILEATTN_WITH_CUDA
  EXPECT_FALSE(cuda_available());
#else
  GTEST_SKIP() << "CUDA build: availability depends on the machine";
#endif
}

TEST(Api, VersionIsMajorMinorPatch) {
  const std::string v = version();
  int dots = 0;
  for (char c : v) {
    if (c == '.') {
      ++dots;
    } else {
      EXPECT_TRUE(std::isdigit(static_cast<unsigned char>(c))) << v;
    }
  }
  EXPECT_EQ(dots, 2) << v;
  EXPECT_TRUE(std::isdigit(static_cast<unsigned char>(v.front())) && std::isdigit(static_cast<unsigned char>(v.back())))
      << v;
}

TEST(Api, CpuProblemsNeedNoWorkspace) {
  ValidAttention a;
  a.p.backend = Backend::automatic;
  EXPECT_EQ(forward_workspace_size(a.p), 0u);
  EXPECT_EQ(backward_workspace_size(a.p), 0u);
  ValidSoftmaxMatmul s;
  EXPECT_EQ(softmax_matmul_workspace_size(s.p), 0u);
}

TEST(Api, WorkspaceQueriesValidate) {
  ValidAttention a(1, 4, 4, 8, 3, 8, 8);
  expect_error([&] { forward_workspace_size(a.p); }, ErrorKind::invalid_argument, {"heads_kv=3 must divide heads_q=8"});
  ValidAttention b;
  b.p.dq.data = nullptr;  // only the backward needs dQ
  EXPECT_EQ(forward_workspace_size(b.p), 0u);
  expect_error([&] { backward_workspace_size(b.p); }, ErrorKind::invalid_argument, {"dq.data is null"});
  ValidSoftmaxMatmul s;
  s.p.d3 = 0;
  expect_error([&] { softmax_matmul_workspace_size(s.p); }, ErrorKind::invalid_argument, {"d3=0"});
}

TEST(Api, EntryPointsValidateBeforeRunning) {
  ValidAttention a;
  a.p.window_right = -2;
  expect_error([&] { forward(a.p); }, ErrorKind::invalid_argument, {"window_right=-2 must be >= -1"});
  ValidAttention b;
  b.p.dk.seq_stride = 1;
  expect_error([&] { backward(b.p); }, ErrorKind::invalid_argument, {"dk.seq_stride=1", "overlap"});
  ValidSoftmaxMatmul s;
  s.p.x = nullptr;
  expect_error([&] { softmax_matmul(s.p); }, ErrorKind::invalid_argument, {"x is null"});
}

#ifndef TILEATTN_WITH_CUDA
TEST(Api, CudaBackendInACpuBuildIsADeviceError) {
  ValidAttention a;
  a.p.backend = Backend::cuda;
  expect_error([&] { forward(a.p); }, ErrorKind::device, {"backend=cuda", "no CUDA backend"});
  expect_error([&] { backward(a.p); }, ErrorKind::device, {"backend=cuda"});
  expect_error([&] { forward_workspace_size(a.p); }, ErrorKind::device, {"backend=cuda"});
  ValidSoftmaxMatmul s;
  s.p.backend = Backend::cuda;
  expect_error([&] { softmax_matmul(s.p); }, ErrorKind::device, {"backend=cuda"});
}
#endif

}  // namespace
}  // namespace tileattn::test
