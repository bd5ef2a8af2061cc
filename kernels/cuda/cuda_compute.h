// Internal: the CUDA implementations behind kernels/ops/*.h, as plain C++ declarations (no CUDA
// headers). Implemented by cuda_compute.cu (+ cuBLAS) in CUDA builds and by
// cuda_compute_absent.cpp otherwise (every entry throws Unsupported). The front ends
// (kernels/ops/*.cpp) have checked every argument; `device` is the CUDA device index.
// Ordering: NOTE [cuda ordering] in cuda_ops.h (legacy default stream).
#pragma once

#include <cstdint>

#include "kernels/detail/gemm_plan.h"
#include "kernels/detail/map_op.h"

namespace kernels::detail {

void cuda_gemm(const GemmPlan& plan, int device);
// out[i] = op(in0[i], in1[i]) over `shape` (in1 may be null), as cpu_map.
void cuda_map(MapOp op, double alpha, void* out, DType out_dtype, const Dims& out_strides,
              const Dims& shape, const MapOperand& in0, const MapOperand* in1, int device);

}  // namespace kernels::detail
