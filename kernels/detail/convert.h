// Internal: element conversions shared bit for bit by the CPU copy (kernels/cpu/copy.cpp), the
// public bit functions (kernels/dtype.cpp) and the CUDA kernels (kernels/cuda/cuda_ops.cu).
// Plain C++ that nvcc also compiles as __host__ __device__; no fmt, no Eigen, no CUDA headers.
//
// NOTE [cast rules] A value goes through one of three intermediates: int64 (i32, i64, u8 sources),
// double (f64) or float (f32 and the narrow floats), then into the destination type:
//   - integer -> floating: through double (then float, then the narrow format if needed);
//   - floating -> integer: through double, truncated toward zero to int64 (NaN -> 0, saturating at
//     the int64 range), then wrapped to the destination width (so -1.0 -> u8 255, like PyTorch);
//   - floating -> narrow float: through float, rounded to nearest, ties to even;
//   - NaN -> another floating dtype: that dtype's quiet NaN with the same sign (payload dropped);
//   - integer -> integer: wraps modulo 2^bits (C++20 conversion);
//   - same dtype: bits copied unchanged (NaN payloads included).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/dtype.h"

#if defined(__CUDACC__)
#define KERNELS_HD __host__ __device__ __forceinline__
#else
#define KERNELS_HD inline
#endif

namespace kernels::detail {

KERNELS_HD uint32_t float_as_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}

KERNELS_HD float bits_as_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}

KERNELS_HD uint64_t double_as_bits(double x) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint64_t>(__double_as_longlong(x));
#else
  uint64_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}

KERNELS_HD double bits_as_double(uint64_t u) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(u));
#else
  double x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}

// f64 <-> f32 with NaN made explicit: the canonical quiet NaN with the input's sign (CPUs keep
// NaN payloads and GPUs return one fixed NaN, so leaving it to the hardware is not portable).
KERNELS_HD float double_to_float(double v) {
  if (v != v) {
    return bits_as_float((static_cast<uint32_t>(double_as_bits(v) >> 32) & 0x80000000u) |
                         0x7fc00000u);
  }
  return static_cast<float>(v);
}
KERNELS_HD double float_to_double(float v) {
  if (v != v) {
    return bits_as_double((static_cast<uint64_t>(float_as_bits(v) & 0x80000000u) << 32) |
                          0x7ff8000000000000ull);
  }
  return static_cast<double>(v);
}

// float -> a binary format with kMBits mantissa bits and exponent bias kBias, round to nearest,
// ties to even. The result is a magnitude code with the sign at bit kSignBit. Codes above
// kMaxFinite (after rounding) and infinite inputs give kOverflow; NaN gives kNaN; signs are kept.
//   encode_narrow<10, 15, 0x7BFF, 0x7C00, 0x7E00, 15>(1.0f) == 0x3C00   (f16)
template <int kMBits, int kBias, uint32_t kMaxFinite, uint32_t kOverflow, uint32_t kNaN,
          int kSignBit>
KERNELS_HD uint32_t encode_narrow(float x) {
  const uint32_t u = float_as_bits(x);
  const uint32_t sign = (u >> 31) << kSignBit;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | kNaN;
  if (a == 0x7f800000u) return sign | kOverflow;
  if (a == 0) return sign;
  // value = m * 2^(exp - 23) with m < 2^24 (float subnormals: biased exponent 1, no implicit bit).
  int biased = static_cast<int>(a >> 23);
  uint32_t m = a & 0x7fffffu;
  if (biased == 0) {
    biased = 1;
  } else {
    m |= 0x800000u;
  }
  const int exp = biased - 127;
  constexpr int kEMin = 1 - kBias;  // exponent of the smallest normal of the target
  int shift = 23 - kMBits;
  int base_exp = exp;
  if (exp < kEMin) {  // target subnormal: fewer mantissa bits survive
    shift += kEMin - exp;
    base_exp = kEMin;
  }
  if (shift >= 25) return sign;  // below half the smallest subnormal (m < 2^24): rounds to zero
  uint32_t q = m >> shift;
  const uint32_t rest = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rest > half || (rest == half && (q & 1u))) ++q;
  // q carries the implicit bit as one exponent step, so the rounding carry propagates naturally
  // into the exponent field (largest subnormal -> smallest normal, 1.111.. -> next binade).
  const uint64_t code = (static_cast<uint64_t>(base_exp + kBias - 1) << kMBits) + q;
  if (code > kMaxFinite) return sign | kOverflow;
  return sign | static_cast<uint32_t>(code);
}

// A kBits-wide code (kMBits mantissa bits, bias kBias) -> float, exactly. kHasInf: the all-ones
// exponent holds inf/NaN (IEEE-like); otherwise only the all-ones code is NaN (e4m3fn).
template <int kBits, int kMBits, int kBias, bool kHasInf>
KERNELS_HD float decode_narrow(uint32_t bits) {
  constexpr int kEBits = kBits - 1 - kMBits;
  constexpr uint32_t kMMask = (1u << kMBits) - 1u;
  constexpr uint32_t kEMax = (1u << kEBits) - 1u;
  const uint32_t sign = ((bits >> (kBits - 1)) & 1u) << 31;
  const uint32_t e = (bits >> kMBits) & kEMax;
  uint32_t m = bits & kMMask;
  uint32_t out;
  if (e == kEMax && (kHasInf || m == kMMask)) {
    out = (kHasInf && m == 0) ? 0x7f800000u : (0x7fc00000u | (m << (23 - kMBits)));
  } else if (e == 0) {
    if (m == 0) {
      out = 0;
    } else {  // subnormal: normalise (always a normal float for these formats)
      int exp = 1 - kBias;
      while (!(m & (1u << kMBits))) {
        m <<= 1;
        --exp;
      }
      out = (static_cast<uint32_t>(exp + 127) << 23) | ((m & kMMask) << (23 - kMBits));
    }
  } else {
    out = ((e - kBias + 127) << 23) | (m << (23 - kMBits));
  }
  return bits_as_float(sign | out);
}

