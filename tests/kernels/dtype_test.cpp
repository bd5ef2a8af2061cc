// DType names and sizes; the float <-> bf16 / f16 / fp8 conversions (round to nearest even),
// checked on hand-picked bit patterns, exhaustively, and against Eigen's bfloat16 / half.
#include "kernels/dtype.h"

#include <Eigen/Core>
#include <bit>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/error.h"

using namespace kernels;

namespace {

float f_bits(uint32_t u) { return std::bit_cast<float>(u); }
uint32_t bits_f(float f) { return std::bit_cast<uint32_t>(f); }

// Uniformly random 32-bit patterns: every exponent, subnormals, infinities and NaNs included.
std::vector<uint32_t> random_patterns(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint32_t> out(n);
  for (auto& u : out) u = static_cast<uint32_t>(rng());
  return out;
}

}  // namespace

TEST_CASE("dtype itemsize, name and parse round trip", "[kernels][dtype]") {
  const struct {
    DType dtype;
    size_t size;
    const char* name;
    bool floating;
  } cases[] = {
      {DType::kF32, 4, "f32", true},       {DType::kF64, 8, "f64", true},
      {DType::kBF16, 2, "bf16", true},     {DType::kF16, 2, "f16", true},
      {DType::kI32, 4, "i32", false},      {DType::kI64, 8, "i64", false},
      {DType::kU8, 1, "u8", false},        {DType::kF8E4M3, 1, "f8e4m3", true},
      {DType::kF8E5M2, 1, "f8e5m2", true},
  };
  REQUIRE(std::size(cases) == std::size(kAllDTypes));
  for (const auto& c : cases) {
    INFO(c.name);
    CHECK(itemsize(c.dtype) == c.size);
    CHECK(to_string(c.dtype) == c.name);
    CHECK(parse_dtype(c.name) == c.dtype);
    CHECK(is_floating_point(c.dtype) == c.floating);
  }
  for (DType d : kAllDTypes) CHECK(parse_dtype(to_string(d)) == d);
  CHECK(dtype_of_v<BFloat16> == DType::kBF16);
  CHECK(dtype_of_v<uint8_t> == DType::kU8);
}

TEST_CASE("parse_dtype rejects unknown names", "[kernels][dtype]") {
  REQUIRE_THROWS_AS(parse_dtype("f33"), InvalidArgument);
  REQUIRE_THROWS_WITH(parse_dtype("f33"),
                      "unknown dtype 'f33': expected one of f32, f64, bf16, f16, i32, i64, u8, "
                      "f8e4m3, f8e5m2");
  REQUIRE_THROWS_WITH(parse_dtype(""), Catch::Contains("unknown dtype ''"));
  REQUIRE_THROWS_WITH(parse_dtype("F32"), Catch::Contains("'F32'"));
  REQUIRE_THROWS_WITH(parse_dtype("float32"), Catch::Contains("'float32'"));
}

