// MoEConfig: what an nn::MoE block is (nn/moe.h); GPTConfig holds one.
#pragma once

#include <cstdint>

#include "kernels/ops/elementwise.h"

namespace nn {

enum class RouterScore { kSoftmax, kSigmoid };

struct MoEConfig {
  int64_t dim = 64;     // GPT sets dim, hidden (mlp_hidden), gelu and init_std from its own
  int64_t hidden = 0;  // 0: 4 * dim
  int64_t experts = 0; // 0: no MoE (GPT keeps dense MLPs)
  int64_t top_k = 2;
  RouterScore score = RouterScore::kSoftmax;
  bool renormalize = true;
  double capacity_factor = 0.0;  // 0: dropless
  double aux_loss_coef = 0.01;
  bool shared_expert = false;    // a dense MLP (dim -> hidden -> dim) every token goes through
  kernels::GeluApproximation gelu = kernels::GeluApproximation::kTanh;
  double init_std = 0.02;
};

}  // namespace nn
