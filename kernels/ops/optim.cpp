#include "kernels/ops/optim.h"

#include <fmt/format.h>

#include <cmath>
#include <vector>

#include "kernels/cpu/compute.h"
#include "kernels/cuda/cuda_compute.h"
#include "kernels/detail/optim_plan.h"
#include "kernels/error.h"
#include "kernels/format.h"
#include "kernels/ops/common.h"

namespace kernels {
namespace {

using detail::OptimPlan;

// param (f32/f64), grad (floating) and the states (param's dtype), all of one shape and device,
// pairwise disjoint.
void check_operands(const char* op, const Tensor& param, const Tensor& grad,
                    std::initializer_list<detail::Named> states) {
  detail::check_defined(op, param, "param");
  if (param.dtype() != DType::kF32 && param.dtype() != DType::kF64) {
    throw InvalidArgument(
        fmt::format("{}: param has dtype {}, expected f32 or f64", op, param.dtype()));
  }
  detail::check_floating(op, grad, "grad");
  detail::check_shape(op, grad, "grad", param.shape());
  detail::check_same_device(op, {{"param", param}, {"grad", grad}});
  detail::check_writable(op, param, "param");
  std::vector<detail::Named> all = {{"param", param}, {"grad", grad}};
  for (const auto& s : states) {
    detail::check_defined(op, s.t, s.name);
    detail::check_dtype(op, s.t, s.name, param.dtype());
    detail::check_shape(op, s.t, s.name, param.shape());
    detail::check_same_device(op, {{"param", param}, {s.name, s.t}});
    detail::check_writable(op, s.t, s.name);
    all.push_back(s);
  }
  for (size_t i = 0; i < all.size(); ++i) {
    for (size_t j = i + 1; j < all.size(); ++j) {
      if (detail::may_overlap(all[i].t, all[j].t)) {
        throw InvalidArgument(fmt::format("{}: {} overlaps {} (expected separate storage)", op,
                                          all[i].name, all[j].name));
      }
    }
  }
}

void check_range(const char* op, const char* name, double v, double lo, bool lo_open, double hi,
                 bool hi_open) {
  const bool ok = (lo_open ? v > lo : v >= lo) && (hi_open ? v < hi : v <= hi);
  if (!ok) {
    throw InvalidArgument(fmt::format("{}: invalid {} {} (expected {}{}, {}{})", op, name, v,
                                      lo_open ? "(" : "[", lo, hi, hi_open ? ")" : "]"));
  }
}

OptimPlan base_plan(const Tensor& param, const Tensor& grad) {
  OptimPlan p;
  p.shape = param.shape();
  p.dtype = param.dtype();
  p.param = param.data_ptr();
  p.param_strides = param.strides();
  p.grad = grad.data_ptr();
  p.grad_dtype = grad.dtype();
  p.grad_strides = grad.strides();
  return p;
}

void run(const OptimPlan& p, const Tensor& param) {
  if (param.device().is_cuda()) {
    detail::cuda_optimizer_step(p, param.device().index);
  } else {
    detail::cpu_optimizer_step(p);
  }
}

}  // namespace

void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                const Tensor& exp_avg_sq, const Tensor& max_exp_avg_sq, int64_t step,
                const AdamWOptions& o) {
  constexpr const char* kOp = "adamw_step";
  if (o.amsgrad) {
    check_operands(
        kOp, param, grad,
        {{"exp_avg", exp_avg}, {"exp_avg_sq", exp_avg_sq}, {"max_exp_avg_sq", max_exp_avg_sq}});
  } else {
    if (max_exp_avg_sq.defined()) {
      throw InvalidArgument(fmt::format("{}: max_exp_avg_sq given but amsgrad is off", kOp));
    }
    check_operands(kOp, param, grad, {{"exp_avg", exp_avg}, {"exp_avg_sq", exp_avg_sq}});
  }
  // torch.optim.Adam(W)'s constructor checks.
  check_range(kOp, "learning rate", o.lr, 0, false, INFINITY, true);
  check_range(kOp, "epsilon value", o.eps, 0, false, INFINITY, true);
  check_range(kOp, "beta parameter at index 0", o.beta1, 0, false, 1, true);
  check_range(kOp, "beta parameter at index 1", o.beta2, 0, false, 1, true);
  check_range(kOp, "weight_decay value", o.weight_decay, 0, false, INFINITY, true);
  if (step < 1) throw InvalidArgument(fmt::format("{}: step is {}, expected 1 or more", kOp, step));
  if (param.numel() == 0) return;
  OptimPlan p = base_plan(param, grad);
  p.adamw = true;
  p.state[0] = exp_avg.data_ptr();
  p.state_strides[0] = exp_avg.strides();
  p.state[1] = exp_avg_sq.data_ptr();
  p.state_strides[1] = exp_avg_sq.strides();
  if (o.amsgrad) {
    p.state[2] = max_exp_avg_sq.data_ptr();
    p.state_strides[2] = max_exp_avg_sq.strides();
  }
  // As Python computes them (double), before each op rounds them to the tensor dtype.
  const auto t = static_cast<double>(step);
  const bool decay = o.decoupled_weight_decay && o.weight_decay != 0;
  p.decay = decay ? 1 - o.lr * o.weight_decay : 1.0;
  p.l2 = !o.decoupled_weight_decay ? o.weight_decay : 0.0;
  p.one_minus_beta1 = 1 - o.beta1;
  p.beta2 = o.beta2;
  p.one_minus_beta2 = 1 - o.beta2;
  p.step_size = o.lr / (1 - std::pow(o.beta1, t));
  p.bias_correction2_sqrt = std::sqrt(1 - std::pow(o.beta2, t));
  p.eps = o.eps;
  p.amsgrad = o.amsgrad;
  p.maximize = o.maximize;
  run(p, param);
}

void sgd_step(const Tensor& param, const Tensor& grad, const Tensor& momentum_buffer,
              bool first_step, const SgdOptions& o) {
  constexpr const char* kOp = "sgd_step";
  if (o.momentum != 0) {
    check_operands(kOp, param, grad, {{"momentum_buffer", momentum_buffer}});
  } else {
    if (momentum_buffer.defined()) {
      throw InvalidArgument(fmt::format("{}: momentum_buffer given but momentum is 0", kOp));
    }
    check_operands(kOp, param, grad, {});
  }
  check_range(kOp, "learning rate", o.lr, 0, false, INFINITY, true);
  check_range(kOp, "momentum value", o.momentum, 0, false, INFINITY, true);
  check_range(kOp, "weight_decay value", o.weight_decay, 0, false, INFINITY, true);
  if (o.nesterov && (o.momentum <= 0 || o.dampening != 0)) {
    throw InvalidArgument(fmt::format(
        "{}: Nesterov momentum requires a momentum and zero dampening (momentum {}, dampening {})",
        kOp, o.momentum, o.dampening));
  }
  if (param.numel() == 0) return;
  OptimPlan p = base_plan(param, grad);
  p.adamw = false;
  if (o.momentum != 0) {
    p.state[0] = momentum_buffer.data_ptr();
    p.state_strides[0] = momentum_buffer.strides();
  }
  p.lr = o.lr;
  p.momentum = o.momentum;
  p.one_minus_dampening = 1 - o.dampening;
  p.weight_decay = o.weight_decay;
  p.nesterov = o.nesterov;
  p.maximize = o.maximize;
  p.first_step = first_step;
  run(p, param);
}

}  // namespace kernels