TEST_CASE("bf16 rounding on hand-picked patterns", "[kernels][dtype][bf16]") {
  const struct {
    uint32_t in;
    uint16_t out;
    const char* what;
  } cases[] = {
      {0x3F800000, 0x3F80, "1.0 exact"},
      {0x3F808000, 0x3F80, "tie, lower neighbour even: down"},
      {0x3F818000, 0x3F82, "tie, lower neighbour odd: up"},
      {0x3F808001, 0x3F81, "just above the tie: up"},
      {0x3F807FFF, 0x3F80, "just below the tie: down"},
      {0x3F80FFFF, 0x3F81, "round up"},
      {0x3FFF8000, 0x4000, "tie with carry into the exponent"},
      {0x7F7F0000, 0x7F7F, "bf16 max"},
      {0x7F7F7FFF, 0x7F7F, "just below max + half ulp"},
      {0x7F7F8000, 0x7F80, "tie above max (odd) -> inf"},
      {0x7F7FFFFF, 0x7F80, "float max overflows to inf"},
      {0xFF7FFFFF, 0xFF80, "-float max overflows to -inf"},
      {0x7F800000, 0x7F80, "inf"},
      {0xFF800000, 0xFF80, "-inf"},
      {0x00000000, 0x0000, "zero"},
      {0x80000000, 0x8000, "negative zero"},
      {0x00000001, 0x0000, "smallest float subnormal -> 0"},
      {0x00008000, 0x0000, "tie at the smallest bf16 subnormal / 2 -> 0 (even)"},
      {0x00018000, 0x0002, "subnormal tie, odd -> up"},
      {0x00010000, 0x0001, "smallest bf16 subnormal"},
      {0x007FFFFF, 0x0080, "largest float subnormal rounds to the smallest normal"},
      {0x807F0000, 0x807F, "negative subnormal"},
      {0x7FC00000, 0x7FC0, "quiet NaN"},
      {0x7F800001, 0x7FC0, "signalling NaN with a low payload stays NaN"},
      {0xFFC00000, 0xFFC0, "negative NaN keeps its sign"},
  };
  for (const auto& c : cases) {
    INFO(c.what);
    CHECK(float_to_bf16_bits(f_bits(c.in)) == c.out);
  }
  CHECK(bf16_bits_to_float(0x3F80) == 1.0f);
  CHECK(bf16_bits_to_float(0x7F7F) == f_bits(0x7F7F0000));
  CHECK(std::isinf(bf16_bits_to_float(0xFF80)));
  CHECK(std::isnan(bf16_bits_to_float(0x7FC1)));
  CHECK(std::signbit(bf16_bits_to_float(0x8000)));
}

TEST_CASE("f16 rounding on hand-picked patterns", "[kernels][dtype][f16]") {
  const float sub = std::ldexp(1.0f, -24);  // smallest f16 subnormal
  const struct {
    float in;
    uint16_t out;
    const char* what;
  } cases[] = {
      {1.0f, 0x3C00, "1.0"},
      {-2.0f, 0xC000, "-2.0"},
      {1.0f + std::ldexp(1.0f, -11), 0x3C00, "tie, even: down"},
      {1.0f + 3 * std::ldexp(1.0f, -11), 0x3C02, "tie, odd: up"},
      {1.0f + std::ldexp(1.0f, -11) + std::ldexp(1.0f, -20), 0x3C01, "above the tie: up"},
      {65504.0f, 0x7BFF, "f16 max"},
      {65519.0f, 0x7BFF, "below max + half ulp"},
      {65520.0f, 0x7C00, "max + half ulp ties to inf"},
      {1.0e6f, 0x7C00, "overflow to inf"},
      {-1.0e6f, 0xFC00, "overflow to -inf"},
      {std::numeric_limits<float>::infinity(), 0x7C00, "inf"},
      {sub, 0x0001, "smallest subnormal"},
      {sub / 2, 0x0000, "half the smallest subnormal ties to 0"},
      {sub * 1.5f, 0x0002, "1.5 subnormal units tie to 2 (even)"},
      {sub * 2.5f, 0x0002, "2.5 units tie to 2 (even)"},
      {sub * 0.75f, 0x0001, "0.75 units round up"},
      {sub * 0.25f, 0x0000, "0.25 units round down"},
      {std::ldexp(1.0f, -14), 0x0400, "smallest normal"},
      {1023 * sub, 0x03FF, "largest subnormal"},
      {1023.5f * sub, 0x0400, "tie above the largest subnormal carries into the exponent"},
      {1.0e-8f, 0x0000, "far below the subnormals"},
      {f_bits(0x00000001), 0x0000, "float subnormal"},
      {-0.0f, 0x8000, "negative zero"},
      {-sub, 0x8001, "negative subnormal"},
      {std::numeric_limits<float>::quiet_NaN(), 0x7E00, "NaN"},
      {-std::numeric_limits<float>::quiet_NaN(), 0xFE00, "negative NaN"},
  };
  for (const auto& c : cases) {
    INFO(c.what << " (input bits " << std::hex << bits_f(c.in) << ")");
    CHECK(float_to_f16_bits(c.in) == c.out);
  }
  CHECK(f16_bits_to_float(0x0001) == sub);
  CHECK(f16_bits_to_float(0x03FF) == 1023 * sub);
  CHECK(f16_bits_to_float(0x7BFF) == 65504.0f);
  CHECK(f16_bits_to_float(0xFC00) == -std::numeric_limits<float>::infinity());
  CHECK(std::isnan(f16_bits_to_float(0x7C01)));
  CHECK(std::isnan(f16_bits_to_float(0xFE00)));
}

