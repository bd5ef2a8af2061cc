// Internal: the CUDA implementations behind kernels/ops/*.h, as plain C++ declarations (no CUDA
// headers). Implemented by cuda_compute.cu (+ cuBLAS) in CUDA builds and by
// cuda_compute_absent.cpp otherwise (every entry throws Unsupported). The front ends
// (kernels/ops/*.cpp) have checked every argument; `device` is the CUDA device index.
// Ordering: NOTE [cuda ordering] in cuda_ops.h (the device's compute stream).
#pragma once

#include <cstdint>

#include "kernels/detail/gemm_plan.h"
#include "kernels/detail/map_op.h"
#include "kernels/detail/optim_plan.h"
#include "kernels/detail/reduce_plan.h"
#include "kernels/detail/row_plan.h"

namespace kernels::detail {

void cuda_gemm(const GemmPlan& plan, int device);
// out[i] = op(in0[i], in1[i]) over `shape` (in1 may be null), as cpu_map.
void cuda_map(MapOp op, double alpha, void* out, DType out_dtype, const Dims& out_strides,
              const Dims& shape, const MapOperand& in0, const MapOperand* in1, int device);
// As cpu_reduce / cpu_max_dim / cpu_scatter_dim (sums accumulate in f64).
void cuda_reduce(const ReducePlan& plan, int device);
void cuda_max_dim(const DimPlan& plan, int device);
void cuda_scatter_dim(const DimPlan& plan, int device);
// As the cpu_ row kernels (targets were range-checked by the front end on the host).
void cuda_softmax(const SoftmaxPlan& plan, int device);
void cuda_norm_forward(const NormPlan& plan, int device);
void cuda_norm_backward(const NormPlan& plan, int device);
void cuda_cross_entropy(const CrossEntropyPlan& plan, int device);
// ids were range-checked by the front end on the host. The backward adds in position order
// (deterministic).
void cuda_embedding_forward(const EmbeddingPlan& plan, int device);
void cuda_embedding_backward(const EmbeddingPlan& plan, int device);
// Same arithmetic as kernels/cpu/vec_impl.h's adamw / sgd (fma where torch fuses).
void cuda_optimizer_step(const OptimPlan& plan, int device);
// sum_exp[i] *= exp(local_max[i] - global_max[i]) (0 stays 0 where local_max is -inf); all of
// dtype (f32 or f64), n elements at the given element strides.
void cuda_rescale_sum_exp(void* sum_exp, int64_t sum_exp_stride, const void* local_max,
                          int64_t local_max_stride, const void* global_max,
                          int64_t global_max_stride, DType dtype, int64_t n, int device);

}  // namespace kernels::detail
