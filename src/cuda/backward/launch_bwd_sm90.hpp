#pragma once
// The sm90 backward: the 16-bit kernels (head-dim buckets up to 256) and the fp32 ones (buckets 32
// and 64: TF32 in fast mode, split TF32 in exact mode), each preprocess, dK/dV and dQ.
// Instantiated per (dtype, bucket) by generated translation units (see src/cuda/CMakeLists.txt);
// the host pieces they share are in launch_bwd_sm90.cpp.
#include <cuda_runtime.h>

#include "cuda/backward/bwd_params_sm90.hpp"
#include "cuda/common/bwd_params.hpp"
#include "tileattn/problem.hpp"

namespace tileattn::cuda {

// Tensor maps of Q, K, V and dO in the problem's dtype (boxes of box_rows rows); false when TMA
// cannot describe one (the sm80 kernels run).
bool make_bwd_sm90_maps(const AttentionProblem& problem, BwdSm90Params& params, int box_rows = kBwdBoxRows);

// False when the problem has nothing to compute; throws where the kernels' grids cannot hold it.
bool bwd_sm90_has_work(const bwd::BwdParams& params);

template <class T, int kHeadDim>
struct BwdSm90 {
  // params.bwd as for the sm80 kernels, without the dQ accumulator.
  static void run(const BwdSm90Params& params, cudaStream_t stream);
  // Keys a block where the kernel can add dQ in params.bwd.dq_order's fixed order; 0 where it cannot.
  static int ordered_dq_block_n();
};

// fp32: fast mode's TF32 products (run; dQ in its own pass, no accumulator) and exact mode's split
// TF32 (run_exact: statistics, dK, dV and dQ passes, tensor maps with boxes of kBwdExactBoxRows
// rows). Where kExactSumsDq, exact mode sums dQ in the dK pass when given the accumulator.
template <int kHeadDim>
struct BwdTf32Sm90 {
  static constexpr bool kExactSumsDq = kHeadDim == 64;
  static void run(const BwdSm90Params& params, cudaStream_t stream);
  static void run_exact(const BwdSm90Params& params, cudaStream_t stream);
};

}  // namespace tileattn::cuda
