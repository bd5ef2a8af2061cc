// Internal: argument checks and small shape helpers shared by the kernels/ops/*.cpp front ends.
// Every check throws InvalidArgument (Unsupported for a dtype the op does not implement) with a
// message that starts with the op's name and names the offending value and what was expected.
//   check_floating("softmax", x, "x");   // "softmax: x has dtype i64, expected f32, f64, bf16 or
//   f16"
#pragma once

#include <initializer_list>
#include <string>
#include <utility>

#include "kernels/detail/row_plan.h"
#include "kernels/dims.h"
#include "kernels/dtype.h"
#include "kernels/tensor.h"

namespace kernels::detail {

struct Named {
  const char* name;
  const Tensor& t;
};

void check_defined(const char* op, const Tensor& t, const char* name);
// f32, f64, bf16 or f16.
bool is_compute_float(DType dtype);
void check_floating(const char* op, const Tensor& t, const char* name);
// i32 or i64.
void check_index(const char* op, const Tensor& t, const char* name);
void check_same_dtype(const char* op, std::initializer_list<Named> ts);
// Every defined tensor on the first one's device.
void check_same_device(const char* op, std::initializer_list<Named> ts);
void check_shape(const char* op, const Tensor& t, const char* name, const Dims& expected);
void check_dtype(const char* op, const Tensor& t, const char* name, DType expected);
// An output must not address one element twice (stride 0 on a dim of size > 1).
void check_writable(const char* op, const Tensor& t, const char* name);
// Throws InvalidArgument unless 0 <= dim + (dim < 0 ? ndim : 0) < ndim; returns the wrapped dim.
int wrap_dim(const char* op, int dim, int ndim);
// f64 for f64, f32 otherwise: the dtype of saved statistics and of row arithmetic.
inline DType stats_dtype(DType dtype) { return dtype == DType::kF64 ? DType::kF64 : DType::kF32; }
// True when a and b address a common element: same storage, overlapping extents, and (for equal
// element sizes) an exact search for a shared address, so interleaved views that never touch
// the same element (dq/dk/dv slices of one fused buffer) do not count. A search too large to
// finish, or different element sizes, answer true.
bool may_overlap(const Tensor& a, const Tensor& b);
// The same view (storage, offset, shape, strides, dtype): an in-place operand.
bool same_view(const Tensor& a, const Tensor& b);
// shape without its last dim.
Dims drop_last(const Dims& shape);
// t as rows along `dim` (the other dims, row-major, enumerate the rows); an undefined or empty
// tensor gives an absent RowTensor.
RowTensor as_rows(const Tensor& t, int dim);
// t's strides without `dim`: the outer strides of a per-row statistic or of as_rows.
Dims strides_without(const Tensor& t, int dim);
// A [len] vector; absent for an undefined tensor.
ColTensor as_col(const Tensor& t);

}  // namespace kernels::detail
