// CPU reductions: sums in f64 accumulators walked in x's memory order (so a column sum over rows
// and a row sum are both unit-stride loops), max with argmax along one dim, and its scatter.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "kernels/cpu/compute.h"
#include "kernels/cpu/copy.h"
#include "kernels/cpu/strided.h"
#include "kernels/cpu/vec.h"
#include "kernels/error.h"

namespace kernels::detail {
namespace {

template <class C>
void sum_rows(const ReducePlan& p, const StridedSpace<2>& space, double* acc) {
  const VecOps<C>& v = vec_ops<C>();
  constexpr DType kC = dtype_of_v<C>;
  const int64_t acc_inner = space.strides[0].back();
  const int64_t x_inner = space.strides[1].back();
  constexpr int64_t kChunk = 512;
  alignas(64) C buf[kChunk];
  for_each_row<2>(space, [&](const std::array<int64_t, 2>& off, int64_t n) {
    double* a = acc + off[0];
    for (int64_t s = 0; s < n; s += kChunk) {
      const int64_t len = std::min(kChunk, n - s);
      const C* x;
      if (p.x_dtype == kC && x_inner == 1) {
        x = static_cast<const C*>(at(p.x, kC, off[1] + s));
      } else {
        load_row<C>(buf, at(p.x, p.x_dtype, off[1] + s * x_inner), p.x_dtype, x_inner, len);
        x = buf;
      }
      if (acc_inner == 0) {
        a[0] += p.square ? v.sum_squares(x, len) : v.sum(x, len);
      } else if (acc_inner == 1 && !p.square) {
        v.accumulate(a + s, x, len);
      } else if (acc_inner == 1) {
        v.accumulate_product(a + s, x, x, len);
      } else {
        for (int64_t i = 0; i < len; ++i) {
          const double xi = static_cast<double>(x[i]);
          a[(s + i) * acc_inner] += p.square ? xi * xi : xi;
        }
      }
    }
  });
}

}  // namespace

void cpu_reduce(const ReducePlan& p) {
  const int64_t outputs = p.kept_shape.product();
  if (outputs == 0) return;
  std::vector<double> acc(static_cast<size_t>(outputs), 0.0);
  if (p.reduced_shape.product() > 0) {
    // The full space of x (kept dims, then reduced dims), with the accumulator's strides
    // (contiguous over the kept dims, 0 over the reduced ones), ordered by x's strides so the
    // innermost loop walks memory.
    const int nk = p.kept_shape.size(), nr = p.reduced_shape.size();
    Dims shape, acc_strides, x_strides;
    const Dims kept_acc = [&] {
      Dims s = Dims::filled(nk, 1);
      for (int d = nk - 2; d >= 0; --d) s[d] = s[d + 1] * p.kept_shape[d + 1];
      return s;
    }();
    std::array<int, 2 * kMaxDims> order{};
    for (int d = 0; d < nk + nr; ++d) order[d] = d;
    auto x_stride = [&](int d) {
      return d < nk ? p.kept_x_strides[d] : p.reduced_x_strides[d - nk];
    };
    std::stable_sort(order.begin(), order.begin() + nk + nr,
                     [&](int a, int b) { return x_stride(a) > x_stride(b); });
    for (int i = 0; i < nk + nr; ++i) {
      const int d = order[i];
      shape.push_back(d < nk ? p.kept_shape[d] : p.reduced_shape[d - nk]);
      acc_strides.push_back(d < nk ? kept_acc[d] : 0);
      x_strides.push_back(x_stride(d));
    }
    const auto space = coalesce<2>(shape, {acc_strides, x_strides});
    if (p.x_dtype == DType::kF64) {
      sum_rows<double>(p, space, acc.data());
    } else {
      sum_rows<float>(p, space, acc.data());
    }
  }
  // out[o] = scale * acc[o] (+ out[o]), rounded once to out's dtype.
  dispatch_dtype(p.out_dtype, [&](auto tag) {
    using D = decltype(tag);
    D* out = static_cast<D*>(p.out);
    for (int64_t o = 0; o < outputs; ++o) {
      D& dst = out[offset_of(o, p.kept_shape, p.out_strides)];
      double r = acc[static_cast<size_t>(o)] * p.scale;
      if (p.accumulate) r += to_double(dst);
      dst = cast_value<D>(r);
    }
  });
}

void cpu_max_dim(const DimPlan& p) {
  const int64_t outputs = p.outer_shape.product();
  dispatch_dtype(p.x_dtype, [&](auto tag) {
    using T = decltype(tag);
    using C = compute_t<T>;
    if constexpr (std::is_floating_point_v<C>) {
      const T* x = static_cast<const T*>(p.x);
      T* values = static_cast<T*>(p.values);
      for (int64_t o = 0; o < outputs; ++o) {
        const T* row = x + offset_of(o, p.outer_shape, p.x_outer_strides);
        C best = cast_value<C>(row[0]);
        int64_t arg = 0;
        if (!std::isnan(best)) {
          for (int64_t j = 1; j < p.len; ++j) {
            const C v = cast_value<C>(row[j * p.x_dim_stride]);
            if (std::isnan(v)) {
              best = v, arg = j;
              break;
            }
            if (v > best) best = v, arg = j;
          }
        }
        values[o] = cast_value<T>(best);
        p.indices[o] = arg;
      }
    } else {
      throw InternalError("cpu_max_dim: integer dtype");
    }
  });
}

void cpu_scatter_dim(const DimPlan& p) {
  const int64_t outputs = p.outer_shape.product();
  const size_t dx_size = itemsize(p.dx_dtype);
  const size_t dy_size = itemsize(p.dy_dtype);
  for (int64_t o = 0; o < outputs; ++o) {
    const int64_t j = p.index[offset_of(o, p.outer_shape, p.index_outer_strides)];
    if (j < 0 || j >= p.len) {
      throw InvalidArgument("max_backward: index " + std::to_string(j) + " at position " +
                            std::to_string(o) + " is out of range for a dim of size " +
                            std::to_string(p.len));
    }
    const char* src =
        static_cast<const char*>(p.dy) +
        offset_of(o, p.outer_shape, p.dy_outer_strides) * static_cast<int64_t>(dy_size);
    char* dst = static_cast<char*>(p.dx) +
                (offset_of(o, p.outer_shape, p.dx_outer_strides) + j * p.dx_dim_stride) *
                    static_cast<int64_t>(dx_size);
    store_from_double(dst, p.dx_dtype, load_as_double(src, p.dy_dtype));
  }
}

}  // namespace kernels::detail
