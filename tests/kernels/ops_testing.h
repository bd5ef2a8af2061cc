// Helpers of the compute-kernel tests (tests/kernels/*_ops_test.cpp): deterministic inputs as a
// function of (seed, index), the same values in other memory layouts (transposed storage, a
// window of a padded tensor, all dims reversed), and element-wise comparison with an f64
// reference that reports the first mismatch.
#pragma once

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/format.h"
#include "kernels/tensor.h"

namespace ops_testing {

using kernels::Dims;
using kernels::DType;
using kernels::Tensor;

// A value in [lo, hi) from (seed, i): splitmix64, so every element is reproducible alone.
inline double hash_uniform(uint64_t seed, uint64_t i, double lo, double hi) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + i + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return lo + (hi - lo) * static_cast<double>(z >> 11) / 9007199254740992.0;
}

// A contiguous tensor of `dtype` whose element i (row-major) is hash_uniform(seed, i, lo, hi),
// rounded to dtype.
inline Tensor random_tensor(const Dims& shape, DType dtype, uint64_t seed, double lo = -1.0,
                            double hi = 1.0) {
  std::vector<double> v(static_cast<size_t>(shape.product()));
  for (size_t i = 0; i < v.size(); ++i) v[i] = hash_uniform(seed, i, lo, hi);
  return Tensor::from_vector(v, shape, dtype);
}

inline constexpr int kLayouts = 4;
inline const char* layout_name(int kind) {
  switch (kind) {
    case 0:
      return "contiguous";
    case 1:
      return "transposed storage";
    case 2:
      return "padded window";
    default:
      return "reversed dims";
  }
}

// The values of t in a view of layout `kind`: 0 contiguous; 1 the last two dims swapped in
// memory (a transpose view); 2 a narrowed window of a larger tensor (every stride padded);
// 3 every dim's order reversed in memory (a permute view). Fills padding with NaN-free junk.
inline Tensor relayout(const Tensor& t, int kind) {
  const int nd = t.ndim();
  if (kind == 0 || nd == 0) return t.contiguous().clone();
  if (kind == 1 && nd >= 2) {
    Tensor s = Tensor::empty(t.transpose(-1, -2).shape(), t.dtype(), t.device());
    s.copy_(t.transpose(-1, -2));
    return s.transpose(-1, -2);
  }
  if (kind == 3 && nd >= 2) {
    Dims rev;
    for (int d = nd - 1; d >= 0; --d) rev.push_back(d);
    Tensor s = Tensor::empty(t.permute(rev).shape(), t.dtype(), t.device());
    s.copy_(t.permute(rev));
    return s.permute(rev);
  }
  Dims big = t.shape();
  for (int d = 0; d < nd; ++d) big[d] += d == nd - 1 ? 3 : 2;
  Tensor s = Tensor::full(big, 7.25, t.dtype(), t.device());
  Tensor v = s;
  for (int d = 0; d < nd; ++d) v = v.narrow(d, 1, t.size(d));
  v.copy_(t);
  return v;
}

// Checks every element of `actual` (any dtype, row-major) against `expected` with
// |a - e| <= atol + rtol * |e| (NaN matches NaN, infinities must be equal); on failure reports
// the first bad index, both values, and `what`.
inline void check_close(const Tensor& actual, const std::vector<double>& expected, double rtol,
                        double atol, const std::string& what) {
  const std::vector<double> a = actual.to_vector();
  INFO(what);
  REQUIRE(a.size() == expected.size());
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = a[i], e = expected[i];
    bool ok;
    if (std::isnan(e)) {
      ok = std::isnan(x);
    } else if (std::isinf(e)) {
      ok = x == e;
    } else {
      ok = std::fabs(x - e) <= atol + rtol * std::fabs(e);
    }
    if (!ok) {
      FAIL_CHECK("element " << i << " of " << a.size() << ": got " << x << ", expected " << e
                            << " (rtol " << rtol << ", atol " << atol << ")");
      return;
    }
  }
  SUCCEED();
}

inline void check_close(const Tensor& actual, const Tensor& expected, double rtol, double atol,
                        const std::string& what) {
  INFO("shape " << fmt::format("{}", actual.shape()) << " vs "
                << fmt::format("{}", expected.shape()));
  REQUIRE(actual.shape() == expected.shape());
  check_close(actual, expected.to_vector(), rtol, atol, what);
}

// Tolerances of a result rounded to `dtype` after f32 (or f64) arithmetic over `terms` terms.
struct Tol {
  double rtol, atol;
};
inline Tol tol_for(DType dtype, double terms = 1) {
  switch (dtype) {
    case DType::kF64:
      return {1e-12, 1e-12 * terms};
    case DType::kF32:
      return {2e-5, 2e-6 * terms};
    case DType::kBF16:
      return {1e-2, 1e-2 + 2e-6 * terms};
    case DType::kF16:
      return {2e-3, 1e-3 + 2e-6 * terms};
    default:
      return {0, 0};
  }
}

inline DType stats_dtype_of(DType dtype) {
  return dtype == DType::kF64 ? DType::kF64 : DType::kF32;
}

inline const std::vector<DType>& float_dtypes() {
  static const std::vector<DType> d = {DType::kF32, DType::kF64, DType::kBF16, DType::kF16};
  return d;
}

inline std::string describe(const Tensor& t) {
  return fmt::format("{} {} strides {}", kernels::to_string(t.dtype()), t.shape(), t.strides());
}

}  // namespace ops_testing