// Same results as encode_narrow<7, 127, 0x7F7F, 0x7F80, 0x7FC0, 15> (bf16 is a truncated float,
// so adding the rounding bias to the raw bits rounds to nearest even, carries into the exponent
// and overflows to inf by itself), but branch-free enough for the compiler to vectorise.
KERNELS_HD uint16_t bf16_from_float(float x) {
  const uint32_t u = float_as_bits(x);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = ((u >> 16) & 0x8000u) | 0x7FC0u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}
KERNELS_HD uint16_t f16_from_float(float x) {
  return static_cast<uint16_t>(encode_narrow<10, 15, 0x7BFF, 0x7C00, 0x7E00, 15>(x));
}
// e4m3fn: values that round past 448 (|x| > 464) and infinities -> NaN 0x7F, as PyTorch.
KERNELS_HD uint8_t f8e4m3_from_float(float x) {
  return static_cast<uint8_t>(encode_narrow<3, 7, 0x7E, 0x7F, 0x7F, 7>(x));
}
// e5m2: overflow -> inf 0x7C; NaN -> 0x7F, as PyTorch.
KERNELS_HD uint8_t f8e5m2_from_float(float x) {
  return static_cast<uint8_t>(encode_narrow<2, 15, 0x7B, 0x7C, 0x7F, 7>(x));
}
KERNELS_HD float bf16_to_float(uint16_t bits) {
  return bits_as_float(static_cast<uint32_t>(bits) << 16);
}
KERNELS_HD float f16_to_float(uint16_t bits) { return decode_narrow<16, 10, 15, true>(bits); }
KERNELS_HD float f8e4m3_to_float(uint8_t bits) { return decode_narrow<8, 3, 7, false>(bits); }
KERNELS_HD float f8e5m2_to_float(uint8_t bits) { return decode_narrow<8, 2, 15, true>(bits); }

// ---- element casts (NOTE [cast rules]) ----

KERNELS_HD float widen(float v) { return v; }
KERNELS_HD double widen(double v) { return v; }
KERNELS_HD int64_t widen(int32_t v) { return v; }
KERNELS_HD int64_t widen(int64_t v) { return v; }
KERNELS_HD int64_t widen(uint8_t v) { return v; }
KERNELS_HD float widen(BFloat16 v) { return bf16_to_float(v.bits); }
KERNELS_HD float widen(Half v) { return f16_to_float(v.bits); }
KERNELS_HD float widen(Float8E4M3 v) { return f8e4m3_to_float(v.bits); }
KERNELS_HD float widen(Float8E5M2 v) { return f8e5m2_to_float(v.bits); }

// Truncation toward zero with NaN -> 0 and saturation (a plain cast is undefined out of range).
KERNELS_HD int64_t truncate_to_int64(double v) {
  if (!(v == v)) return 0;
  if (v >= 9223372036854775808.0) return INT64_MAX;
  if (v <= -9223372036854775808.0) return INT64_MIN;
  return static_cast<int64_t>(v);
}

template <class V>
KERNELS_HD float to_float(V v) {
  if constexpr (std::is_integral_v<V>) {
    return static_cast<float>(static_cast<double>(v));
  } else if constexpr (std::is_same_v<V, double>) {
    return double_to_float(v);
  } else {
    return v;
  }
}

// V is one of the intermediates int64_t, double, float.
template <class D, class V>
KERNELS_HD D narrow_to(V v) {
  if constexpr (std::is_same_v<D, BFloat16>) {
    return BFloat16{bf16_from_float(to_float(v))};
  } else if constexpr (std::is_same_v<D, Half>) {
    return Half{f16_from_float(to_float(v))};
  } else if constexpr (std::is_same_v<D, Float8E4M3>) {
    return Float8E4M3{f8e4m3_from_float(to_float(v))};
  } else if constexpr (std::is_same_v<D, Float8E5M2>) {
    return Float8E5M2{f8e5m2_from_float(to_float(v))};
  } else if constexpr (std::is_integral_v<D>) {
    if constexpr (std::is_integral_v<V>) {
      return static_cast<D>(v);
    } else {
      return static_cast<D>(truncate_to_int64(static_cast<double>(v)));
    }
  } else if constexpr (std::is_integral_v<V>) {  // D is float or double
    return static_cast<D>(static_cast<double>(v));
  } else if constexpr (std::is_same_v<D, V>) {
    return v;
  } else if constexpr (std::is_same_v<D, float>) {
    return double_to_float(v);
  } else {
    return float_to_double(v);
  }
}

// The arithmetic type of a storage type: the narrow floats compute in float (reductions,
// scaling), everything else in itself.
template <class T> struct ComputeType { using type = T; };
template <> struct ComputeType<BFloat16> { using type = float; };
template <> struct ComputeType<Half> { using type = float; };
template <> struct ComputeType<Float8E4M3> { using type = float; };
template <> struct ComputeType<Float8E5M2> { using type = float; };
template <class T> using compute_t = typename ComputeType<T>::type;

template <class D, class S>
KERNELS_HD D cast_value(S s) {
  if constexpr (std::is_same_v<D, S>) {
    return s;
  } else {
    return narrow_to<D>(widen(s));
  }
}

template <class T>
KERNELS_HD double to_double(T v) {
  const auto w = widen(v);
  if constexpr (std::is_same_v<std::remove_cv_t<decltype(w)>, float>) {
    return float_to_double(w);
  } else {
    return static_cast<double>(w);
  }
}

}  // namespace kernels::detail
