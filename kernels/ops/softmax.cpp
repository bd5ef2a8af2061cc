#include "kernels/ops/softmax.h"

#include <fmt/format.h>

#include "kernels/cpu/compute.h"
#include "kernels/cuda/cuda_compute.h"
#include "kernels/detail/row_plan.h"
#include "kernels/error.h"
#include "kernels/format.h"
#include "kernels/ops/common.h"

namespace kernels {
namespace {

// out = softmax-family(x[, dy]) along dim. `in` is x (forward) or y (backward).
void run_softmax(const char* op, const Tensor& out, const Tensor& in, const Tensor* dy, int dim_in,
                 bool log) {
  const bool backward = dy != nullptr;
  const char* in_name = backward ? "y" : "x";
  detail::check_floating(op, in, in_name);
  detail::check_floating(op, out, backward ? "dx" : "y");
  if (backward) {
    detail::check_floating(op, *dy, "dy");
    detail::check_same_dtype(op, {{"dy", *dy}, {"y", in}});
    detail::check_shape(op, *dy, "dy", in.shape());
  }
  detail::check_same_device(op, {{in_name, in}, {"dy", backward ? *dy : in}, {"out", out}});
  const int dim = detail::wrap_dim(op, dim_in, in.ndim());
  detail::check_shape(op, out, backward ? "dx" : "y", in.shape());
  detail::check_writable(op, out, "out");
  for (const Tensor* t : {&in, dy}) {
    if (t != nullptr && !detail::same_view(out, *t) && detail::may_overlap(out, *t)) {
      throw InvalidArgument(
          fmt::format("{}: the output overlaps an input without being the same view", op));
    }
  }
  if (out.numel() == 0) return;
  detail::SoftmaxPlan p;
  p.outer_shape = in.shape();
  p.outer_shape.erase(dim);
  p.len = in.size(dim);
  p.log = log;
  p.backward = backward;
  p.x = detail::as_rows(in, dim);
  if (backward) p.dy = detail::as_rows(*dy, dim);
  p.out = detail::as_rows(out, dim);
  if (out.device().is_cuda()) {
    detail::cuda_softmax(p, out.device().index);
  } else {
    detail::cpu_softmax(p);
  }
}

Tensor like(const Tensor& t) {
  detail::check_defined("softmax", t, "input");
  return Tensor::empty(t.shape(), t.dtype(), t.device());
}

}  // namespace

Tensor softmax(const Tensor& x, int dim) {
  Tensor y = like(x);
  run_softmax("softmax", y, x, nullptr, dim, false);
  return y;
}
void softmax_out(const Tensor& y, const Tensor& x, int dim) {
  run_softmax("softmax_out", y, x, nullptr, dim, false);
}
Tensor softmax_backward(const Tensor& dy, const Tensor& y, int dim) {
  Tensor dx = like(dy);
  run_softmax("softmax_backward", dx, y, &dy, dim, false);
  return dx;
}
void softmax_backward_out(const Tensor& dx, const Tensor& dy, const Tensor& y, int dim) {
  run_softmax("softmax_backward_out", dx, y, &dy, dim, false);
}
Tensor log_softmax(const Tensor& x, int dim) {
  Tensor y = like(x);
  run_softmax("log_softmax", y, x, nullptr, dim, true);
  return y;
}
void log_softmax_out(const Tensor& y, const Tensor& x, int dim) {
  run_softmax("log_softmax_out", y, x, nullptr, dim, true);
}
Tensor log_softmax_backward(const Tensor& dy, const Tensor& y, int dim) {
  Tensor dx = like(dy);
  run_softmax("log_softmax_backward", dx, y, &dy, dim, true);
  return dx;
}
void log_softmax_backward_out(const Tensor& dx, const Tensor& dy, const Tensor& y, int dim) {
  run_softmax("log_softmax_backward_out", dx, y, &dy, dim, true);
}

}  // namespace kernels
