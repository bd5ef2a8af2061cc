// Dims: a small fixed-capacity list of int64 (shapes, strides, coordinates, index lists of up
// to kMaxDims entries). No heap allocation; value semantics; usable like a std::vector.
//   Dims s{4, 3};  s.push_back(2);  s.size() == 3;  s[1] == 3;  s == Dims{4, 3, 2}
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/checked.h"
#include "kernels/error.h"

namespace kernels {

inline constexpr int kMaxDims = 8;

class Dims {
 public:
  Dims() = default;
  Dims(std::initializer_list<int64_t> v) { assign(v.begin(), v.end()); }
  explicit Dims(std::span<const int64_t> v) { assign(v.begin(), v.end()); }
  explicit Dims(const std::vector<int64_t>& v) { assign(v.begin(), v.end()); }
  // n copies of value.
  static Dims filled(int n, int64_t value) {
    Dims d;
    for (int i = 0; i < n; ++i) d.push_back(value);
    return d;
  }

  int size() const { return n_; }
  bool empty() const { return n_ == 0; }
  int64_t& operator[](int i) { return v_[i]; }
  int64_t operator[](int i) const { return v_[i]; }
  int64_t* begin() { return v_.data(); }
  int64_t* end() { return v_.data() + n_; }
  const int64_t* begin() const { return v_.data(); }
  const int64_t* end() const { return v_.data() + n_; }
  const int64_t* data() const { return v_.data(); }
  int64_t back() const { return v_[n_ - 1]; }

  void push_back(int64_t x) {
    if (n_ == kMaxDims) throw InvalidArgument("too many dims: at most 8 are supported");
    v_[n_++] = x;
  }
  void pop_back() { --n_; }
  void resize(int n, int64_t value = 0) {
    if (n < 0 || n > kMaxDims) throw InvalidArgument("too many dims: at most 8 are supported");
    for (int i = n_; i < n; ++i) v_[i] = value;
    n_ = n;
  }
  void erase(int i) {
    std::copy(v_.begin() + i + 1, v_.begin() + n_, v_.begin() + i);
    --n_;
  }
  void insert(int i, int64_t x) {
    if (n_ == kMaxDims) throw InvalidArgument("too many dims: at most 8 are supported");
    std::copy_backward(v_.begin() + i, v_.begin() + n_, v_.begin() + n_ + 1);
    v_[i] = x;
    ++n_;
  }
  // Product of the entries (1 for an empty list; 0 when an entry is 0). Throws
  // InvalidArgument when it overflows int64 (kernels/checked.h).
  int64_t product() const {
    int64_t p = 1;
    bool overflow = false;
    for (int i = 0; i < n_; ++i) overflow |= __builtin_mul_overflow(p, v_[i], &p);
    if (!overflow) return p;  // exact (a zero entry gives 0)
    for (int i = 0; i < n_; ++i)
      if (v_[i] == 0) return 0;  // overflowed before a zero entry: still 0
    throw_product_overflow();
  }
  std::vector<int64_t> vec() const { return {begin(), end()}; }

  friend bool operator==(const Dims& a, const Dims& b) {
    return a.n_ == b.n_ && std::equal(a.begin(), a.end(), b.begin());
  }

 private:
  [[noreturn]] [[gnu::cold]] [[gnu::noinline]] void throw_product_overflow() const {
    std::string msg = "the product of [";
    for (int i = 0; i < n_; ++i) {
      if (i) msg += ',';
      msg += std::to_string(v_[i]);
    }
    msg += "] (an element or rank count) overflows int64 (at most ";
    msg += std::to_string(kInt64Max);
    msg += ')';
    throw InvalidArgument(msg);
  }
  template <class It>
  void assign(It first, It last) {
    for (; first != last; ++first) push_back(static_cast<int64_t>(*first));
  }
  std::array<int64_t, kMaxDims> v_{};
  int n_ = 0;
};

// A shape written as sizes >= 0 separated by ',' or 'x' ("13,2", "4x8x2"; "" is the 0-d shape),
// as programs take it on their command lines. Throws InvalidArgument naming `what` and the text:
//   parse_shape("13,2") == Dims{13, 2}
//   parse_shape("4,,3", "--shape")  // "--shape '4,,3' is malformed at '': expected ..."
Dims parse_shape(std::string_view text, std::string_view what = "shape");

}  // namespace kernels
