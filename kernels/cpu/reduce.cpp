#include "kernels/reduce.h"

#include <algorithm>
#include <string>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/detail/convert.h"
#include "kernels/detail/dispatch.h"
#include "kernels/error.h"

namespace kernels::detail {
namespace {

template <class T, class F>
void combine(T* acc, const T* src, int64_t n, F f) {
  using C = compute_t<T>;
  if constexpr (std::is_same_v<C, T>) {
    for (int64_t i = 0; i < n; ++i) acc[i] = static_cast<T>(f(acc[i], src[i]));
  } else {
    for (int64_t i = 0; i < n; ++i)
      acc[i] = cast_value<T>(static_cast<C>(f(cast_value<C>(acc[i]), cast_value<C>(src[i]))));
  }
}

}  // namespace

void cpu_reduce_into(void* acc_ptr, const void* src_ptr, DType dtype, int64_t n, ReduceOp op,
                     double src_scale) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    using C = compute_t<T>;
    T* acc = static_cast<T*>(acc_ptr);
    const T* src = static_cast<const T*>(src_ptr);
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        if (src_scale != 1.0) {
          if constexpr (std::is_floating_point_v<C>) {
            const C m = static_cast<C>(src_scale);
            return combine(acc, src, n, [m](C a, C b) { return a + b * m; });
          } else {
            return combine(acc, src, n, [src_scale](C a, C b) {
              return static_cast<C>(a + cast_value<C>(static_cast<double>(b) * src_scale));
            });
          }
        }
        return combine(acc, src, n, [](C a, C b) { return a + b; });
      case ReduceOp::kProd:
        return combine(acc, src, n, [](C a, C b) { return a * b; });
      // NaN propagates through min and max, as in torch.minimum / NCCL.
      case ReduceOp::kMin:
        return combine(acc, src, n, [](C a, C b) { return b < a || b != b ? b : a; });
      case ReduceOp::kMax:
        return combine(acc, src, n, [](C a, C b) { return b > a || b != b ? b : a; });
    }
  });
}

void cpu_scale(void* data, DType dtype, int64_t n, double factor) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    using C = compute_t<T>;
    T* d = static_cast<T*>(data);
    if constexpr (std::is_floating_point_v<C>) {
      const C f = static_cast<C>(factor);
      for (int64_t i = 0; i < n; ++i) d[i] = cast_value<T>(static_cast<C>(cast_value<C>(d[i]) * f));
    } else {
      for (int64_t i = 0; i < n; ++i) d[i] = cast_value<T>(static_cast<double>(d[i]) * factor);
    }
  });
}

}  // namespace kernels::detail

namespace kernels {

namespace {
void check_pair(const char* what, const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || !(a.shape() == b.shape()) || !(a.device() == b.device()))
    throw InvalidArgument(std::string(what) + ": operands differ in dtype, shape or device (" +
                          std::string(to_string(a.dtype())) + " on " + to_string(a.device()) +
                          " vs " + std::string(to_string(b.dtype())) + " on " +
                          to_string(b.device()) + ")");
  if (!a.is_contiguous() || !b.is_contiguous())
    throw InvalidArgument(std::string(what) + ": operands must be contiguous");
}
}  // namespace

void reduce_into(const Tensor& acc, const Tensor& src, ReduceOp op, double src_scale) {
  check_pair("reduce_into", acc, src);
  if (src_scale != 1.0 && op != ReduceOp::kSum && op != ReduceOp::kAvg)
    throw InvalidArgument("reduce_into: a pre-multiplier needs a sum or avg, got " +
                          std::string(to_string(op)));
  if (acc.numel() == 0) return;
  if (acc.device().is_cuda()) {
    detail::cuda_reduce_into(acc.data_ptr(), src.data_ptr(), acc.dtype(), acc.numel(), op,
                             src_scale, acc.device().index);
    return;
  }
  detail::cpu_reduce_into(acc.data_ptr(), src.data_ptr(), acc.dtype(), acc.numel(), op, src_scale);
}

void scale_(const Tensor& t, double factor) {
  if (!t.is_contiguous()) throw InvalidArgument("scale_: tensor must be contiguous");
  if (t.numel() == 0) return;
  if (t.device().is_cuda()) {
    detail::cuda_scale(t.data_ptr(), t.dtype(), t.numel(), factor, t.device().index);
    return;
  }
  detail::cpu_scale(t.data_ptr(), t.dtype(), t.numel(), factor);
}

}  // namespace kernels
