// Backward kernels for head dims up to 96, fp16 and bf16 (when the build includes bucket 96).
#include "cuda/sm80/bwd_launch.cuh"

#if TILEATTN_BWD_HAS_HEADDIM(96)
namespace tileattn::cuda::bwd {
template void launch_backward<__half, 96>(const BwdParams&, cudaStream_t);
template void launch_backward<__nv_bfloat16, 96>(const BwdParams&, cudaStream_t);
}  // namespace tileattn::cuda::bwd
#endif
