// Backward kernels for head dims up to 256, fp16 and bf16 (when the build includes bucket 256).
#include "cuda/sm80/bwd_launch.cuh"

#if TILEATTN_BWD_HAS_HEADDIM(256)
namespace tileattn::cuda::bwd {
template void launch_backward<__half, 256>(const BwdParams&, cudaStream_t);
template void launch_backward<__nv_bfloat16, 256>(const BwdParams&, cudaStream_t);
}  // namespace tileattn::cuda::bwd
#endif
