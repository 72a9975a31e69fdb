// Variable-length calls inside CUDA-graph capture. Validation cannot read cu_seqlens while a
// stream is being captured (the copy would synchronise), so: a replayed graph must give the bits
// of the eager calls, and offsets that break the rules (changed on the device after capture)
// must still leave every byte outside the outputs' views untouched.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "cuda/gpu_test_util.cuh"
#include "tileattn/attention.hpp"

namespace tileattn::test {
namespace {

ProblemShape varlen_shape(DType dtype) {
  ProblemShape s;
  s.seqlens_q = {70, 0, 130, 33};
  s.seqlens_k = {90, 10, 130, 200};
  s.heads_q = 4;
  s.heads_kv = 2;
  s.headdim_qk = 64;
  s.dtype = dtype;
  s.causal = true;
  return s;
}

// Forward then backward of `p` captured on `stream` into one graph, with caller workspaces.
class CapturedStep {
 public:
  CapturedStep(const AttentionProblem& p, cudaStream_t stream)
      : fwd_ws_(tileattn::forward_workspace_size(p) + 1), bwd_ws_(tileattn::backward_workspace_size(p) + 1) {
    AttentionProblem f = p, b = p;
    f.stream = b.stream = stream;
    f.workspace = fwd_ws_.get(), f.workspace_bytes = fwd_ws_.bytes();
    b.workspace = bwd_ws_.get(), b.workspace_bytes = bwd_ws_.bytes();
    check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "cudaStreamBeginCapture");
    tileattn::forward(f);
    tileattn::backward(b);
    cudaGraph_t graph = nullptr;
    check_cuda(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
    check_cuda(cudaGraphInstantiate(&exec_, graph, 0), "cudaGraphInstantiate");
    check_cuda(cudaGraphDestroy(graph), "cudaGraphDestroy");
  }
  ~CapturedStep() { cudaGraphExecDestroy(exec_); }
  void replay(cudaStream_t stream) {
    check_cuda(cudaGraphLaunch(exec_, stream), "cudaGraphLaunch");
    check_cuda(cudaStreamSynchronize(stream), "replay");
  }

 private:
  DeviceBuffer fwd_ws_, bwd_ws_;
  cudaGraphExec_t exec_ = nullptr;
};

struct Stream {
  cudaStream_t s = nullptr;
  Stream() { check_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate"); }
  ~Stream() { cudaStreamDestroy(s); }
};

TEST(VarlenGraphCapture, ReplayGivesTheEagerBits) {
  TA_SKIP_WITHOUT_GPU();
  for (DType dtype : {DType::bf16, DType::f16, DType::f32}) {
    SCOPED_TRACE(dtype == DType::bf16 ? "bf16" : dtype == DType::f16 ? "f16" : "f32");
    HostProblem hp(varlen_shape(dtype));
    hp.problem.deterministic = true;  // bitwise comparison across runs
    DeviceProblem dp(hp);
    dp.problem.deterministic = true;
    tileattn::forward(dp.problem);
    tileattn::backward(dp.problem);
    dp.download();
    const std::vector<std::byte> o = hp.o.bytes, dq = hp.dq.bytes, dk = hp.dk.bytes, dv = hp.dv.bytes;
    const std::vector<float> lse = hp.lse;

    dp.poison_outputs();
    Stream stream;
    CapturedStep step(dp.problem, stream.s);
    step.replay(stream.s);
    dp.download();
    EXPECT_TRUE(hp.o.bytes == o) << "O differs from the eager call";
    EXPECT_EQ(std::memcmp(hp.lse.data(), lse.data(), lse.size() * sizeof(float)), 0) << "L differs";
    EXPECT_TRUE(hp.dq.bytes == dq) << "dQ differs from the eager call";
    EXPECT_TRUE(hp.dk.bytes == dk) << "dK differs from the eager call";
    EXPECT_TRUE(hp.dv.bytes == dv) << "dV differs from the eager call";
  }
}

TEST(VarlenGraphCapture, BrokenOffsetsStayInsideTheBuffers) {
  TA_SKIP_WITHOUT_GPU();
  for (DType dtype : {DType::bf16, DType::f32}) {
    SCOPED_TRACE(dtype == DType::bf16 ? "bf16" : "f32");
    HostProblem hp(varlen_shape(dtype));
    DeviceProblem dp(hp);
    Stream stream;
    CapturedStep step(dp.problem, stream.s);
    // After capture, offsets that validation would reject: decreasing, negative, past the
    // buffers' rows, and a sequence longer than the max length.
    const int32_t bad_q[] = {0, 150, 20, -7, int32_t(hp.problem.total_q) + 999};
    const int32_t bad_k[] = {5, 0, 400, 410, 1 << 30};
    check_cuda(cudaMemcpy(const_cast<int32_t*>(dp.problem.cu_seqlens_q), bad_q, sizeof bad_q, cudaMemcpyHostToDevice),
               "upload cu_seqlens_q");
    check_cuda(cudaMemcpy(const_cast<int32_t*>(dp.problem.cu_seqlens_k), bad_k, sizeof bad_k, cudaMemcpyHostToDevice),
               "upload cu_seqlens_k");
    step.replay(stream.s);
    dp.download();
    EXPECT_EQ(hp.o.touched_outside_view(), 0) << "O written outside its view";
    EXPECT_EQ(hp.lse_guard_touched(), 0) << "L written past its end";
    EXPECT_EQ(hp.dq.touched_outside_view(), 0) << "dQ written outside its view";
    EXPECT_EQ(hp.dk.touched_outside_view(), 0) << "dK written outside its view";
    EXPECT_EQ(hp.dv.touched_outside_view(), 0) << "dV written outside its view";
  }
}

}  // namespace
}  // namespace tileattn::test
