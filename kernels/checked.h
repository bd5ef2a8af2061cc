// Checked int64 arithmetic for sizes, offsets, strides, element and byte counts and rank
// products. Every function either returns the exact result or throws InvalidArgument naming the
// operands, what they measure and the rule that failed, so a shape or mesh too large for int64
// is an error, never a wrapped value.
//   checked_mul(int64_t{1} << 40, 1 << 20, "element count")   // 2^60
//   checked_mul(int64_t{1} << 40, 1 << 30, "element count")
//     throws "element count overflows int64: 1099511627776 x 1073741824 > 9223372036854775807"
//   checked_ceil_div(9223372036854775807, 2, "chunk size")     // 4611686018427387904, no overflow
//   checked_product(Dims{0, int64_t{1} << 62, 8}, "element count")  // 0: a zero size wins
// Header-only and cheap on the success path (one __builtin_*_overflow per operation); the
// message is built only when throwing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>

#include "kernels/error.h"

namespace kernels {

inline constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

namespace detail {

[[noreturn]] [[gnu::cold]] [[gnu::noinline]] inline void throw_overflow(std::string_view what, int64_t a,
                                                                         char op, int64_t b) {
  std::string msg(what);
  msg += " overflows int64: ";
  msg += std::to_string(a);
  msg += op == '*' ? " x " : op == '+' ? " + " : " - ";
  msg += std::to_string(b);
  msg += op == '-' ? " < " : " > ";
  msg += op == '-' ? std::to_string(std::numeric_limits<int64_t>::min()) : std::to_string(kInt64Max);
  throw InvalidArgument(msg);
}

}  // namespace detail

inline int64_t checked_add(int64_t a, int64_t b, std::string_view what) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) detail::throw_overflow(what, a, '+', b);
  return r;
}

inline int64_t checked_sub(int64_t a, int64_t b, std::string_view what) {
  int64_t r;
  if (__builtin_sub_overflow(a, b, &r)) detail::throw_overflow(what, a, '-', b);
  return r;
}

inline int64_t checked_mul(int64_t a, int64_t b, std::string_view what) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) detail::throw_overflow(what, a, '*', b);
  return r;
}

// ceil(a / b) without forming a + b - 1. REQUIRES: a >= 0, b >= 1 (InvalidArgument otherwise).
inline int64_t checked_ceil_div(int64_t a, int64_t b, std::string_view what) {
  if (a < 0 || b < 1)
    throw InvalidArgument(std::string(what) + ": ceil(" + std::to_string(a) + " / " + std::to_string(b) +
                          ") needs a dividend >= 0 and a divisor >= 1");
  return a / b + (a % b != 0);
}

// Product of sizes (each >= 0). A zero entry makes the product 0 even when the others alone
// would overflow (a tensor with a zero-size dim holds nothing), as torch.empty((0, 2**62, 8)).
inline int64_t checked_product(std::span<const int64_t> sizes, std::string_view what) {
  for (int64_t s : sizes)
    if (s == 0) return 0;
  int64_t p = 1;
  for (int64_t s : sizes) p = checked_mul(p, s, what);
  return p;
}

// Bytes of `count` elements of `itemsize` bytes, as int64 (so byte counts stay comparable with
// element counts and offsets). REQUIRES: count >= 0.
inline int64_t checked_bytes(int64_t count, size_t itemsize, std::string_view what) {
  return checked_mul(count, static_cast<int64_t>(itemsize), what);
}

// `value` narrowed to int when it fits, else InvalidArgument naming it and `what`.
inline int checked_int(int64_t value, std::string_view what) {
  if (value < std::numeric_limits<int>::min() || value > std::numeric_limits<int>::max())
    throw InvalidArgument(std::string(what) + " " + std::to_string(value) + " is out of range (expected " +
                          std::to_string(std::numeric_limits<int>::min()) + ".." +
                          std::to_string(std::numeric_limits<int>::max()) + ")");
  return static_cast<int>(value);
}

}  // namespace kernels
