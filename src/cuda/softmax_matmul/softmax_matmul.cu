#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "cuda/common/check.cuh"
#include "cuda/cuda_backend.hpp"
#include "cuda/softmax_matmul/softmax_matmul_kernel.cuh"
#include "tileattn/error.hpp"

namespace tileattn::cuda {
namespace {

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <class T, int kBlockD3, bool kExact>
void launch(const SoftmaxMatmulProblem& pr) {
  using Tile = smm::SmmTile<T, kBlockD3, kExact>;
  constexpr int kVec = Tile::kVec;
  smm::Params p{};
  p.x = pr.x, p.v = pr.v, p.out = pr.out;
  p.x_batch_stride = pr.x_batch_stride, p.x_row_stride = pr.x_row_stride;
  p.v_batch_stride = pr.v_batch_stride, p.v_row_stride = pr.v_row_stride;
  p.out_batch_stride = pr.out_batch_stride, p.out_row_stride = pr.out_row_stride;
  p.d1 = int(pr.d1), p.d2 = int(pr.d2), p.d3 = int(pr.d3);
  p.d3_blocks = int((pr.d3 + kBlockD3 - 1) / kBlockD3);
  p.vec16 = aligned16(pr.x) && aligned16(pr.v) && pr.d2 % kVec == 0 && pr.d3 % kVec == 0 &&
            pr.x_row_stride % kVec == 0 && pr.x_batch_stride % kVec == 0 && pr.v_row_stride % kVec == 0 &&
            pr.v_batch_stride % kVec == 0;
  const int64_t bands = (pr.d1 + Tile::kBlockM - 1) / Tile::kBlockM;
  if (bands * p.d3_blocks > INT32_MAX || pr.batch > 65535)
    throw Error(ErrorKind::unsupported, "softmax_matmul on CUDA: batch=" + std::to_string(pr.batch) +
                                            " must be <= 65535 and d1 x d3 tiles fit a grid");
  const auto kernel = smm::softmax_matmul_kernel<T, kBlockD3, kExact>;
  const size_t smem = Tile::smem_bytes();
  TA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const dim3 grid(unsigned(bands * p.d3_blocks), unsigned(pr.batch));
  kernel<<<grid, Tile::kThreads, smem, static_cast<cudaStream_t>(pr.stream)>>>(p);
  TA_CUDA_CHECK_LAUNCH("softmax_matmul_kernel");
}

// Narrow outputs take a 64-column slice so a small d3 does not idle half the MMAs. fp32 exact
// mode keeps 128-column slices: its fp64 temporaries spill at 256.
template <class T, bool kExact>
void launch_width(const SoftmaxMatmulProblem& pr) {
  if (pr.d3 <= 64) return launch<T, 64, kExact>(pr);
  if constexpr (std::is_same_v<T, float> && kExact) return launch<T, 128, kExact>(pr);
  else return launch<T, 256, kExact>(pr);
}

}  // namespace

void softmax_matmul(const SoftmaxMatmulProblem& pr) {
  switch (pr.dtype) {
    case DType::f32:
      if (pr.fp32_mode == Fp32Mode::exact) return launch_width<float, true>(pr);
      return launch_width<float, false>(pr);
    case DType::f16: return launch_width<__half, false>(pr);
    case DType::bf16: return launch_width<__nv_bfloat16, false>(pr);
  }
}

size_t softmax_matmul_workspace_size(const SoftmaxMatmulProblem&) { return 0; }

}  // namespace tileattn::cuda