TEST_CASE("bf16 and f16: all 65536 patterns round trip through float",
          "[kernels][dtype][bf16][f16]") {
  int bf16_nans = 0;
  int f16_nans = 0;
  for (uint32_t b = 0; b < 65536; ++b) {
    const auto bits = static_cast<uint16_t>(b);
    const float bf = bf16_bits_to_float(bits);
    const float hf = f16_bits_to_float(bits);
    // bf16 is the top half of a float.
    REQUIRE(bits_f(bf) == (static_cast<uint32_t>(bits) << 16));
    if (std::isnan(bf)) {
      ++bf16_nans;
      REQUIRE(std::isnan(bf16_bits_to_float(float_to_bf16_bits(bf))));
      REQUIRE((float_to_bf16_bits(bf) & 0x8000) == (bits & 0x8000));
    } else {
      REQUIRE(float_to_bf16_bits(bf) == bits);
    }
    const bool f16_nan = (bits & 0x7C00) == 0x7C00 && (bits & 0x03FF) != 0;
    REQUIRE(std::isnan(hf) == f16_nan);
    if (f16_nan) {
      ++f16_nans;
      REQUIRE(float_to_f16_bits(hf) == ((bits & 0x8000) | 0x7E00));
    } else {
      REQUIRE(float_to_f16_bits(hf) == bits);
      // Independent decode: sign * mantissa * 2^exponent.
      const int e = (bits >> 10) & 0x1F;
      const int m = bits & 0x3FF;
      const double mag = e == 0    ? std::ldexp(m, -24)
                         : e == 31 ? std::numeric_limits<double>::infinity()
                                   : std::ldexp(1024 + m, e - 25);
      REQUIRE(static_cast<double>(hf) == ((bits & 0x8000) ? -mag : mag));
    }
  }
  CHECK(bf16_nans == 2 * 127);
  CHECK(f16_nans == 2 * 1023);
}

TEST_CASE("bf16 and f16 match Eigen on random floats", "[kernels][dtype][bf16][f16]") {
  const auto patterns = random_patterns(4'000'000, 12345);
  size_t bf16_mismatch = 0;
  size_t f16_mismatch = 0;
  for (uint32_t u : patterns) {
    const float x = f_bits(u);
    const uint16_t eb = Eigen::numext::bit_cast<uint16_t>(Eigen::bfloat16(x));
    const uint16_t eh = Eigen::numext::bit_cast<uint16_t>(Eigen::half(x));
    if (float_to_bf16_bits(x) != eb) ++bf16_mismatch;
    if (float_to_f16_bits(x) != eh) ++f16_mismatch;
    // Narrow values near every f16 binade (random floats rarely land in f16 range otherwise).
    const float y =
        std::ldexp(f_bits((u & 0x807FFFFF) | 0x3F800000), static_cast<int>(u >> 26) - 40);
    if (float_to_f16_bits(y) != Eigen::numext::bit_cast<uint16_t>(Eigen::half(y))) ++f16_mismatch;
    if (float_to_bf16_bits(y) != Eigen::numext::bit_cast<uint16_t>(Eigen::bfloat16(y)))
      ++bf16_mismatch;
    // Decoding agrees too.
    const auto b16 = static_cast<uint16_t>(u);
    const float ours = f16_bits_to_float(b16);
    const float theirs = static_cast<float>(Eigen::half(Eigen::half_impl::raw_uint16_to_half(b16)));
    if (!(ours == theirs || (std::isnan(ours) && std::isnan(theirs)))) ++f16_mismatch;
  }
  CHECK(bf16_mismatch == 0);
  CHECK(f16_mismatch == 0);
}

namespace {

// Reference fp8 rounding by brute force: the nearest finite value (ties to the even code), then
// the overflow rule. Independent of the library's bit manipulation.
struct Fp8Reference {
  std::vector<std::pair<double, uint8_t>> finite;  // non-negative values and codes
  double overflow_at;                              // |x| > this: overflow code
  uint8_t overflow_code;
  uint8_t nan_code;

