#include "kernels/reduce.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "kernels/cuda/cuda_ops.h"
#include "kernels/detail/convert.h"
#include "kernels/detail/dispatch.h"
#include "kernels/error.h"

namespace kernels::detail {
namespace {

// Integer sums and products wrap (two's complement): computed in the unsigned type, since signed
// overflow is undefined behaviour in C++. Floats are unchanged.
template <class C>
C wrap_add(C a, C b) {
  if constexpr (std::is_integral_v<C>) {
    using U = std::make_unsigned_t<C>;
    return static_cast<C>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  } else {
    return a + b;
  }
}
template <class C>
C wrap_mul(C a, C b) {
  if constexpr (std::is_integral_v<C>) {
    // uint8_t would promote to int; 255 * 255 still fits, so only wider types need U.
    using U = std::conditional_t<(sizeof(C) < sizeof(unsigned)), unsigned, std::make_unsigned_t<C>>;
    return static_cast<C>(static_cast<U>(a) * static_cast<U>(b));
  } else {
    return a * b;
  }
}

template <class T, class F>
void combine(T* acc, const T* src, int64_t n, F f) {
  using C = compute_t<T>;
  if constexpr (std::is_same_v<C, T>) {
    for (int64_t i = 0; i < n; ++i) acc[i] = static_cast<T>(f(acc[i], src[i]));
  } else {
    for (int64_t i = 0; i < n; ++i)
      acc[i] = cast_value<T>(static_cast<C>(f(cast_value<C>(acc[i]), cast_value<C>(src[i]))));
  }
}

#if defined(__SSE2__)
// bf16 on x86-64 (SSE2 is baseline): GCC vectorises the scalar loop of combine() for bf16, but
// its widening and narrowing take ~70 shuffles per 8 elements, 6x slower than f32. Here a bf16
// widens by interleaving 16 zero bits below it, 4 floats combine at a time, and the float rounds
// back to nearest even with bf16_from_float's integer trick, arithmetic-shifted so a signed
// saturating pack is exact. Results are bit-identical to the scalar loop (same float operations);
// a block of 8 whose result holds a NaN is redone by the scalar loop, which canonicalises NaN.
template <class V, class F>
void combine_bf16_sse2(BFloat16* acc, const BFloat16* src, int64_t n, V vf, F f) {
  const __m128i zero = _mm_setzero_si128();
  const __m128i one = _mm_set1_epi32(1);
  const __m128i bias = _mm_set1_epi32(0x7FFF);
  auto round = [&](__m128 x) {  // non-NaN floats -> bf16 codes, sign-extended to 32 bits
    const __m128i u = _mm_castps_si128(x);
    const __m128i lsb = _mm_and_si128(_mm_srli_epi32(u, 16), one);
    return _mm_srai_epi32(_mm_add_epi32(_mm_add_epi32(u, bias), lsb), 16);
  };
  auto scalar = [&](int64_t i) {
    acc[i] = cast_value<BFloat16>(f(cast_value<float>(acc[i]), cast_value<float>(src[i])));
  };
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(acc + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128 lo = vf(_mm_castsi128_ps(_mm_unpacklo_epi16(zero, a)),
                         _mm_castsi128_ps(_mm_unpacklo_epi16(zero, b)));
    const __m128 hi = vf(_mm_castsi128_ps(_mm_unpackhi_epi16(zero, a)),
                         _mm_castsi128_ps(_mm_unpackhi_epi16(zero, b)));
    if (_mm_movemask_ps(_mm_cmpunord_ps(lo, hi)) != 0) {
      for (int64_t j = i; j < i + 8; ++j) scalar(j);
      continue;
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(acc + i), _mm_packs_epi32(round(lo), round(hi)));
  }
  for (; i < n; ++i) scalar(i);
}

// The bf16 cases of cpu_reduce_into, with the same scalar operations as its generic code.
void reduce_bf16(BFloat16* acc, const BFloat16* src, int64_t n, ReduceOp op, double src_scale) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      if (src_scale != 1.0) {
        const float m = static_cast<float>(src_scale);
        const __m128 vm = _mm_set1_ps(m);
        return combine_bf16_sse2(
            acc, src, n, [vm](__m128 a, __m128 b) { return _mm_add_ps(a, _mm_mul_ps(b, vm)); },
            [m](float a, float b) { return a + b * m; });
      }
      return combine_bf16_sse2(
          acc, src, n, [](__m128 a, __m128 b) { return _mm_add_ps(a, b); },
          [](float a, float b) { return a + b; });
    case ReduceOp::kProd:
      return combine_bf16_sse2(
          acc, src, n, [](__m128 a, __m128 b) { return _mm_mul_ps(a, b); },
          [](float a, float b) { return a * b; });
    case ReduceOp::kMin:
      return combine_bf16_sse2(
          acc, src, n,
          [](__m128 a, __m128 b) {
            const __m128 take_b = _mm_or_ps(_mm_cmplt_ps(b, a), _mm_cmpunord_ps(b, b));
            return _mm_or_ps(_mm_and_ps(take_b, b), _mm_andnot_ps(take_b, a));
          },
          [](float a, float b) { return b < a || b != b ? b : a; });
    case ReduceOp::kMax:
      return combine_bf16_sse2(
          acc, src, n,
          [](__m128 a, __m128 b) {
            const __m128 take_b = _mm_or_ps(_mm_cmplt_ps(a, b), _mm_cmpunord_ps(b, b));
            return _mm_or_ps(_mm_and_ps(take_b, b), _mm_andnot_ps(take_b, a));
          },
          [](float a, float b) { return b > a || b != b ? b : a; });
  }
}
#endif

}  // namespace

