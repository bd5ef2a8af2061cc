// Checkpoints of low-precision parameters (fp8 e4m3, int8 blocks, NF4): a floating DTensor
// becomes state-dict entries that checkpoint::save writes as safetensors and loads on any other
// mesh bit-exactly (the codes are bytes; the scales are replicated). The quantisation is the one
// of fsdp/lowp.h on the GLOBAL tensor (sharding-independent), so the codes do not depend on the
// layout they were saved from.
//
//   fp8 (QuantKind::kFp8Tensor):
//     "<name>"               F8_E4M3, x's shape and placements: q = e4m3(clamp(x * s, +-448))
//     "<name>._scale"        F32 [1], Replicate: s = 448 / max(amax, 1e-12); x' = float(q) / s
//   fp8 row-wise (QuantKind::kFp8Rowwise): the same with one s per row of the last dim:
//     "<name>._scale"        F32 x's shape with the last dim 1, Replicate (broadcasts: q / s)
//   int8 blocks (QuantKind::kInt8Block, block B of the row-major flat index):
//     "<name>"               U8, x's shape and placements: the i8 codes in two's complement
//                            (kernels has no i8 dtype; PyTorch: .view(torch.int8))
//     "<name>._scale"        F32 [ceil(numel / B)], Replicate: s = amax / 127; x' = q * s
//     value "<name>._block"  B
//   nf4 (QuantKind::kNf4):
//     "<name>"               U8 [.., ceil(n / 2)] (n = the last dim), x's placements: two codes per
//                            byte along the last dim (element 2j in the high nibble), which is the
//                            global row-major order of fsdp/nf4.h when n is even
//     "<name>._scale"        U8 [ceil(numel / 64)], Replicate: the double-quantised block absmax
//     "<name>._scale_factor" F32 [ceil(numel / (64 * 256))], Replicate
//     "<name>._scale_mean"   F32 [1], Replicate;  x' = level[q] * nf4_block_scale(...)
//   and the value "<name>._quant" = "fp8-e4m3" | "fp8-e4m3-rowwise" | "int8" | "nf4"
//   (checkpoint.json's values) records it.
// PyTorch reads the fp8 entries as torch.float8_e4m3fn plus an f32 scale (x = q.float() / s).
//
//   nn::StateDict sd = fsdp::quantize_for_checkpoint("w", w, {fsdp::QuantKind::kNf4});
//   checkpoint::save(dir, sd, world);
//   // any other mesh:
//   nn::StateDict t = fsdp::quantized_checkpoint_template("w", like, {fsdp::QuantKind::kNf4});
//   checkpoint::load(dir, t, world);      // like: any DTensor of w's shape on the new mesh
//   DTensor w2 = fsdp::dequantize_from_checkpoint(t, "w", like, DType::kBF16);  // == fake_quantize
#pragma once

#include <string>

#include "dtensor/dtensor.h"
#include "fsdp/lowp.h"
#include "nn/state_dict.h"

namespace fsdp {

// The entries above for x. Collective over x's mesh (one amax all-reduce). REQUIRES: x floating
// with >= 1 element; int8: block >= 1; nf4: every rank's held last-dim indices pair up (2j,
// 2j + 1) so the packed codes shard like x (InvalidArgument / Unsupported naming `name`).
nn::StateDict quantize_for_checkpoint(const std::string& name, const dtensor::DTensor& x, const QuantConfig& q);
// Entries of the same keys with like's placements (codes) or Replicate (scales), uninitialised: a
// checkpoint::load target. `like` gives the shape, mesh and placements (its values are unused).
nn::StateDict quantized_checkpoint_template(const std::string& name, const dtensor::DTensor& like,
                                            const QuantConfig& q);
// The dequantised tensor (like's shape and placements, `out` dtype) from loaded entries (the
// template's); no communication. Equals fake_quantize() of the full tensor, bit for bit.
// Throws InvalidArgument naming the key for a missing entry or a wrong shape or dtype.
dtensor::DTensor dequantize_from_checkpoint(const nn::StateDict& sd, const std::string& name,
                                            const dtensor::DTensor& like, kernels::DType out);

}  // namespace fsdp
