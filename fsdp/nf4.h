// NF4 (QLoRA's 4-bit NormalFloat) with double-quantised scales: the codec only (no FSDP
// extension yet). Blocks are in the tensor's row-major flat index, so a codec of the global
// tensor does not depend on any sharding.
//
//   w (n elements, f32)
//   absmax_b = max |w| over block b of 64 elements (the last block may be shorter)
//   code_i   = the NF4 level nearest to w_i / absmax_b (0 when absmax_b == 0): the index of the
//              first level whose upper midpoint is >= the value, so a value exactly on a midpoint
//              takes the lower level; two codes per byte, element 2j in the high nibble
//   double quantisation of the absmax values (one f32 per 64 elements -> one byte):
//     mean     = mean of every absmax_b (f32, summed in double)
//     c_b      = absmax_b - mean, in blocks of 256 (the last may be shorter)
//     factor_k = 128 / max |c_b| over scaler block k (0 when that max is 0)
//     q_b      = clamp(nearbyint(c_b * factor_k), -128, 127) (ties to even), an i8 stored as u8
//   dequantise: absmax'_b = q_b / factor_k + mean (q_b = 0 -> mean when factor_k == 0),
//               w'_i = level[code_i] * absmax'_b
// Bits per weight: 4 + 8 / 64 + 32 / (64 * 256) (+ 32 per tensor for the mean) = 4.127.
//
//   Nf4Tensor q = nf4_quantize(w);           // codes [ceil(n / 2)] u8, scalers, factors, mean
//   Tensor back = nf4_dequantize(q, DType::kBF16);
#pragma once

#include <array>
#include <cstdint>

#include "kernels/tensor.h"

namespace fsdp {

// The 16 NF4 levels (bitsandbytes / QLoRA), normalised to [-1, 1].
inline constexpr std::array<float, 16> kNf4Levels = {
    -1.0f,        -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
    0.07958029955625534f,  0.16093020141124725f,  0.24611230194568634f,  0.33791524171829224f,
    0.44070982933044434f,  0.5626170039176941f,   0.7229568362236023f,   1.0f};
inline constexpr int64_t kNf4Block = 64;
inline constexpr int64_t kNf4ScalerBlock = 256;

struct Nf4Tensor {
  kernels::Dims shape;
  kernels::Tensor codes;    // u8 [ceil(n / 2)]
  kernels::Tensor scalers;  // u8 [ceil(n / 64)]: the i8 q_b
  kernels::Tensor factors;  // f32 [ceil(n / (64 * 256))]
  float mean = 0.0f;
};

// The level index nearest to v (REQUIRES v in [-1, 1]; ties to the lower level).
uint8_t nf4_code(float v);
// REQUIRES: a floating tensor with at least one element (InvalidArgument otherwise).
Nf4Tensor nf4_quantize(const kernels::Tensor& full);
kernels::Tensor nf4_dequantize(const Nf4Tensor& q, kernels::DType out_dtype);

}  // namespace fsdp
