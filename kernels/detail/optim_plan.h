// Internal: an optimizer step over one strided range, built by kernels/ops/optim.cpp and run by
// kernels/cpu/optim.cpp or the CUDA back end. Plain C++.
#pragma once

#include <cstdint>

#include "kernels/dims.h"
#include "kernels/dtype.h"

namespace kernels::detail {

struct OptimPlan {
  bool adamw = true;  // else SGD
  Dims shape;
  DType dtype = DType::kF32;  // of param and every state tensor (f32 or f64)
  void* param = nullptr;
  Dims param_strides;
  const void* grad = nullptr;
  DType grad_dtype = DType::kF32;
  Dims grad_strides;
  // AdamW: exp_avg, exp_avg_sq, max_exp_avg_sq (amsgrad); SGD: state[0] = momentum buffer.
  void* state[3] = {nullptr, nullptr, nullptr};
  Dims state_strides[3];
  // Coefficients in double as Python computes them; the kernels round each to the param dtype.
  double decay = 1, l2 = 0, one_minus_beta1 = 0, beta2 = 0, one_minus_beta2 = 0, step_size = 0,
         bias_correction2_sqrt = 1, eps = 0;
  bool amsgrad = false, maximize = false;
  double lr = 0, momentum = 0, one_minus_dampening = 1, weight_decay = 0;
  bool nesterov = false, first_step = false;
};

}  // namespace kernels::detail
