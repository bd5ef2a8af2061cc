// Exception types shared by every layer. User mistakes raise InvalidArgument or Unsupported with
// a message naming the offending value and what was expected; CommError is for transports;
// InternalError means a bug in this library.
#pragma once

#include <stdexcept>
#include <string>

namespace kernels {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct InvalidArgument : Error {
  using Error::Error;
};
struct Unsupported : Error {
  using Error::Error;
};
struct CommError : Error {
  using Error::Error;
};
struct InternalError : Error {
  using Error::Error;
};

}  // namespace kernels
