#pragma once
// What every entry point asks before validating a problem: which backend runs it (`automatic`
// follows the memory the data lives in), whether that backend is present, and whether each
// pointer is that backend's memory. The only place the host layer asks the CUDA runtime.
#include "tileattn/problem.hpp"

namespace tileattn::host {

// An explicit choice (or an invalid enum value, which validation rejects) passes through.
Backend resolve(Backend requested, const void* data);

// Throws ErrorKind::device for backend=cuda without a visible device or a CUDA build; validation
// rejects every other invalid value.
void check_backend_present(Backend backend);

// The memory `p` points at must be the backend's (null, or a backend validation rejects, passes).
void check_memory_space(const void* p, const char* name, Backend backend);

}  // namespace tileattn::host
