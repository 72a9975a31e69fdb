#include "host/dispatch.hpp"

#include <string>

#include "tileattn/error.hpp"

#ifdef TILEATTN_WITH_CUDA
#include "cuda/cuda_backend.hpp"
#endif

namespace tileattn::host {

Backend resolve(Backend requested, const void* data) {
  if (requested != Backend::automatic) return requested;
#ifdef TILEATTN_WITH_CUDA
  if (data != nullptr && cuda::is_device_pointer(data)) return Backend::cuda;
#else
  (void)data;
#endif
  return Backend::cpu;
}

void check_backend_present(Backend backend) {
  if (backend != Backend::cuda) return;
#ifdef TILEATTN_WITH_CUDA
  if (!cuda::device_available()) throw Error(ErrorKind::device, "backend=cuda requested, but no CUDA device is visible");
#else
  throw Error(ErrorKind::device,
              "backend=cuda requested, but this build of tileattn has no CUDA backend (configure with -DTILEATTN_CUDA=ON)");
#endif
}

void check_memory_space(const void* p, const char* name, Backend backend) {
#ifdef TILEATTN_WITH_CUDA
  if (p == nullptr || (backend != Backend::cpu && backend != Backend::cuda)) return;
  const bool on_device = cuda::is_device_pointer(p);
  if (backend == Backend::cuda && !on_device)
    throw Error(ErrorKind::invalid_argument,
                std::string(name) + " is not memory of the current CUDA device, but backend=cuda needs device memory");
  if (backend == Backend::cpu && on_device)
    throw Error(ErrorKind::invalid_argument, std::string(name) + " is device memory, but backend=cpu needs host memory");
#else
  (void)p, (void)name, (void)backend;
#endif
}

}  // namespace tileattn::host
