#include "kernels/ops/norm.h"

#include <fmt/format.h>

#include <cmath>

#include "kernels/cpu/compute.h"
#include "kernels/cuda/cuda_compute.h"
#include "kernels/detail/row_plan.h"
#include "kernels/error.h"
#include "kernels/format.h"
#include "kernels/ops/common.h"

namespace kernels {
namespace {

using detail::NormPlan;

// x [..., D] and the [D] affine parameters (either may be undefined).
int64_t check_input(const char* op, const Tensor& x, const Tensor& weight, const Tensor& bias) {
  detail::check_floating(op, x, "x");
  if (x.ndim() < 1) {
    throw InvalidArgument(fmt::format("{}: x is 0-d, expected at least 1 dim [..., D]", op));
  }
  const int64_t d = x.size(-1);
  for (const auto& [name, t] : {std::pair<const char*, const Tensor&>{"weight", weight},
                                std::pair<const char*, const Tensor&>{"bias", bias}}) {
    if (!t.defined()) continue;
    detail::check_floating(op, t, name);
    detail::check_shape(op, t, name, Dims{d});
  }
  detail::check_same_device(op, {{"x", x}, {"weight", weight}, {"bias", bias}});
  return d;
}

void check_stat(const char* op, const Tensor& t, const char* name, const Tensor& x) {
  detail::check_defined(op, t, name);
  detail::check_shape(op, t, name, detail::drop_last(x.shape()));
  detail::check_dtype(op, t, name, detail::stats_dtype(x.dtype()));
  detail::check_same_device(op, {{"x", x}, {name, t}});
}

void check_output(const char* op, const Tensor& t, const char* name, const Dims& shape,
                  const Tensor& x) {
  detail::check_floating(op, t, name);
  detail::check_shape(op, t, name, shape);
  detail::check_writable(op, t, name);
  detail::check_same_device(op, {{"x", x}, {name, t}});
}

void check_disjoint(const char* op, std::initializer_list<detail::Named> outs,
                    std::initializer_list<detail::Named> ins) {
  for (const auto& o : outs) {
    for (const auto& i : ins) {
      if (detail::may_overlap(o.t, i.t)) {
        throw InvalidArgument(
            fmt::format("{}: {} overlaps {} (expected separate storage)", op, o.name, i.name));
      }
    }
  }
}

void forward(const char* op, bool rms, const Tensor& y, const Tensor& mean, const Tensor& rstd,
             const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  const int64_t d = check_input(op, x, weight, bias);
  check_output(op, y, "y", x.shape(), x);
  if (!rms) check_stat(op, mean, "mean", x);
  check_stat(op, rstd, "rstd", x);
  detail::check_writable(op, rstd, "rstd");
  if (!rms) detail::check_writable(op, mean, "mean");
  if (!(eps >= 0) || std::isinf(eps)) {
    throw InvalidArgument(fmt::format("{}: eps is {}, expected a finite value >= 0", op, eps));
  }
  check_disjoint(op, {{"y", y}, {"rstd", rstd}, {"mean", mean}},
                 {{"x", x}, {"weight", weight}, {"bias", bias}});
  check_disjoint(op, {{"y", y}}, {{"rstd", rstd}, {"mean", mean}});
  if (rstd.numel() == 0) return;
  NormPlan p;
  p.outer_shape = detail::drop_last(x.shape());
  p.len = d;
  p.rms = rms;
  p.eps = eps;
  p.x = detail::as_rows(x, -1 + x.ndim());
  p.y = detail::as_rows(y, -1 + y.ndim());
  p.rstd.data = rstd.data_ptr();
  p.rstd.dtype = rstd.dtype();
  p.rstd.outer_strides = rstd.strides();
  if (!rms) {
    p.mean.data = mean.data_ptr();
    p.mean.dtype = mean.dtype();
    p.mean.outer_strides = mean.strides();
  }
  p.weight = detail::as_col(weight);
  p.bias = detail::as_col(bias);
  if (x.device().is_cuda()) {
    detail::cuda_norm_forward(p, x.device().index);
  } else {
    detail::cpu_norm_forward(p);
  }
}

void backward(const char* op, bool rms, const Tensor& dx, const Tensor& dweight,
              const Tensor& dbias, const Tensor& dy, const Tensor& x, const Tensor& weight,
              const Tensor& mean, const Tensor& rstd, bool accumulate) {
  const int64_t d = check_input(op, x, weight, Tensor());
  detail::check_floating(op, dy, "dy");
  detail::check_shape(op, dy, "dy", x.shape());
  detail::check_same_device(op, {{"x", x}, {"dy", dy}});
  if (!rms) check_stat(op, mean, "mean", x);
  check_stat(op, rstd, "rstd", x);
  if (dx.defined()) check_output(op, dx, "dx", x.shape(), x);
  if (dweight.defined()) {
    if (!weight.defined()) {
      throw InvalidArgument(fmt::format("{}: dweight given but weight is undefined", op));
    }
    check_output(op, dweight, "dweight", Dims{d}, x);
  }
  if (dbias.defined()) check_output(op, dbias, "dbias", Dims{d}, x);
  check_disjoint(op, {{"dx", dx}, {"dweight", dweight}, {"dbias", dbias}},
                 {{"x", x}, {"dy", dy}, {"weight", weight}, {"mean", mean}, {"rstd", rstd}});
  check_disjoint(op, {{"dx", dx}}, {{"dweight", dweight}, {"dbias", dbias}});
  check_disjoint(op, {{"dweight", dweight}}, {{"dbias", dbias}});
  NormPlan p;
  p.outer_shape = detail::drop_last(x.shape());
  p.len = d;
  p.rms = rms;
  p.x = detail::as_rows(x, x.ndim() - 1);
  p.dy = detail::as_rows(dy, dy.ndim() - 1);
  if (dx.defined()) p.dx = detail::as_rows(dx, dx.ndim() - 1);
  if (rstd.numel() > 0) {
    p.rstd.data = rstd.data_ptr();
    p.rstd.dtype = rstd.dtype();
    p.rstd.outer_strides = rstd.strides();
    if (!rms) {
      p.mean.data = mean.data_ptr();
      p.mean.dtype = mean.dtype();
      p.mean.outer_strides = mean.strides();
    }
  }
  p.weight = detail::as_col(weight);
  p.dweight = detail::as_col(dweight);
  p.dbias = detail::as_col(dbias);
  p.accumulate = accumulate;
  if (p.outer_shape.product() == 0 || d == 0) {
    // No rows (or empty rows): the parameter gradients are sums over nothing.
    if (!accumulate) {
      for (const Tensor& g : {dweight, dbias}) {
        if (g.defined()) Tensor(g).fill_(0.0);
      }
    }
    return;
  }
  if (x.device().is_cuda()) {
    detail::cuda_norm_backward(p, x.device().index);
  } else {
    detail::cpu_norm_backward(p);
  }
}

Tensor stats_like(const Tensor& x) {
  return Tensor::empty(detail::drop_last(x.shape()), detail::stats_dtype(x.dtype()), x.device());
}

Tensor grad_like(const Tensor& t) {
  return t.defined() ? Tensor::empty(t.shape(), t.dtype(), t.device()) : Tensor();
}

}  // namespace

RmsNormOutput rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  check_input("rms_norm", x, weight, Tensor());
  RmsNormOutput r{Tensor::empty(x.shape(), x.dtype(), x.device()), stats_like(x)};
  forward("rms_norm", true, r.y, Tensor(), r.rstd, x, weight, Tensor(), eps);
  return r;
}

