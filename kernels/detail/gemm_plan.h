// Internal: a batched GEMM as raw pointers and element strides, built by kernels/ops/matmul.cpp
// from Tensor views and executed by kernels/cpu/matmul.cpp (Eigen) or kernels/cuda (cuBLAS).
// Plain C++ (nvcc compiles it too).
//   c[i] = alpha * a[i] @ b[i] + beta * c[i] for every batch index i of batch_shape, where
//   a[i] = a + sum_d i_d * a_batch_strides[d] is an [m, k] matrix with strides (a_rs, a_cs), ...
#pragma once

#include <cstdint>

#include "kernels/dims.h"
#include "kernels/dtype.h"

namespace kernels::detail {

struct GemmPlan {
  DType dtype = DType::kF32;      // of a and b
  DType out_dtype = DType::kF32;  // of c
  int64_t m = 0, n = 0, k = 0;
  double alpha = 1.0, beta = 0.0;
  // REQUIRES: one of (a_rs, a_cs) is 1, one of (b_rs, b_cs) is 1, one of (c_rs, c_cs) is 1;
  // k > 0; c does not overlap a or b.
  const void* a = nullptr;
  int64_t a_rs = 0, a_cs = 1;
  const void* b = nullptr;
  int64_t b_rs = 0, b_cs = 1;
  void* c = nullptr;
  int64_t c_rs = 0, c_cs = 1;
  // Broadcast batch: stride 0 where an operand is broadcast; c's strides are never 0 on a dim
  // of size > 1. Empty for a single product.
  Dims batch_shape;
  Dims a_batch_strides, b_batch_strides, c_batch_strides;
};

}  // namespace kernels::detail
