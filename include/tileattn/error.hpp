#pragma once
// Every failure tileattn reports is a tileattn::Error. `kind` lets bindings map it onto their
// own exception types (Python: ValueError / TypeError / RuntimeError) without parsing text.
#include <stdexcept>
#include <string>

namespace tileattn {

enum class ErrorKind {
  invalid_argument,  // a shape, stride, option or value breaks a rule of the API
  invalid_type,      // a dtype (or dtype mix) the API does not accept
  unsupported,       // valid, but this backend or build cannot run it
  device,            // a CUDA call failed, or the requested backend is absent
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const noexcept { return kind_; }

 private:
  ErrorKind kind_;
};

}  // namespace tileattn
