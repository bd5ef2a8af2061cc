#include "kernels/ops/elementwise.h"

#include <fmt/format.h>

#include "kernels/cpu/compute.h"
#include "kernels/cuda/cuda_compute.h"
#include "kernels/error.h"
#include "kernels/format.h"
#include "kernels/ops/common.h"

namespace kernels {

Dims broadcast_shapes(const Dims& a, const Dims& b) {
  const int n = std::max(a.size(), b.size());
  Dims out = Dims::filled(n, 1);
  for (int i = 0; i < n; ++i) {
    const int ia = a.size() - n + i, ib = b.size() - n + i;
    const int64_t sa = ia >= 0 ? a[ia] : 1;
    const int64_t sb = ib >= 0 ? b[ib] : 1;
    if (sa != sb && sa != 1 && sb != 1) {
      throw InvalidArgument(fmt::format(
          "shapes {} and {} do not broadcast: dim {} (from the right: {}) has sizes {} and {}", a,
          b, i, n - i, sa, sb));
    }
    out[i] = sa == 1 ? sb : sa;
  }
  return out;
}

Tensor expand(const Tensor& t, const Dims& shape) {
  detail::check_defined("expand", t, "tensor");
  const int n = shape.size();
  if (n < t.ndim()) {
    throw InvalidArgument(
        fmt::format("expand: cannot expand shape {} to {} (fewer dims)", t.shape(), shape));
  }
  Dims out_shape = shape, strides = Dims::filled(n, 0);
  for (int i = 0; i < n; ++i) {
    const int it = t.ndim() - n + i;
    if (it < 0) {
      if (shape[i] < 0) {
        throw InvalidArgument(
            fmt::format("expand: size -1 is not allowed in the new leading dim "
                        "{} of {}",
                        i, shape));
      }
      continue;
    }
    if (shape[i] == -1) out_shape[i] = t.size(it);
    if (out_shape[i] == t.size(it)) {
      strides[i] = t.stride(it);
    } else if (t.size(it) != 1) {
      throw InvalidArgument(
          fmt::format("expand: cannot expand shape {} to {}: dim {} has size {} (expected {} or 1)",
                      t.shape(), shape, it, t.size(it), out_shape[i]));
    }
  }
  return t.as_strided(out_shape, strides, t.storage_offset());
}

namespace {

using detail::MapOp;

// out = op(a[, b]); broadcast: b broadcasts against a (binary arithmetic), else b must have a's
// shape (the backward maps).
void run_map(const char* op, MapOp mop, double alpha, const Tensor& out, const Tensor& a,
             const Tensor* b, bool broadcast) {
  detail::check_floating(op, a, b == nullptr ? "x" : (broadcast ? "a" : "dy"));
  if (b != nullptr) {
    detail::check_floating(op, *b, broadcast ? "b" : "x");
    if (!broadcast) detail::check_same_dtype(op, {{"dy", a}, {"x", *b}});
  }
  detail::check_floating(op, out, "out");
  detail::check_same_device(op, {{"a", a}, {"b", b != nullptr ? *b : a}, {"out", out}});
  Dims shape = a.shape();
  if (b != nullptr) {
    if (broadcast) {
      shape = broadcast_shapes(a.shape(), b->shape());
    } else if (!(a.shape() == b->shape())) {
      throw InvalidArgument(fmt::format("{}: dy has shape {} but x has {} (expected the same)", op,
                                        a.shape(), b->shape()));
    }
  }
  detail::check_shape(op, out, "out", shape);
  detail::check_writable(op, out, "out");
  for (const Tensor* in : {&a, b}) {
    if (in != nullptr && !detail::same_view(out, *in) && detail::may_overlap(out, *in)) {
      throw InvalidArgument(fmt::format(
          "{}: out overlaps an input without being the same view (in-place needs out to be "
          "exactly the input view)",
          op));
    }
  }
  if (out.numel() == 0) return;
  const Tensor ea = expand(a, shape);
  const Tensor eb = b != nullptr ? expand(*b, shape) : Tensor();
  if (out.device().is_cuda()) {
    const detail::MapOperand in0{ea.data_ptr(), ea.dtype(), ea.strides()};
    const detail::MapOperand in1 =
        b != nullptr ? detail::MapOperand{eb.data_ptr(), eb.dtype(), eb.strides()} : in0;
    detail::cuda_map(mop, alpha, out.data_ptr(), out.dtype(), out.strides(), shape, in0,
                     b != nullptr ? &in1 : nullptr, out.device().index);
  } else {
    detail::cpu_map(mop, alpha, out, &ea, b != nullptr ? &eb : nullptr);
  }
}

Tensor empty_like_shape(const Tensor& like, const Dims& shape) {
  return Tensor::empty(shape, like.dtype(), like.device());
}

// torch's promotion among the floating dtypes.
DType promote(DType a, DType b) {
  if (a == b) return a;
  if (a == DType::kF64 || b == DType::kF64) return DType::kF64;
  return DType::kF32;
}

Tensor binary(const char* op, MapOp mop, double alpha, const Tensor& a, const Tensor& b) {
  detail::check_floating(op, a, "a");
  detail::check_floating(op, b, "b");
  Tensor out = Tensor::empty(broadcast_shapes(a.shape(), b.shape()), promote(a.dtype(), b.dtype()),
                             a.device());
  run_map(op, mop, alpha, out, a, &b, true);
  return out;
}

Tensor unary(const char* op, MapOp mop, double alpha, const Tensor& x) {
  detail::check_defined(op, x, "x");
  Tensor out = empty_like_shape(x, x.shape());
  run_map(op, mop, alpha, out, x, nullptr, false);
  return out;
}

Tensor backward(const char* op, MapOp mop, const Tensor& dy, const Tensor& x) {
  detail::check_defined(op, dy, "dy");
  Tensor out = empty_like_shape(dy, dy.shape());
  run_map(op, mop, 1.0, out, dy, &x, false);
  return out;
}

MapOp gelu_op(GeluApproximation a) {
  return a == GeluApproximation::kTanh ? MapOp::kGeluTanh : MapOp::kGelu;
}
MapOp gelu_backward_op(GeluApproximation a) {
  return a == GeluApproximation::kTanh ? MapOp::kGeluTanhBackward : MapOp::kGeluBackward;
}

}  // namespace

Tensor add(const Tensor& a, const Tensor& b, double alpha) {
  return binary("add", MapOp::kAdd, alpha, a, b);
}
void add_out(const Tensor& out, const Tensor& a, const Tensor& b, double alpha) {
  run_map("add_out", MapOp::kAdd, alpha, out, a, &b, true);
}
Tensor mul(const Tensor& a, const Tensor& b) { return binary("mul", MapOp::kMul, 1.0, a, b); }
void mul_out(const Tensor& out, const Tensor& a, const Tensor& b) {
  run_map("mul_out", MapOp::kMul, 1.0, out, a, &b, true);
}
Tensor scale(const Tensor& a, double alpha) { return unary("scale", MapOp::kScale, alpha, a); }
void scale_out(const Tensor& out, const Tensor& a, double alpha) {
  run_map("scale_out", MapOp::kScale, alpha, out, a, nullptr, false);
}

Tensor gelu(const Tensor& x, GeluApproximation approximation) {
  return unary("gelu", gelu_op(approximation), 1.0, x);
}
void gelu_out(const Tensor& out, const Tensor& x, GeluApproximation approximation) {
  run_map("gelu_out", gelu_op(approximation), 1.0, out, x, nullptr, false);
}
Tensor gelu_backward(const Tensor& dy, const Tensor& x, GeluApproximation approximation) {
  return backward("gelu_backward", gelu_backward_op(approximation), dy, x);
}
void gelu_backward_out(const Tensor& dx, const Tensor& dy, const Tensor& x,
                       GeluApproximation approximation) {
  run_map("gelu_backward_out", gelu_backward_op(approximation), 1.0, dx, dy, &x, false);
}

Tensor silu(const Tensor& x) { return unary("silu", MapOp::kSilu, 1.0, x); }
void silu_out(const Tensor& out, const Tensor& x) {
  run_map("silu_out", MapOp::kSilu, 1.0, out, x, nullptr, false);
}
Tensor silu_backward(const Tensor& dy, const Tensor& x) {
  return backward("silu_backward", MapOp::kSiluBackward, dy, x);
}
void silu_backward_out(const Tensor& dx, const Tensor& dy, const Tensor& x) {
  run_map("silu_backward_out", MapOp::kSiluBackward, 1.0, dx, dy, &x, false);
}

}  // namespace kernels
