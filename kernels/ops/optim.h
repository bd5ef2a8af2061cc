// Fused optimizer steps over one flat range: each rank calls them on its local shard of a
// parameter (and of its gradient and state), so the update is element-wise and needs no
// communication. The formulas are PyTorch's single-tensor implementations (torch.optim.AdamW /
// Adam / SGD, foreach=False, the CPU default), operation for operation in f32 (f64 for f64
// parameters) with the scalar coefficients computed in double as Python does, and multiply-adds
// fused where torch's vectorised kernels fuse them (lerp, addcmul, add with alpha) on CPUs with
// FMA: float32 results equal torch.optim's or differ by an ulp or two of the operands
// (tests/kernels/optim_ops_test.cpp).
//
//   AdamWOptions o{.lr = 1e-3, .weight_decay = 0.1};
//   for (int64_t step = 1; ...; ++step) adamw_step(p, g, m, v, Tensor(), step, o);
//   SgdOptions s{.lr = 0.1, .momentum = 0.9, .nesterov = true};
//   sgd_step(p, g, buf, /*first_step=*/true, s);     // buf = g (PyTorch's first step), then p
//
// AdamW, with t = step (1 for the first call) and g = grad (-grad when maximize):
//   p *= 1 - lr * weight_decay                          (decoupled; Adam instead adds wd * p to g)
//   m = lerp(m, g, 1 - beta1);   v = v * beta2 + (1 - beta2) * g * g
//   [amsgrad: vmax = max(vmax, v), used for v below]
//   p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// SGD: g += weight_decay * p; with momentum: buf = g on the first step, else
//   buf = momentum * buf + (1 - dampening) * g; g = nesterov ? g + momentum * buf : buf;
//   then p -= lr * g.
//
// Rules: param and state tensors are f32 or f64 (all the same dtype); grad may be any floating
// dtype (bf16 gradients are widened exactly). All operands have the same shape and device; any
// strided views that do not overlap one another. Empty ranges are a no-op.
#pragma once

#include <cstdint>

#include "kernels/tensor.h"

namespace kernels {

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;  // torch.optim.AdamW's default (Adam's is 0)
  bool amsgrad = false;
  bool maximize = false;
  // true: AdamW (decay applied to the parameter); false: Adam's L2 penalty (added to the grad).
  bool decoupled_weight_decay = true;
};

// REQUIRES: step >= 1 (the step number after PyTorch's `state['step'] += 1`); max_exp_avg_sq
// defined exactly when options.amsgrad. Invalid hyper-parameters (lr < 0, betas outside [0, 1),
// eps < 0, weight_decay < 0) raise InvalidArgument, as torch's constructor does.
void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                const Tensor& exp_avg_sq, const Tensor& max_exp_avg_sq, int64_t step,
                const AdamWOptions& options);

struct SgdOptions {
  double lr = 1e-3;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;  // REQUIRES momentum > 0 and dampening == 0 (as torch)
  bool maximize = false;
};

// momentum_buffer: defined exactly when options.momentum != 0. first_step: the buffer holds no
// history yet (PyTorch's `buf is None`): it is set to the gradient instead of being decayed.
void sgd_step(const Tensor& param, const Tensor& grad, const Tensor& momentum_buffer,
              bool first_step, const SgdOptions& options);

}  // namespace kernels
