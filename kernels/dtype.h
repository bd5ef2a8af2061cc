// Element types. bf16, f16 and the two fp8 formats are storage types: arithmetic happens in
// float, and conversions from float round to nearest, ties to even (as PyTorch does).
//   itemsize(DType::kBF16) == 2;  parse_dtype("f32") == DType::kF32;  to_string(DType::kF8E4M3) == "f8e4m3"
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace kernels {

enum class DType : uint8_t { kF32, kF64, kBF16, kF16, kI32, kI64, kU8, kF8E4M3, kF8E5M2 };

inline constexpr DType kAllDTypes[] = {DType::kF32, DType::kF64,    DType::kBF16,
                                       DType::kF16, DType::kI32,    DType::kI64,
                                       DType::kU8,  DType::kF8E4M3, DType::kF8E5M2};

size_t itemsize(DType dtype);
bool is_floating_point(DType dtype);
// "f32", "f64", "bf16", "f16", "i32", "i64", "u8", "f8e4m3", "f8e5m2".
std::string_view to_string(DType dtype);
// Accepts the names above; throws InvalidArgument naming the text and the accepted names.
DType parse_dtype(std::string_view text);

// Bit-level storage types (no arithmetic; convert through float).
struct BFloat16 { uint16_t bits; };
struct Half { uint16_t bits; };
struct Float8E4M3 { uint8_t bits; };  // e4m3fn: bias 7, no infinities, max 448, NaN = S.1111.111
struct Float8E5M2 { uint8_t bits; };  // bias 15, IEEE-like with infinities, max 57344

// float -> narrow: round to nearest, ties to even. NaN stays NaN. Overflow: bf16/f16/e5m2 give
// +-inf; e4m3 (which has no infinity) gives NaN, matching PyTorch's float8_e4m3fn cast.
uint16_t float_to_bf16_bits(float x);
uint16_t float_to_f16_bits(float x);
uint8_t float_to_f8e4m3_bits(float x);
uint8_t float_to_f8e5m2_bits(float x);
float bf16_bits_to_float(uint16_t bits);
float f16_bits_to_float(uint16_t bits);
float f8e4m3_bits_to_float(uint8_t bits);
float f8e5m2_bits_to_float(uint8_t bits);

template <class T> struct dtype_of;
template <> struct dtype_of<float> { static constexpr DType value = DType::kF32; };
template <> struct dtype_of<double> { static constexpr DType value = DType::kF64; };
template <> struct dtype_of<BFloat16> { static constexpr DType value = DType::kBF16; };
template <> struct dtype_of<Half> { static constexpr DType value = DType::kF16; };
template <> struct dtype_of<int32_t> { static constexpr DType value = DType::kI32; };
template <> struct dtype_of<int64_t> { static constexpr DType value = DType::kI64; };
template <> struct dtype_of<uint8_t> { static constexpr DType value = DType::kU8; };
template <> struct dtype_of<Float8E4M3> { static constexpr DType value = DType::kF8E4M3; };
template <> struct dtype_of<Float8E5M2> { static constexpr DType value = DType::kF8E5M2; };
template <class T> inline constexpr DType dtype_of_v = dtype_of<T>::value;

}  // namespace kernels
