#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>

#include "common/backend_plan.hpp"
#include "cuda/common/check.cuh"
#include "cuda/common/runtime_cache.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/softmax_matmul/softmax_matmul_kernel.cuh"
#include "cuda/softmax_matmul/smm_fast_f32_kernel_sm90.cuh"
#include "cuda/softmax_matmul/smm_kernel_sm90.cuh"
#include "cuda/arch/hopper_available.hpp"
#include "cuda/arch/tma_map.hpp"
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
  allow_dynamic_smem(kernel, int(smem));
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

// Parameters of a Hopper kernel whose blocks cover `block_rows` rows of X, `block_k` keys per
// stage and `cols` output columns; false when TMA cannot describe the inputs.
bool make_sm90_params(const SoftmaxMatmulProblem& pr, int block_rows, int block_k, int cols, smm::Sm90Params& p) {
  sm90::TileMapShape xs, vs;
  xs.dim = pr.d2, xs.rows = pr.d1, xs.heads = 1, xs.batch = pr.batch;
  xs.row_stride = pr.x_row_stride, xs.batch_stride = pr.x_batch_stride, xs.box_rows = block_rows;
  vs.dim = pr.d3, vs.rows = pr.d2, vs.heads = 1, vs.batch = pr.batch;
  vs.row_stride = pr.v_row_stride, vs.batch_stride = pr.v_batch_stride, vs.box_rows = block_k;
  if (!sm90::make_tile_map(&p.x, pr.dtype, pr.x, xs) || !sm90::make_tile_map(&p.v, pr.dtype, pr.v, vs)) return false;
  p.out = pr.out;
  p.out_batch_stride = pr.out_batch_stride, p.out_row_stride = pr.out_row_stride;
  p.d1 = int(pr.d1), p.d2 = int(pr.d2), p.d3 = int(pr.d3);
  p.d3_blocks = int((pr.d3 + cols - 1) / cols);
  return true;
}

// `cluster_rows` CTAs of neighbouring row bands form a cluster (the grid rounds the bands up).
template <class Kernel>
void launch_sm90_kernel(Kernel kernel, const smm::Sm90Params& p, const SoftmaxMatmulProblem& pr, int block_rows,
                        int threads, int smem, int cluster_rows = 1) {
  const int64_t bands = (pr.d1 + block_rows * cluster_rows - 1) / (block_rows * cluster_rows) * cluster_rows;
  if (bands * p.d3_blocks > INT32_MAX || pr.batch > 65535)
    throw Error(ErrorKind::unsupported, "softmax_matmul on CUDA: batch=" + std::to_string(pr.batch) +
                                            " must be <= 65535 and d1 x d3 tiles fit a grid");
  allow_dynamic_smem(kernel, smem);
  const dim3 grid(unsigned(bands * p.d3_blocks), unsigned(pr.batch));
  kernel<<<grid, threads, smem, static_cast<cudaStream_t>(pr.stream)>>>(p);
  TA_CUDA_CHECK_LAUNCH("softmax_matmul_kernel_sm90");
}

// The Hopper kernel (TMA + wgmma); false when it cannot run this problem here (not Hopper, the
// portable kernels forced, no sm_90a code in the build, or inputs TMA cannot describe).
template <class T, int N, bool kExact = false>
bool launch_sm90(const SoftmaxMatmulProblem& pr) {
  using Tile = smm::Sm90Tile<T, N, kExact>;
  const auto kernel = smm::softmax_matmul_kernel_sm90<T, N, kExact>;
  if (!sm90::has_sm90a_code(reinterpret_cast<const void*>(kernel))) return false;
  smm::Sm90Params p{};
  if (!make_sm90_params(pr, Tile::kBlockM, Tile::kBlockK, N, p)) return false;
  launch_sm90_kernel(kernel, p, pr, Tile::kBlockM, Tile::kThreads, Tile::kSmemBytes);
  return true;
}

// fp32 fast mode over more than 128 columns: the transposed kernel (no V transpose).
bool launch_sm90_fast_f32(const SoftmaxMatmulProblem& pr) {
  using Tile = smm::Sm90FastF32Tile;
  const auto kernel = smm::softmax_matmul_fast_f32_kernel_sm90;
  if (!sm90::has_sm90a_code(reinterpret_cast<const void*>(kernel))) return false;
  smm::Sm90Params p{};
  if (!make_sm90_params(pr, Tile::kBlockRows, Tile::kBlockK, Tile::kBlockCols, p)) return false;
  launch_sm90_kernel(kernel, p, pr, Tile::kBlockRows, Tile::kThreads, Tile::kSmemBytes, Tile::kCluster);
  return true;
}

// fp32 exact mode (split TF32, two accumulators per thread) takes at most 128 columns; fp32
// fast mode over 128 columns runs the transposed kernel, so no 256-column fp32 instance exists.
template <class T, bool kExact = false>
bool launch_sm90_width(const SoftmaxMatmulProblem& pr) {
  if (pr.batch == 0 || pr.d1 == 0 || pr.d2 == 0 || pr.d3 == 0 || !sm90::hopper_kernels_enabled()) return false;
  if (pr.d3 <= 64) return launch_sm90<T, 64, kExact>(pr);
  if (pr.d3 <= 128 || kExact) return launch_sm90<T, 128, kExact>(pr);
  if constexpr (std::is_same_v<T, float>) return launch_sm90_fast_f32(pr);
  else return launch_sm90<T, 256>(pr);
}

void run_softmax_matmul(const SoftmaxMatmulProblem& pr) {
  // fp32 exact mode runs split-TF32 products on Hopper, and its fp64 products elsewhere.
  const bool exact = pr.dtype == DType::f32 && pr.fp32_mode == Fp32Mode::exact;
  const bool done = exact                      ? launch_sm90_width<float, true>(pr)
                    : pr.dtype == DType::f32 ? launch_sm90_width<float>(pr)
                    : pr.dtype == DType::f16 ? launch_sm90_width<__half>(pr)
                                             : launch_sm90_width<__nv_bfloat16>(pr);
  if (done) return;
  switch (pr.dtype) {
    case DType::f32:
      if (pr.fp32_mode == Fp32Mode::exact) return launch_width<float, true>(pr);
      return launch_width<float, false>(pr);
    case DType::f16: return launch_width<__half, false>(pr);
    case DType::bf16: return launch_width<__nv_bfloat16, false>(pr);
  }
}

// The kernel choice depends only on the problem and is made in the run; no kernel needs scratch.
class SoftmaxMatmulPlan final : public detail::BackendPlan {
 public:
  explicit SoftmaxMatmulPlan(const SoftmaxMatmulProblem& problem) : problem_(problem) {}
  size_t workspace_size() const override { return 0; }
  const char* kernel_name() const override { return "softmax_matmul"; }
  void run(void*, size_t) const override { run_softmax_matmul(problem_); }

 private:
  SoftmaxMatmulProblem problem_;
};

}  // namespace

std::unique_ptr<detail::BackendPlan> plan_softmax_matmul(const SoftmaxMatmulProblem& problem) {
  return std::make_unique<SoftmaxMatmulPlan>(problem);
}

}  // namespace tileattn::cuda
