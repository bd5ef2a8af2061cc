// Rank-local element-wise reductions behind the reducing collectives.
//   reduce_into(acc, src, ReduceOp::kSum)   acc[i] = acc[i] + src[i]
//   scale_(t, 0.25)                          t[i] = t[i] * 0.25   (avg, pre-multiplied sums)
// bf16, f16 and fp8 reduce in float and round back to nearest even; integers use their own
// arithmetic (wrapping). kAvg accumulates like kSum: the caller divides once at the end.
#pragma once

#include <cstdint>

#include "kernels/dtype.h"
#include "kernels/reduce_op.h"
#include "kernels/tensor.h"

namespace kernels {

// REQUIRES: same shape, dtype and device; contiguous; CPU, or CUDA when built with it.
// src_scale multiplies src before combining (a pre-multiplied sum); REQUIRES op kSum or kAvg
// when src_scale != 1.
void reduce_into(const Tensor& acc, const Tensor& src, ReduceOp op, double src_scale = 1.0);
// t *= factor; integers are multiplied in double and truncated toward zero.
void scale_(const Tensor& t, double factor);

namespace detail {
// Raw CPU forms over n contiguous elements.
void cpu_reduce_into(void* acc, const void* src, DType dtype, int64_t n, ReduceOp op,
                     double src_scale = 1.0);
void cpu_scale(void* data, DType dtype, int64_t n, double factor);
}  // namespace detail

}  // namespace kernels
