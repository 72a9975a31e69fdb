#pragma once
// What the CUDA runtime answers that cannot change within a process, asked once: a device's
// properties, a kernel's binary version, and its opt-in to more than 48 KiB of dynamic shared
// memory. Each query costs a microsecond or so of host time, as much as a short call's launch; a
// call makes several.
// (A cudaDeviceReset drops the opt-ins; the library does not expect one between calls.)
namespace tileattn::cuda {

struct DeviceProps {
  int major = 0, minor = 0;  // compute capability
  int sms = 0;               // multiprocessors
  int smem_optin = 0;        // shared memory per block a kernel may opt into, bytes
};

// The current device's.
const DeviceProps& device_props();

// cudaFuncAttributes::binaryVersion of `kernel` (a __global__ function's address) on the current
// device: the architecture of the code it runs there, e.g. 90 for sm_90a.
int kernel_binary_version(const void* kernel);

// cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) on the current
// device, unless an earlier call there already allowed at least `bytes`.
void allow_dynamic_smem(const void* kernel, int bytes);

template <class Kernel>
void allow_dynamic_smem(Kernel* kernel, int bytes) {
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), bytes);
}

}  // namespace tileattn::cuda
