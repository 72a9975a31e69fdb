// fp32 backward: the sm80 backward kernels with scalar-FMA products (exact fp32), per bucket.
#include "cuda/sm80/bwd_launch.cuh"

namespace tileattn::cuda::bwd {
#if TILEATTN_BWD_HAS_HEADDIM(32)
template void launch_backward<float, 32>(const BwdParams&, cudaStream_t);
#endif
#if TILEATTN_BWD_HAS_HEADDIM(64)
template void launch_backward<float, 64>(const BwdParams&, cudaStream_t);
#endif
#if TILEATTN_BWD_HAS_HEADDIM(96)
template void launch_backward<float, 96>(const BwdParams&, cudaStream_t);
#endif
#if TILEATTN_BWD_HAS_HEADDIM(128)
template void launch_backward<float, 128>(const BwdParams&, cudaStream_t);
#endif
#if TILEATTN_BWD_HAS_HEADDIM(192)
template void launch_backward<float, 192>(const BwdParams&, cudaStream_t);
#endif
#if TILEATTN_BWD_HAS_HEADDIM(256)
template void launch_backward<float, 256>(const BwdParams&, cudaStream_t);
#endif
}  // namespace tileattn::cuda::bwd
