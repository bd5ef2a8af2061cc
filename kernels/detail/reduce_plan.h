// Internal: reductions as raw pointers and element strides, built by kernels/ops/reduction.cpp
// and executed by kernels/cpu/reduction.cpp or the CUDA back end. Plain C++.
//   sum over dims {0, 2} of x [4, 5, 6]: kept_shape [5], reduced_shape [4, 6]
#pragma once

#include <cstdint>

#include "kernels/dims.h"
#include "kernels/dtype.h"

namespace kernels::detail {

// out[o] = scale * sum over r of f(x[o, r]) (+ out[o] when accumulate), f(v) = v or v * v.
// o runs over kept_shape (row-major), r over reduced_shape. Sums are formed in f64 on the CPU.
struct ReducePlan {
  const void* x = nullptr;
  DType x_dtype = DType::kF32;
  Dims kept_shape, kept_x_strides;
  Dims reduced_shape, reduced_x_strides;
  void* out = nullptr;
  DType out_dtype = DType::kF32;
  Dims out_strides;  // over kept_shape
  double scale = 1.0;
  bool accumulate = false;
  bool square = false;
};

// Along one dim of x: for each position o of the other dims (outer_shape, row-major),
//   max:     values[o] = max_j x[o, j], indices[o] = first argmax (NaN wins), both contiguous;
//   scatter: dx[o, indices[o]] = dy[o] (dx zero-filled by the caller).
struct DimPlan {
  Dims outer_shape;
  int64_t len = 0;  // size of the dim
  const void* x = nullptr;
  DType x_dtype = DType::kF32;
  Dims x_outer_strides;
  int64_t x_dim_stride = 0;
  // max outputs (contiguous over outer_shape)
  void* values = nullptr;
  int64_t* indices = nullptr;
  // scatter operands
  void* dx = nullptr;
  DType dx_dtype = DType::kF32;
  Dims dx_outer_strides;
  int64_t dx_dim_stride = 0;
  const void* dy = nullptr;
  DType dy_dtype = DType::kF32;
  Dims dy_outer_strides;
  const int64_t* index = nullptr;
  Dims index_outer_strides;
};

}  // namespace kernels::detail
