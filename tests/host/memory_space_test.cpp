// Rules that need a CUDA device: which memory each pointer lives in must match the backend, and
// cu_seqlens in device memory are copied back and checked like host ones when the caller asks
// (check_cu_seqlens). Skipped without a device.
#include <gtest/gtest.h>

#ifdef TILEATTN_WITH_CUDA
#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

#include "host/valid_problems.hpp"
#include "host/validate.hpp"
#include "tileattn/attention.hpp"

namespace tileattn::test {
namespace {

// A device copy of a host vector, freed at scope exit.
template <class T>
struct DeviceCopy {
  T* data = nullptr;
  explicit DeviceCopy(const std::vector<T>& host) {
    EXPECT_EQ(cudaMalloc(&data, host.size() * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(data, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~DeviceCopy() { EXPECT_EQ(cudaFree(data), cudaSuccess); }
  DeviceCopy(const DeviceCopy&) = delete;
  DeviceCopy& operator=(const DeviceCopy&) = delete;
};

// Every tensor of `a` moved to the device (same strides).
struct DeviceAttention {
  DeviceCopy<float> q, k, v, o, dout, dq, dk, dv, lse;
  AttentionProblem p;
  explicit DeviceAttention(const ValidAttention& a)
      : q(a.q), k(a.k), v(a.v), o(a.o), dout(a.dout), dq(a.dq), dk(a.dk), dv(a.dv), lse(a.lse), p(a.p) {
    p.q.data = q.data;
    p.k.data = k.data;
    p.v.data = v.data;
    p.o.data = o.data;
    p.dout.data = dout.data;
    p.dq.data = dq.data;
    p.dk.data = dk.data;
    p.dv.data = dv.data;
    p.lse = lse.data;
    p.backend = Backend::cuda;
  }
};

class MemorySpace : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(MemorySpace, DeviceTensorsResolveToCudaAndPass) {
  ValidAttention a;
  DeviceAttention d(a);
  d.p.backend = Backend::automatic;
  EXPECT_EQ(resolve_backend(d.p), Backend::cuda);
  EXPECT_NO_THROW(host::validate_attention(d.p, host::Pass::backward, Backend::cuda));
}

TEST_F(MemorySpace, HostPointerOnTheCudaBackendIsRejected) {
  ValidAttention a;
  DeviceAttention d(a);
  d.p.dv.data = a.dv.data();
  expect_error([&] { host::validate_attention(d.p, host::Pass::backward, Backend::cuda); }, ErrorKind::invalid_argument,
               {"dv.data is not memory of the current CUDA device", "backend=cuda"});
  d.p.dv.data = d.dv.data;
  d.p.lse = a.lse.data();
  expect_error([&] { host::validate_attention(d.p, host::Pass::forward, Backend::cuda); }, ErrorKind::invalid_argument,
               {"lse is not memory of the current CUDA device"});
}

TEST_F(MemorySpace, DevicePointerOnTheCpuBackendIsRejected) {
  ValidAttention a;
  DeviceCopy<float> k(a.k);
  a.p.k.data = k.data;
  expect_error([&] { forward(a.p); }, ErrorKind::invalid_argument,
               {"k.data is device memory, but backend=cpu needs host memory"});
}

TEST_F(MemorySpace, DeviceCuSeqlensAreCheckedOnRequest) {
  ValidAttention a;
  a.make_varlen({4, 4}, {6, 6});
  a.cu_k[1] = 7;  // cu_seqlens_k = {0, 7, 12}: sequence 0 is longer than seqlen_k = 6
  DeviceAttention d(a);
  DeviceCopy<int32_t> cu_q(a.cu_q), cu_k(a.cu_k);
  d.p.cu_seqlens_q = cu_q.data;
  d.p.cu_seqlens_k = cu_k.data;
  d.p.check_cu_seqlens = true;
  expect_error([&] { plan_forward(d.p); }, ErrorKind::invalid_argument,
               {"cu_seqlens_k: sequence 0 has length 7 > seqlen_k=6"});
}

// Without the request nothing reads device offsets on the host (no copy, no synchronisation):
// the call is planned, and the kernels' clamping keeps a bad offset inside the buffers.
TEST_F(MemorySpace, DeviceCuSeqlensAreNotReadByDefault) {
  ValidAttention a;
  a.make_varlen({4, 4}, {6, 6});
  a.cu_k[1] = 7;
  DeviceAttention d(a);
  DeviceCopy<int32_t> cu_q(a.cu_q), cu_k(a.cu_k);
  d.p.cu_seqlens_q = cu_q.data;
  d.p.cu_seqlens_k = cu_k.data;
  EXPECT_NO_THROW(plan_forward(d.p));
}

TEST_F(MemorySpace, TooSmallWorkspaceIsRejected) {
  ValidAttention a(1, 256, 256, 4, 4, 64, 64);
  DeviceAttention d(a);
  const size_t needed = backward_workspace_size(d.p);
  if (needed == 0) GTEST_SKIP() << "this problem needs no workspace";
  DeviceCopy<std::byte> ws{std::vector<std::byte>(needed)};
  d.p.workspace = ws.data;
  d.p.workspace_bytes = needed - 1;
  expect_error([&] { host::validate_attention(d.p, host::Pass::backward, Backend::cuda); }, ErrorKind::invalid_argument,
               {"workspace_bytes=", "is less than backward_workspace_size"});
}

}  // namespace
}  // namespace tileattn::test
#endif
