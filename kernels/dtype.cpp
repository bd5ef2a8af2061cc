#include "kernels/dtype.h"

#include <string>

#include "kernels/detail/convert.h"
#include "kernels/error.h"

namespace kernels {

size_t itemsize(DType dtype) {
  switch (dtype) {
    case DType::kF64:
    case DType::kI64: return 8;
    case DType::kF32:
    case DType::kI32: return 4;
    case DType::kBF16:
    case DType::kF16: return 2;
    case DType::kU8:
    case DType::kF8E4M3:
    case DType::kF8E5M2: return 1;
  }
  throw InternalError("itemsize: invalid dtype value " + std::to_string(static_cast<int>(dtype)));
}

bool is_floating_point(DType dtype) {
  return dtype != DType::kI32 && dtype != DType::kI64 && dtype != DType::kU8;
}

std::string_view to_string(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "f32";
    case DType::kF64: return "f64";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
    case DType::kU8: return "u8";
    case DType::kF8E4M3: return "f8e4m3";
    case DType::kF8E5M2: return "f8e5m2";
  }
  throw InternalError("to_string: invalid dtype value " + std::to_string(static_cast<int>(dtype)));
}

DType parse_dtype(std::string_view text) {
  for (DType d : kAllDTypes) {
    if (to_string(d) == text) return d;
  }
  std::string expected;
  for (DType d : kAllDTypes) {
    if (!expected.empty()) expected += ", ";
    expected += to_string(d);
  }
  throw InvalidArgument("unknown dtype '" + std::string(text) + "': expected one of " + expected);
}

uint16_t float_to_bf16_bits(float x) { return detail::bf16_from_float(x); }
uint16_t float_to_f16_bits(float x) { return detail::f16_from_float(x); }
uint8_t float_to_f8e4m3_bits(float x) { return detail::f8e4m3_from_float(x); }
uint8_t float_to_f8e5m2_bits(float x) { return detail::f8e5m2_from_float(x); }
float bf16_bits_to_float(uint16_t bits) { return detail::bf16_to_float(bits); }
float f16_bits_to_float(uint16_t bits) { return detail::f16_to_float(bits); }
float f8e4m3_bits_to_float(uint8_t bits) { return detail::f8e4m3_to_float(bits); }
float f8e5m2_bits_to_float(uint8_t bits) { return detail::f8e5m2_to_float(bits); }

}  // namespace kernels
