// Backward kernels for head dims up to 128, fp16 and bf16 (when the build includes bucket 128).
#include "cuda/sm80/bwd_launch.cuh"

#if TILEATTN_BWD_HAS_HEADDIM(128)
namespace tileattn::cuda::bwd {
template void launch_backward<__half, 128>(const BwdParams&, cudaStream_t);
template void launch_backward<__nv_bfloat16, 128>(const BwdParams&, cudaStream_t);
}  // namespace tileattn::cuda::bwd
#endif