  uint8_t round(float xf) const {
    const double x = xf;
    const uint8_t sign = std::signbit(xf) ? 0x80 : 0;
    if (std::isnan(x)) return sign | nan_code;
    const double a = std::abs(x);
    if (a > overflow_at) return sign | overflow_code;
    double best_diff = std::numeric_limits<double>::infinity();
    uint8_t best = 0;
    for (const auto& [v, code] : finite) {
      const double diff = std::abs(v - a);
      if (diff < best_diff || (diff == best_diff && (code & 1) == 0)) {
        best_diff = diff;
        best = code;
      }
    }
    return sign | best;
  }
};

// `beyond_max` is the value the code after the largest finite one would have had: inputs that
// round to it get the overflow code.
Fp8Reference make_reference(float (*decode)(uint8_t), double beyond_max, uint8_t overflow_code,
                            uint8_t nan_code) {
  const double max = decode(static_cast<uint8_t>(overflow_code - 1));
  Fp8Reference r{{}, (max + beyond_max) / 2, overflow_code, nan_code};
  for (int c = 0; c < 128; ++c) {
    const float v = decode(static_cast<uint8_t>(c));
    if (std::isfinite(v)) r.finite.emplace_back(v, static_cast<uint8_t>(c));
  }
  r.finite.emplace_back(beyond_max, overflow_code);
  return r;
}

}  // namespace

TEST_CASE("fp8 e4m3fn: decode, round trip and rounding", "[kernels][dtype][fp8]") {
  // All 256 patterns round trip; the only NaNs are S.1111.111.
  for (int c = 0; c < 256; ++c) {
    const auto bits = static_cast<uint8_t>(c);
    const float v = f8e4m3_bits_to_float(bits);
    INFO("code " << c);
    if ((c & 0x7F) == 0x7F) {
      REQUIRE(std::isnan(v));
      REQUIRE(float_to_f8e4m3_bits(v) == c);
    } else {
      REQUIRE(std::isfinite(v));
      REQUIRE(float_to_f8e4m3_bits(v) == c);
      const int e = (c >> 3) & 0xF;
      const int m = c & 7;
      const double mag = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
      REQUIRE(static_cast<double>(v) == ((c & 0x80) ? -mag : mag));
    }
  }
  CHECK(f8e4m3_bits_to_float(0x7E) == 448.0f);
  CHECK(f8e4m3_bits_to_float(0x01) == std::ldexp(1.0f, -9));
  CHECK(float_to_f8e4m3_bits(448.0f) == 0x7E);
  CHECK(float_to_f8e4m3_bits(463.0f) == 0x7E);
  CHECK(float_to_f8e4m3_bits(464.0f) == 0x7E);  // tie between 448 (even) and 480: 448
  CHECK(float_to_f8e4m3_bits(465.0f) == 0x7F);  // rounds to 480, whose code is NaN (PyTorch too)
  CHECK(float_to_f8e4m3_bits(479.0f) == 0x7F);
  CHECK(float_to_f8e4m3_bits(480.0f) == 0x7F);  // overflow -> NaN, as PyTorch
  CHECK(float_to_f8e4m3_bits(-1.0e6f) == 0xFF);
  CHECK(float_to_f8e4m3_bits(std::numeric_limits<float>::infinity()) == 0x7F);
  CHECK(float_to_f8e4m3_bits(std::numeric_limits<float>::quiet_NaN()) == 0x7F);
  CHECK(float_to_f8e4m3_bits(1.0f) == 0x38);
  CHECK(float_to_f8e4m3_bits(1.0625f) == 0x38);                // tie (1 + 1/16), even: down
  CHECK(float_to_f8e4m3_bits(1.1875f) == 0x3A);                // tie (1 + 3/16), odd: up
  CHECK(float_to_f8e4m3_bits(std::ldexp(1.0f, -10)) == 0x00);  // half the smallest subnormal
  CHECK(float_to_f8e4m3_bits(std::ldexp(1.5f, -10)) == 0x01);
  CHECK(float_to_f8e4m3_bits(std::ldexp(3.0f, -10)) == 0x02);  // 1.5 units ties to 2
  CHECK(float_to_f8e4m3_bits(std::ldexp(7.5f, -9)) ==
        0x08);  // largest subnormal + half -> min normal
  CHECK(float_to_f8e4m3_bits(-0.0f) == 0x80);

  const Fp8Reference ref = make_reference(f8e4m3_bits_to_float, 480.0, 0x7F, 0x7F);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> exponent(-14.0f, 10.0f);
  for (int k = 0; k < 200000; ++k) {
    const float x = std::exp2(exponent(rng)) * ((k & 1) ? -1.0f : 1.0f);
    INFO("x = " << x);
    REQUIRE(float_to_f8e4m3_bits(x) == ref.round(x));
  }
  // Every midpoint between neighbouring codes, and the points just around it.
  for (size_t k = 0; k + 1 < ref.finite.size(); ++k) {
    const float mid = static_cast<float>((ref.finite[k].first + ref.finite[k + 1].first) / 2);
    for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1.0e9f)}) {
      INFO("x = " << x);
      REQUIRE(float_to_f8e4m3_bits(x) == ref.round(x));
    }
  }
}

