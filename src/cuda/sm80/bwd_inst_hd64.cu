// Backward kernels for head dims up to 64, fp16 and bf16 (when the build includes bucket 64).
#include "cuda/sm80/bwd_launch.cuh"

#if TILEATTN_BWD_HAS_HEADDIM(64)
namespace tileattn::cuda::bwd {
template void launch_backward<__half, 64>(const BwdParams&, cudaStream_t);
template void launch_backward<__nv_bfloat16, 64>(const BwdParams&, cudaStream_t);
}  // namespace tileattn::cuda::bwd
#endif
