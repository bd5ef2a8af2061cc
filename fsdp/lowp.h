// Built-in all-gather extensions (fsdp/all_gather_extension.h): fp8 e4m3 and block int8 codes on
// the wire, dequantised after the all-gather into the compute dtype. The quantisation does not
// depend on the sharding: scales belong to groups of the GLOBAL tensor (its row-major flat index
// f), and each group's amax is the max over every rank holding a piece of it, so the dequantised
// weights are bit-identical under FSDP 1..N, HSDP and FSDP x TP, and equal fake_quantize() of the
// full tensor on one rank.
//
// Scale groups of a global tensor of shape [.., n] (G groups):
//   kFp8Tensor    one group (per-tensor dynamic scaling)            G = 1
//   kFp8Rowwise   f / n: one per row of the last dim                G = numel / n
//   kInt8Block    f / block (ZeRO++ qwZ), block 256 by default      G = ceil(numel / block)
//   kNf4          f / 64 (QLoRA's NF4, fsdp/nf4.h)                   G = ceil(numel / 64)
// amax_g = max |x_f| over the group (exact in f32), all-reduced (max) over the weight mesh: every
// mesh dim but HSDP's replicate dim (its ranks hold copies), as one P(max) -> R redistribute of a
// [G] f32 tensor. Then per element, in f32:
//   fp8 (e4m3fn, max 448):  s = 448 / max(amax, 1e-12);  q = e4m3(clamp(x * s, -448, 448))
//                           (round to nearest even);      x' = float(q) / s
//   int8 (symmetric):       s = amax / 127;  q = clamp(nearbyint(x / s), -127, 127) (round to
//                           nearest, ties to even; q = 0 when s == 0);  x' = q * s
//   nf4:  the G amax values (replicated after the all-reduce) are double-quantised as
//         fsdp/nf4.h says (their mean, blocks of 256, 8-bit scalers) into absmax'_g on every
//         rank;  q = nf4_code(x / amax_g) (4 bits);  x' = level[q] * absmax'_g, i.e. exactly
//         nf4_dequantize(nf4_quantize(full tensor)). Codes travel two per byte in the order of
//         the rank's padded shard (element 2j in the high nibble): 0.5 byte per element.
// x' is rounded (nearest even) to the param dtype. int8 codes travel as u8 bytes (two's
// complement). Only the codes are gathered: the scales are the same on every rank after the
// all-reduce, so they stay metadata.
//   Example (int8, one block): x = {127, -3.5, 0.5, 2.5} -> amax 127, s = 1, q = {127, -4, 0, 2}
//   (ties to even), x' = {127, -4, 0, 2}; fp8 of the same block: s = 448 / 127, x' = {127, -3.5,
//   0.5, 2.5} up to e4m3's 3 mantissa bits.
//
// Bytes: fp8 gathers 1 byte per element plus a 4-byte all-reduce per tensor (per row for
// rowwise); int8 1 byte per element plus an all-reduce of 4 bytes per 256 elements; nf4 half a
// byte per element plus an all-reduce of 4 bytes per 64 elements.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "fsdp/all_gather_extension.h"
#include "kernels/tensor.h"

namespace fsdp {

enum class QuantKind { kFp8Tensor, kFp8Rowwise, kInt8Block, kNf4 };

struct QuantConfig {
  QuantKind kind = QuantKind::kFp8Tensor;
  int64_t block = 256;  // kInt8Block only; >= 1
  // A frozen weight (QLoRA's base): the codes and scales of the first unshard (or of
  // fsdp::quantize_frozen) are kept in the mesh's allocator (nf4: 0.5 byte per element plus the
  // double-quantised scales, StoredNf4), so later unshards run no amax all-reduce and no
  // quantisation, and quantize_frozen may release the f32 master. REQUIRES: the weight does not
  // change after its first unshard, and one extension object per parameter
  // (make_quantized_all_gather per parameter: the codes live in the object).
  bool static_scales = false;
};

inline constexpr float kFp8E4M3Max = 448.0f;
inline constexpr float kFp8AmaxEps = 1e-12f;
inline constexpr float kInt8Max = 127.0f;

// "fp8", "fp8-rowwise", "int8" (block 256), "nf4".
std::string to_string(const QuantConfig& config);

// G for a global shape. REQUIRES: shape has >= 1 dim; block >= 1 (InvalidArgument otherwise).
int64_t quant_groups(const QuantConfig& config, const kernels::Dims& global_shape);
// The group of row-major flat index f (REQUIRES: 0 <= f < numel; last_dim = shape[-1]).
inline int64_t quant_group(const QuantConfig& c, int64_t f, int64_t last_dim) {
  switch (c.kind) {
    case QuantKind::kFp8Tensor: return 0;
    case QuantKind::kFp8Rowwise: return f / last_dim;
    case QuantKind::kInt8Block: return f / c.block;
    case QuantKind::kNf4: return f / 64;
  }
  return 0;
}
// The scale of a group from its amax (formulas above; not kNf4, whose scales depend on every
// group's amax: nf4_dequantized_absmax).
float quant_scale(QuantKind kind, float amax);
// One element: its code (a byte; kNf4: a nibble, scale = the exact amax to code, absmax' to
// decode) and back.
uint8_t quantize_value(QuantKind kind, float x, float scale);
float dequantize_value(QuantKind kind, uint8_t code, float scale);
// The wire dtype of the codes: f8e4m3 or u8 (int8, nf4).
kernels::DType quant_wire_dtype(QuantKind kind);

// The one-rank reference: every element of `full` (the global tensor, any floating dtype)
// quantised and dequantised with its group's scale, in `out_dtype`.
//   fake_quantize(w, {QuantKind::kInt8Block}, DType::kBF16)
kernels::Tensor fake_quantize(const kernels::Tensor& full, const QuantConfig& config, kernels::DType out_dtype);

// The extension: REQUIRES a floating parameter (refused at fully_shard otherwise, naming it).
std::shared_ptr<AllGatherExtension> make_quantized_all_gather(const QuantConfig& config);

// What an nf4 extension with static_scales keeps after its first pre_all_gather: this rank's
// padded shard as codes (the gathered input, two per byte, element 2j high) and the
// double-quantised scales of fsdp/nf4.h (replicated), all from ctx.comms' allocator.
// bytes() = ceil(padded / 2) + G + 4 * ceil(G / 256) + 4: about 0.52 byte per element.
struct StoredNf4 {
  kernels::Tensor codes;    // u8 [ceil(padded_numel / 2)]
  kernels::Tensor scalers;  // u8 [G]
  kernels::Tensor factors;  // f32 [ceil(G / 256)]
  kernels::Tensor mean;     // f32 [1]
  AllGatherContext ctx;
  int64_t bytes() const;
};
// ext's stored NF4, or nullptr (another extension, or nothing quantised yet).
const StoredNf4* stored_nf4(const AllGatherExtension& ext);

}  // namespace fsdp
