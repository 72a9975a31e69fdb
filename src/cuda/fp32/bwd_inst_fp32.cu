// fp32 backward: the sm80 backward kernels with scalar-FMA products (exact fp32), every bucket.
#include "cuda/sm80/bwd_launch.cuh"

namespace tileattn::cuda::bwd {
template void launch_backward<float, 32>(const BwdParams&, cudaStream_t);
template void launch_backward<float, 64>(const BwdParams&, cudaStream_t);
template void launch_backward<float, 96>(const BwdParams&, cudaStream_t);
template void launch_backward<float, 128>(const BwdParams&, cudaStream_t);
template void launch_backward<float, 192>(const BwdParams&, cudaStream_t);
template void launch_backward<float, 256>(const BwdParams&, cudaStream_t);
}  // namespace tileattn::cuda::bwd