TEST_CASE("fp8 e5m2: decode, round trip and rounding", "[kernels][dtype][fp8]") {
  for (int c = 0; c < 256; ++c) {
    const auto bits = static_cast<uint8_t>(c);
    const float v = f8e5m2_bits_to_float(bits);
    INFO("code " << c);
    const int e = (c >> 2) & 0x1F;
    const int m = c & 3;
    if (e == 31 && m != 0) {
      REQUIRE(std::isnan(v));
      REQUIRE((float_to_f8e5m2_bits(v) & 0x7F) == 0x7F);
      REQUIRE((float_to_f8e5m2_bits(v) & 0x80) == (c & 0x80));
    } else {
      REQUIRE(float_to_f8e5m2_bits(v) == c);
      const double mag = e == 31  ? std::numeric_limits<double>::infinity()
                         : e == 0 ? std::ldexp(m, -16)
                                  : std::ldexp(4 + m, e - 17);
      REQUIRE(static_cast<double>(v) == ((c & 0x80) ? -mag : mag));
    }
  }
  CHECK(f8e5m2_bits_to_float(0x7B) == 57344.0f);
  CHECK(float_to_f8e5m2_bits(57344.0f) == 0x7B);
  CHECK(float_to_f8e5m2_bits(61439.0f) == 0x7B);
  CHECK(float_to_f8e5m2_bits(61440.0f) == 0x7C);  // tie above max (odd) -> inf
  CHECK(float_to_f8e5m2_bits(1.0e6f) == 0x7C);
  CHECK(float_to_f8e5m2_bits(-1.0e6f) == 0xFC);
  CHECK(float_to_f8e5m2_bits(-std::numeric_limits<float>::infinity()) == 0xFC);
  CHECK(float_to_f8e5m2_bits(std::numeric_limits<float>::quiet_NaN()) == 0x7F);
  CHECK(float_to_f8e5m2_bits(1.125f) == 0x3C);  // tie, even: down
  CHECK(float_to_f8e5m2_bits(1.375f) == 0x3E);  // tie, odd: up
  CHECK(float_to_f8e5m2_bits(std::ldexp(1.0f, -17)) == 0x00);
  CHECK(float_to_f8e5m2_bits(std::ldexp(1.0f, -16)) == 0x01);
  CHECK(float_to_f8e5m2_bits(std::ldexp(3.0f, -17)) == 0x02);

  const Fp8Reference ref = make_reference(f8e5m2_bits_to_float, 65536.0, 0x7C, 0x7F);
  std::mt19937 rng(8);
  std::uniform_real_distribution<float> exponent(-20.0f, 17.0f);
  for (int k = 0; k < 200000; ++k) {
    const float x = std::exp2(exponent(rng)) * ((k & 1) ? -1.0f : 1.0f);
    INFO("x = " << x);
    REQUIRE(float_to_f8e5m2_bits(x) == ref.round(x));
  }
  for (size_t k = 0; k + 1 < ref.finite.size(); ++k) {
    const float mid = static_cast<float>((ref.finite[k].first + ref.finite[k + 1].first) / 2);
    for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1.0e9f)}) {
      INFO("x = " << x);
      REQUIRE(float_to_f8e5m2_bits(x) == ref.round(x));
    }
  }
}
