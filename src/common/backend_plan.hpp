#pragma once
// What a backend decides for one call, made once and shared by the workspace query and the run:
// the kernel, its grid and split count, the workspace it needs and (on Hopper) the tensor maps.
// A plan holds the validated problem's pointers, so it belongs to the tensors it was made for.
#include <cstddef>

namespace tileattn::detail {

class BackendPlan {
 public:
  virtual ~BackendPlan() = default;
  // Scratch the run needs, in bytes, in the problem's memory space (0 when none).
  virtual size_t workspace_size() const = 0;
  // Runs on the problem's stream. `workspace` holds at least workspace_size() bytes, or is
  // nullptr and the backend allocates (stream-ordered on CUDA).
  virtual void run(void* workspace, size_t workspace_bytes) const = 0;
  // The kernel family that runs ("sm90", "sm80", "fp32", "cpu"): for tests and benchmark labels.
  virtual const char* kernel_name() const = 0;
};

}  // namespace tileattn::detail