void cpu_reduce_into(void* acc_ptr, const void* src_ptr, DType dtype, int64_t n, ReduceOp op,
                     double src_scale) {
#if defined(__SSE2__)
  if (dtype == DType::kBF16)
    return reduce_bf16(static_cast<BFloat16*>(acc_ptr), static_cast<const BFloat16*>(src_ptr), n, op,
                       src_scale);
#endif
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    using C = compute_t<T>;
    T* acc = static_cast<T*>(acc_ptr);
    const T* src = static_cast<const T*>(src_ptr);
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        if (src_scale != 1.0) {
          if constexpr (std::is_floating_point_v<C>) {
            const C m = static_cast<C>(src_scale);
            return combine(acc, src, n, [m](C a, C b) { return a + b * m; });
          } else {
            return combine(acc, src, n, [src_scale](C a, C b) {
              return wrap_add(a, cast_value<C>(static_cast<double>(b) * src_scale));
            });
          }
        }
        return combine(acc, src, n, [](C a, C b) { return wrap_add(a, b); });
      case ReduceOp::kProd:
        return combine(acc, src, n, [](C a, C b) { return wrap_mul(a, b); });
      // NaN propagates through min and max, as in torch.minimum / NCCL.
      case ReduceOp::kMin:
        return combine(acc, src, n, [](C a, C b) { return b < a || b != b ? b : a; });
      case ReduceOp::kMax:
        return combine(acc, src, n, [](C a, C b) { return b > a || b != b ? b : a; });
    }
  });
}

void cpu_scale(void* data, DType dtype, int64_t n, double factor) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    using C = compute_t<T>;
    T* d = static_cast<T*>(data);
    if constexpr (std::is_floating_point_v<C>) {
      const C f = static_cast<C>(factor);
      for (int64_t i = 0; i < n; ++i) d[i] = cast_value<T>(static_cast<C>(cast_value<C>(d[i]) * f));
    } else {
      // An average scales by 1/k: that factor is inexact in double, and so are int64 values
      // beyond 2^53 (2^60 + 3 would average to 2^60). When factor is exactly 1/k, divide in
      // integer arithmetic instead: the same truncation toward zero, exact for every value.
      const double k = std::nearbyint(1.0 / factor);
      if (k >= 1 && k <= 1e9 && 1.0 / k == factor) {
        const auto divisor = static_cast<int64_t>(k);
        for (int64_t i = 0; i < n; ++i) d[i] = static_cast<T>(static_cast<int64_t>(d[i]) / divisor);
      } else {
        for (int64_t i = 0; i < n; ++i) d[i] = cast_value<T>(static_cast<double>(d[i]) * factor);
      }
    }
  });
}

}  // namespace kernels::detail

namespace kernels {

namespace {
void check_pair(const char* what, const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || !(a.shape() == b.shape()) || !(a.device() == b.device()))
    throw InvalidArgument(std::string(what) + ": operands differ in dtype, shape or device (" +
                          std::string(to_string(a.dtype())) + " on " + to_string(a.device()) +
                          " vs " + std::string(to_string(b.dtype())) + " on " +
                          to_string(b.device()) + ")");
  if (!a.is_contiguous() || !b.is_contiguous())
    throw InvalidArgument(std::string(what) + ": operands must be contiguous");
}
}  // namespace

void reduce_into(const Tensor& acc, const Tensor& src, ReduceOp op, double src_scale) {
  check_pair("reduce_into", acc, src);
  if (src_scale != 1.0 && op != ReduceOp::kSum && op != ReduceOp::kAvg)
    throw InvalidArgument("reduce_into: a pre-multiplier needs a sum or avg, got " +
                          std::string(to_string(op)));
  if (acc.numel() == 0) return;
  if (acc.device().is_cuda()) {
    detail::cuda_reduce_into(acc.data_ptr(), src.data_ptr(), acc.dtype(), acc.numel(), op,
                             src_scale, acc.device().index);
    return;
  }
  detail::cpu_reduce_into(acc.data_ptr(), src.data_ptr(), acc.dtype(), acc.numel(), op, src_scale);
}

void scale_(const Tensor& t, double factor) {
  if (!t.is_contiguous()) throw InvalidArgument("scale_: tensor must be contiguous");
  if (t.numel() == 0) return;
  if (t.device().is_cuda()) {
    detail::cuda_scale(t.data_ptr(), t.dtype(), t.numel(), factor, t.device().index);
    return;
  }
  detail::cpu_scale(t.data_ptr(), t.dtype(), t.numel(), factor);
}

}  // namespace kernels
