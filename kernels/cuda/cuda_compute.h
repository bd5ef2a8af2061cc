// Internal: the CUDA implementations behind kernels/ops/*.h, as plain C++ declarations (no CUDA
// headers). Implemented by cuda_compute.cu (+ cuBLAS) in CUDA builds and by
// cuda_compute_absent.cpp otherwise (every entry throws Unsupported). The front ends
// (kernels/ops/*.cpp) have checked every argument; `device` is the CUDA device index.
// Ordering: NOTE [cuda ordering] in cuda_ops.h (legacy default stream).
#pragma once

#include <cstdint>

#include "kernels/detail/gemm_plan.h"
#include "kernels/detail/map_op.h"
#include "kernels/detail/reduce_plan.h"

namespace kernels::detail {

void cuda_gemm(const GemmPlan& plan, int device);
// out[i] = op(in0[i], in1[i]) over `shape` (in1 may be null), as cpu_map.
void cuda_map(MapOp op, double alpha, void* out, DType out_dtype, const Dims& out_strides,
              const Dims& shape, const MapOperand& in0, const MapOperand* in1, int device);
// As cpu_reduce / cpu_max_dim / cpu_scatter_dim (sums accumulate in f32 for non-f64 inputs, in
// f64 for f64 inputs and for sums of squares).
void cuda_reduce(const ReducePlan& plan, int device);
void cuda_max_dim(const DimPlan& plan, int device);
void cuda_scatter_dim(const DimPlan& plan, int device);

}  // namespace kernels::detail
