// fsdp-train's --all-gather fp8|int8: the transformer blocks' linear weights (attention and MLP
// projections) are all-gathered as fp8 e4m3 (per-tensor scale) or int8 blocks of 256 through
// fsdp/lowp.h's extensions and dequantised to bf16 for compute; embeddings, norms and lm_head stay
// bf16. The single-rank reference (--check-parity) computes with fake_quantize() of the same
// weights: the same values bit for bit (the quantisation does not depend on the sharding).
#pragma once

#include <optional>
#include <string>

#include "fsdp/fully_shard.h"
#include "fsdp/lowp.h"
#include "kernels/error.h"

namespace fsdp_train {

// "" (no extension), "fp8" or "int8". REQUIRES a value from that list (InvalidArgument).
inline std::optional<fsdp::QuantConfig> parse_all_gather(const std::string& text) {
  if (text.empty()) return std::nullopt;
  if (text == "fp8") return fsdp::QuantConfig{fsdp::QuantKind::kFp8Tensor};
  if (text == "int8") return fsdp::QuantConfig{fsdp::QuantKind::kInt8Block, 256};
  throw kernels::InvalidArgument("--all-gather " + text + ": expected fp8 or int8");
}

// A linear weight of a block's attention or MLP (names relative to a block or to the model).
inline bool quantised_weight(const std::string& name, const nn::Parameter& p) {
  auto ends_with = [&](const std::string& s) {
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  const bool in_block = name.find("attn.") != std::string::npos || name.find("mlp.") != std::string::npos;
  return in_block && ends_with(".weight") && p.shape().size() == 2;
}

inline fsdp::AllGatherExtensionFn extension_fn(const fsdp::QuantConfig& q) {
  auto ext = fsdp::make_quantized_all_gather(q);
  return [ext](const std::string& name, const nn::Parameter& p) {
    return quantised_weight(name, p) ? ext : std::shared_ptr<fsdp::AllGatherExtension>();
  };
}

// The bf16 compute copy of a master weight on one rank: fake-quantised when `q` is set and the
// weight is quantised, else a plain cast. REQUIRES: master is the full tensor (one rank).
inline void set_compute(const std::string& name, const nn::Parameter& p, kernels::Tensor compute,
                        const kernels::Tensor& master, const std::optional<fsdp::QuantConfig>& q) {
  if (q && quantised_weight(name, p)) compute.copy_(fsdp::fake_quantize(master, *q, compute.dtype()));
  else compute.copy_(master);  // rounds to bf16
}

// Bytes this rank's unshards sent so far (the all-gathers and the extensions' amax reductions).
inline int64_t all_gather_bytes(const std::vector<fsdp::FSDPModule*>& groups) {
  int64_t n = 0;
  for (const fsdp::FSDPModule* g : groups) n += g->stats().all_gather_bytes + g->stats().extension_bytes;
  return n;
}

}  // namespace fsdp_train
