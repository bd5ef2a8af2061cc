#include "kernels/ops/reduction.h"

#include <fmt/format.h>

#include <array>
#include <limits>
#include <vector>

#include "kernels/cpu/compute.h"
#include "kernels/cuda/cuda_compute.h"
#include "kernels/detail/reduce_plan.h"
#include "kernels/error.h"
#include "kernels/format.h"
#include "kernels/ops/common.h"
#include "kernels/ops/elementwise.h"

namespace kernels {
namespace {

using detail::DimPlan;
using detail::ReducePlan;

// Which dims of an ndim tensor `dims` names; throws on out-of-range or repeated dims.
std::array<bool, kMaxDims> reduce_mask(const char* op, const Dims& dims, int ndim) {
  std::array<bool, kMaxDims> mask{};
  for (int64_t d : dims) {
    const int w = detail::wrap_dim(op, static_cast<int>(d), ndim);
    if (mask[w]) {
      throw InvalidArgument(
          fmt::format("{}: dim {} appears more than once in dims {}", op, w, dims));
    }
    mask[w] = true;
  }
  return mask;
}

Dims reduced_shape(const Dims& shape, const std::array<bool, kMaxDims>& mask, bool keepdim) {
  Dims out;
  for (int d = 0; d < shape.size(); ++d) {
    if (!mask[d]) {
      out.push_back(shape[d]);
    } else if (keepdim) {
      out.push_back(1);
    }
  }
  return out;
}

void run_reduce(const char* op, const Tensor& out, const Tensor& x, const Dims& dims, bool keepdim,
                bool accumulate, bool mean) {
  detail::check_floating(op, x, "x");
  detail::check_floating(op, out, "out");
  detail::check_same_device(op, {{"x", x}, {"out", out}});
  const auto mask = reduce_mask(op, dims, x.ndim());
  detail::check_shape(op, out, "out", reduced_shape(x.shape(), mask, keepdim));
  detail::check_writable(op, out, "out");
  if (detail::may_overlap(out, x)) {
    throw InvalidArgument(fmt::format("{}: out overlaps x (expected separate storage)", op));
  }
  ReducePlan p;
  p.x = x.numel() > 0 ? x.data_ptr() : nullptr;
  p.x_dtype = x.dtype();
  int od = 0;
  int64_t count = 1;
  for (int d = 0; d < x.ndim(); ++d) {
    if (mask[d]) {
      p.reduced_shape.push_back(x.size(d));
      p.reduced_x_strides.push_back(x.stride(d));
      count *= x.size(d);
      if (keepdim) ++od;
    } else {
      p.kept_shape.push_back(x.size(d));
      p.kept_x_strides.push_back(x.stride(d));
      p.out_strides.push_back(out.stride(od++));
    }
  }
  if (out.numel() == 0) return;
  p.out = out.data_ptr();
  p.out_dtype = out.dtype();
  p.scale = mean ? (count == 0 ? std::numeric_limits<double>::quiet_NaN()
                               : 1.0 / static_cast<double>(count))
                 : 1.0;
  p.accumulate = accumulate;
  if (x.device().is_cuda()) {
    detail::cuda_reduce(p, x.device().index);
  } else {
    detail::cpu_reduce(p);
  }
}

Dims all_dims(int ndim) {
  Dims d;
  for (int i = 0; i < ndim; ++i) d.push_back(i);
  return d;
}

}  // namespace

Tensor sum(const Tensor& x, const Dims& dims, bool keepdim) {
  detail::check_floating("sum", x, "x");
  Tensor out = Tensor::empty(reduced_shape(x.shape(), reduce_mask("sum", dims, x.ndim()), keepdim),
                             x.dtype(), x.device());
  run_reduce("sum", out, x, dims, keepdim, false, false);
  return out;
}

void sum_out(const Tensor& out, const Tensor& x, const Dims& dims, bool keepdim, bool accumulate) {
  run_reduce("sum_out", out, x, dims, keepdim, accumulate, false);
}

Tensor sum_all(const Tensor& x) {
  detail::check_floating("sum_all", x, "x");
  return sum(x, all_dims(x.ndim()), false);
}

Tensor mean(const Tensor& x, const Dims& dims, bool keepdim) {
  detail::check_floating("mean", x, "x");
  Tensor out = Tensor::empty(reduced_shape(x.shape(), reduce_mask("mean", dims, x.ndim()), keepdim),
                             x.dtype(), x.device());
  run_reduce("mean", out, x, dims, keepdim, false, true);
  return out;
}

MaxResult max(const Tensor& x, int dim_in, bool keepdim) {
  constexpr const char* kOp = "max";
  detail::check_floating(kOp, x, "x");
  const int dim = detail::wrap_dim(kOp, dim_in, x.ndim());
  if (x.size(dim) == 0) {
    throw InvalidArgument(
        fmt::format("{}: dim {} of x {} has size 0 (a max over no elements is undefined)", kOp, dim,
                    x.shape()));
  }
  Dims outer = x.shape();
  outer.erase(dim);
  MaxResult r{Tensor::empty(outer, x.dtype(), x.device()),
              Tensor::empty(outer, DType::kI64, x.device())};
  if (r.values.numel() > 0) {
    DimPlan p;
    p.outer_shape = outer;
    p.len = x.size(dim);
    p.x = x.data_ptr();
    p.x_dtype = x.dtype();
    p.x_outer_strides = detail::strides_without(x, dim);
    p.x_dim_stride = x.stride(dim);
    p.values = r.values.data_ptr();
    p.indices = static_cast<int64_t*>(r.indices.data_ptr());
    if (x.device().is_cuda()) {
      detail::cuda_max_dim(p, x.device().index);
    } else {
      detail::cpu_max_dim(p);
    }
  }
  if (keepdim) {
    r.values = r.values.unsqueeze(dim);
    r.indices = r.indices.unsqueeze(dim);
  }
  return r;
}

Tensor max_backward(const Tensor& dy_in, const Tensor& indices_in, int dim_in,
                    const Dims& input_shape, bool keepdim) {
  constexpr const char* kOp = "max_backward";
  detail::check_floating(kOp, dy_in, "dy");
  detail::check_defined(kOp, indices_in, "indices");
  detail::check_dtype(kOp, indices_in, "indices", DType::kI64);
  detail::check_same_device(kOp, {{"dy", dy_in}, {"indices", indices_in}});
  const int dim = detail::wrap_dim(kOp, dim_in, input_shape.size());
  Dims outer = input_shape;
  outer.erase(dim);
  Dims expected = outer;
  if (keepdim) expected.insert(dim, 1);
  detail::check_shape(kOp, dy_in, "dy", expected);
  detail::check_shape(kOp, indices_in, "indices", expected);
  Tensor dx = Tensor::zeros(input_shape, dy_in.dtype(), dy_in.device());
  if (dx.numel() == 0) return dx;
  if (dx.device().is_cuda()) {  // the CPU kernel checks inline
    const std::vector<double> idx = indices_in.to_vector();
    for (size_t o = 0; o < idx.size(); ++o) {
      if (idx[o] < 0 || idx[o] >= static_cast<double>(input_shape[dim])) {
        throw InvalidArgument(
            fmt::format("{}: index {} at position {} is out of range for a dim of size {}", kOp,
                        static_cast<int64_t>(idx[o]), o, input_shape[dim]));
      }
    }
  }
  const Tensor dy = keepdim ? dy_in.select(dim, 0) : dy_in;
  const Tensor index = keepdim ? indices_in.select(dim, 0) : indices_in;
  DimPlan p;
  p.outer_shape = outer;
  p.len = input_shape[dim];
  p.dx = dx.data_ptr();
  p.dx_dtype = dx.dtype();
  p.dx_outer_strides = detail::strides_without(dx, dim);
  p.dx_dim_stride = dx.stride(dim);
  p.dy = dy.data_ptr();
  p.dy_dtype = dy.dtype();
  p.dy_outer_strides = dy.strides();
  p.index = static_cast<const int64_t*>(index.data_ptr());
  p.index_outer_strides = index.strides();
  if (dx.device().is_cuda()) {
    detail::cuda_scatter_dim(p, dx.device().index);
  } else {
    detail::cpu_scatter_dim(p);
  }
  return dx;
}

Tensor sum_to_shape(const Tensor& x, const Dims& shape) {
  constexpr const char* kOp = "sum_to_shape";
  detail::check_floating(kOp, x, "x");
  bool ok = shape.size() <= x.ndim();
  for (int i = 0; ok && i < shape.size(); ++i) {
    const int64_t xs = x.size(x.ndim() - shape.size() + i);
    ok = shape[i] == xs || shape[i] == 1;
  }
  if (!ok) {
    throw InvalidArgument(fmt::format(
        "{}: shape {} does not broadcast to x's shape {} (expected a shape x was broadcast from)",
        kOp, shape, x.shape()));
  }
  const int lead = x.ndim() - shape.size();
  Dims dims;
  for (int d = 0; d < x.ndim(); ++d) {
    if (d < lead || (shape[d - lead] == 1 && x.size(d) != 1)) dims.push_back(d);
  }
  return sum(x, dims, true).view(shape);
}

Tensor sum_of_squares(const Tensor& x) {
  constexpr const char* kOp = "sum_of_squares";
  detail::check_floating(kOp, x, "x");
  Tensor out = Tensor::zeros({}, DType::kF64, x.device());
  if (x.numel() == 0) return out;
  ReducePlan p;
  p.x = x.data_ptr();
  p.x_dtype = x.dtype();
  p.reduced_shape = x.shape();
  p.reduced_x_strides = x.strides();
  p.out = out.data_ptr();
  p.out_dtype = DType::kF64;
  p.square = true;
  if (x.device().is_cuda()) {
    detail::cuda_reduce(p, x.device().index);
  } else {
    detail::cpu_reduce(p);
  }
  return out;
}

}  // namespace kernels
