// Exception types shared by every layer. User mistakes raise InvalidArgument or Unsupported with
// a message naming the offending value and what was expected; ResourceError is for memory (or
// other resources) the machine cannot give, naming the amount asked for; CommError is for
// transports; InternalError means a bug in this library; NonFiniteError is a computed value
// that had to be finite and is not (a NaN or infinite gradient norm: a diverged training).
// Programs map them to exit codes (1 NonFiniteError, 2 InvalidArgument/Unsupported,
// 3 ResourceError, 4 CommError; program/main.h).
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

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
struct ResourceError : Error {
  using Error::Error;
};
struct CommError : Error {
  using Error::Error;
};
struct InternalError : Error {
  using Error::Error;
};
struct NonFiniteError : Error {
  using Error::Error;
};

// User text quoted in an error message, cut when long so the message stays readable (and one
// line: newlines become spaces):
//   clip("[[0,1],[2,3]]") == "[[0,1],[2,3]]"
//   clip(a 100000-character mesh) == "[[0,1,2,3,4,5,6,7,8,9,10,11,12,13,1...(100000 chars)...,99999]]"
inline std::string clip(std::string_view text, size_t max = 80) {
  std::string out;
  if (text.size() <= max) {
    out = text;
  } else {
    const size_t tail = max / 5, head = max - tail;
    out = std::string(text.substr(0, head)) + "...(" + std::to_string(text.size()) + " chars)..." +
          std::string(text.substr(text.size() - tail));
  }
  for (char& c : out)
    if (c == '\n' || c == '\r') c = ' ';
  return out;
}

}  // namespace kernels
