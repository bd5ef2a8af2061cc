#include "nn/grad_scaler.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>

#include "kernels/error.h"
#include "kernels/ops/elementwise.h"
#include "kernels/ops/reduction.h"

namespace nn {

using kernels::InvalidArgument;

GradScaler::GradScaler(const GradScalerOptions& o) : options_(o), scale_(o.init_scale) {
  if (!(o.init_scale > 0) || !std::isfinite(o.init_scale))
    throw InvalidArgument(fmt::format("GradScaler: init_scale {} (expected a finite value > 0)", o.init_scale));
  if (!(o.growth_factor > 1) || !std::isfinite(o.growth_factor))
    throw InvalidArgument(fmt::format("GradScaler: growth_factor {} (expected a finite value > 1)", o.growth_factor));
  if (!(o.backoff_factor > 0 && o.backoff_factor < 1))
    throw InvalidArgument(fmt::format("GradScaler: backoff_factor {} (expected 0 < value < 1)", o.backoff_factor));
  if (o.growth_interval < 1)
    throw InvalidArgument(fmt::format("GradScaler: growth_interval {} (expected >= 1)", o.growth_interval));
}

void GradScaler::update(bool found_inf) {
  if (found_inf) {
    scale_ *= options_.backoff_factor;
    tracker_ = 0;
    return;
  }
  if (++tracker_ == options_.growth_interval) {
    const double grown = scale_ * options_.growth_factor;
    if (std::isfinite(grown)) scale_ = grown;  // PyTorch keeps the scale when growing overflows
    tracker_ = 0;
  }
}

ScaledStep GradScaler::unscale_clip_(const NamedParameters& params, double max_norm) {
  ScaledStep out;
  out.scale = scale_;
  out.norm = std::numeric_limits<double>::quiet_NaN();
  std::vector<const dtensor::DTensor*> grads;
  for (const auto& [name, p] : params)
    if (p->grad()) grads.push_back(&*p->grad());
  if (grads.empty()) {
    out.stepped = true;
    out.norm = 0;
    update(false);
    return out;
  }
  // 1. The flag: any non-finite element this rank holds (sum of squares in f64: NaN or inf).
  const auto& comms = grads[0]->comms();
  double found = 0;
  if (comms->in_mesh())
    for (const dtensor::DTensor* g : grads)
      if (g->to_local().numel() > 0 && !std::isfinite(kernels::sum_of_squares(g->to_local()).item({}))) {
        found = 1;
        break;
      }
  const int ndim = comms->mesh().ndim();
  dtensor::Placements partial(ndim, dtensor::Replicate{});
  for (int m = 0; m < ndim; ++m)
    if (comms->mesh().size(m) > 1) partial[m] = dtensor::Partial{dtensor::ReduceOp::kMax};
  const kernels::Device device = grads[0]->to_local().device();
  const dtensor::DTensorSpec spec = dtensor::make_spec(grads[0]->spec().mesh, partial, {1}, kernels::DType::kF64);
  dtensor::DTensor flag(comms, spec,
                        comms->in_mesh() ? kernels::Tensor::full({1}, found, kernels::DType::kF64, device)
                                         : kernels::Tensor::empty({0}, kernels::DType::kF64, device));
  flag = flag.redistribute(dtensor::Placements(ndim, dtensor::Replicate{}));
  const bool found_inf = comms->in_mesh() && flag.to_local().to(kernels::Device{}).item({0}) != 0;
  // 2-3. Skip, or unscale and clip in one pass.
  double norm = std::numeric_limits<double>::quiet_NaN();
  if (!found_inf) norm = clip_grad_norm_(params, 0.0) / scale_;  // measures only
  if (found_inf || !std::isfinite(norm)) {
    update(true);
    return out;
  }
  const double coef = max_norm > 0 ? std::min(1.0, max_norm / (norm + 1e-6)) : 1.0;
  if (comms->in_mesh())
    for (const dtensor::DTensor* g : grads) kernels::scale_out(g->to_local(), g->to_local(), coef / scale_);
  out.stepped = true;
  out.norm = norm;
  update(false);
  return out;
}

}  // namespace nn