void rms_norm_out(const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& weight,
                  double eps) {
  forward("rms_norm_out", true, y, Tensor(), rstd, x, weight, Tensor(), eps);
}

RmsNormGrads rms_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                               const Tensor& rstd) {
  detail::check_defined("rms_norm_backward", x, "x");
  RmsNormGrads g{grad_like(x), grad_like(weight)};
  backward("rms_norm_backward", true, g.dx, g.dweight, Tensor(), dy, x, weight, Tensor(), rstd,
           false);
  return g;
}

void rms_norm_backward_out(const Tensor& dx, const Tensor& dweight, const Tensor& dy,
                           const Tensor& x, const Tensor& weight, const Tensor& rstd,
                           bool accumulate) {
  backward("rms_norm_backward_out", true, dx, dweight, Tensor(), dy, x, weight, Tensor(), rstd,
           accumulate);
}

LayerNormOutput layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  check_input("layer_norm", x, weight, bias);
  LayerNormOutput r{Tensor::empty(x.shape(), x.dtype(), x.device()), stats_like(x), stats_like(x)};
  forward("layer_norm", false, r.y, r.mean, r.rstd, x, weight, bias, eps);
  return r;
}

void layer_norm_out(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                    const Tensor& weight, const Tensor& bias, double eps) {
  forward("layer_norm_out", false, y, mean, rstd, x, weight, bias, eps);
}

LayerNormGrads layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                                   const Tensor& bias, const Tensor& mean, const Tensor& rstd) {
  detail::check_defined("layer_norm_backward", x, "x");
  if (bias.defined()) {
    detail::check_floating("layer_norm_backward", bias, "bias");
    detail::check_shape("layer_norm_backward", bias, "bias", Dims{x.ndim() > 0 ? x.size(-1) : 0});
  }
  LayerNormGrads g{grad_like(x), grad_like(weight), grad_like(bias)};
  backward("layer_norm_backward", false, g.dx, g.dweight, g.dbias, dy, x, weight, mean, rstd,
           false);
  return g;
}

void layer_norm_backward_out(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                             const Tensor& dy, const Tensor& x, const Tensor& weight,
                             const Tensor& mean, const Tensor& rstd, bool accumulate) {
  backward("layer_norm_backward_out", false, dx, dweight, dbias, dy, x, weight, mean, rstd,
           accumulate);
}

}  // namespace kernels
