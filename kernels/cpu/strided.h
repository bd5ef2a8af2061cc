// Internal: strided iteration and chunked dtype conversion for the CPU compute kernels.
//   for_each_row<2>(coalesce<2>(shape, {out_strides, in_strides}),
//                   [&](const std::array<int64_t, 2>& offsets, int64_t n) { ... });
//   load_row<float>(buf, ptr, DType::kBF16, stride, n);   // n bf16 values, widened
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/cpu/vec.h"
#include "kernels/detail/convert.h"
#include "kernels/detail/dispatch.h"
#include "kernels/detail/layout.h"
#include "kernels/dims.h"
#include "kernels/dtype.h"
#include "kernels/error.h"

namespace kernels::detail {

// Calls row(offsets, n) once per innermost row of the space; offsets are element offsets of the
// row's first element in each operand. REQUIRES: space.shape has at least one dim, numel > 0.
template <int N, class F>
void for_each_row(const StridedSpace<N>& space, F&& row) {
  const int nd = space.shape.size();
  const int64_t inner = space.shape[nd - 1];
  std::array<int64_t, N> offsets{};
  std::array<int64_t, kMaxDims> index{};
  for (;;) {
    row(offsets, inner);
    int d = nd - 2;
    for (; d >= 0; --d) {
      if (++index[d] < space.shape[d]) {
        for (int k = 0; k < N; ++k) offsets[k] += space.strides[k][d];
        break;
      }
      index[d] = 0;
      for (int k = 0; k < N; ++k) offsets[k] -= space.strides[k][d] * (space.shape[d] - 1);
    }
    if (d < 0) return;
  }
}

// Element offset of the `linear`-th element (row-major order) of a view.
inline int64_t offset_of(int64_t linear, const Dims& shape, const Dims& strides) {
  int64_t off = 0;
  for (int d = shape.size() - 1; d >= 0; --d) {
    off += (linear % shape[d]) * strides[d];
    linear /= shape[d];
  }
  return off;
}

// dst[i] = (C) src[i * stride] for n elements of dtype at `src` (a floating dtype).
template <class C>
void load_row(C* dst, const void* src, DType dtype, int64_t stride, int64_t n) {
  if constexpr (std::is_same_v<C, float>) {
    if (dtype == DType::kBF16 && stride == 1) {  // the hot conversion of bf16 training
      return vec_kernels().f32.widen_bf16(dst, static_cast<const uint16_t*>(src), n);
    }
  }
  dispatch_dtype(dtype, [&](auto tag) {
    using S = decltype(tag);
    const S* s = static_cast<const S*>(src);
    if constexpr (std::is_same_v<S, C>) {
      if (stride == 1) {
        std::memcpy(dst, s, static_cast<size_t>(n) * sizeof(C));
        return;
      }
    }
    if (stride == 1) {
      for (int64_t i = 0; i < n; ++i) dst[i] = cast_value<C>(s[i]);
    } else {
      for (int64_t i = 0; i < n; ++i) dst[i] = cast_value<C>(s[i * stride]);
    }
  });
}

// dst[i * stride] = (dtype) src[i], rounding to nearest even.
template <class C>
void store_row(void* dst, DType dtype, int64_t stride, const C* src, int64_t n) {
  if constexpr (std::is_same_v<C, float>) {
    if (dtype == DType::kBF16 && stride == 1) {
      return vec_kernels().f32.narrow_bf16(static_cast<uint16_t*>(dst), src, n);
    }
  }
  dispatch_dtype(dtype, [&](auto tag) {
    using D = decltype(tag);
    D* d = static_cast<D*>(dst);
    if constexpr (std::is_same_v<D, C>) {
      if (stride == 1) {
        std::memcpy(d, src, static_cast<size_t>(n) * sizeof(C));
        return;
      }
    }
    if (stride == 1) {
      for (int64_t i = 0; i < n; ++i) d[i] = cast_value<D>(src[i]);
    } else {
      for (int64_t i = 0; i < n; ++i) d[i * stride] = cast_value<D>(src[i]);
    }
  });
}

// Element pointer arithmetic on untyped data.
inline const void* at(const void* base, DType dtype, int64_t offset) {
  return static_cast<const char*>(base) + offset * static_cast<int64_t>(itemsize(dtype));
}
inline void* at(void* base, DType dtype, int64_t offset) {
  return static_cast<char*>(base) + offset * static_cast<int64_t>(itemsize(dtype));
}

}  // namespace kernels::detail
