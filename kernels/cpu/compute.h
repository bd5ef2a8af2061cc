// Internal: the CPU implementations behind kernels/ops/*.h. The front ends (kernels/ops/*.cpp)
// have checked every argument (dtypes, shapes, devices, overlap); these functions trust them.
#pragma once

#include <cstdint>

#include "kernels/detail/gemm_plan.h"
#include "kernels/detail/map_op.h"
#include "kernels/detail/optim_plan.h"
#include "kernels/detail/reduce_plan.h"
#include "kernels/detail/row_plan.h"
#include "kernels/tensor.h"

namespace kernels::detail {

void cpu_gemm(const GemmPlan& plan, int num_threads);

// out = op(in0[, in1]) element-wise; the inputs are views of out's shape (broadcast dims have
// stride 0), of floating dtypes (f64 arithmetic if either is f64, else f32); out is a floating view
// that is either the very same view as an input or disjoint from both.
void cpu_map(MapOp op, double alpha, const Tensor& out, const Tensor* in0, const Tensor* in1);

void cpu_reduce(const ReducePlan& plan);
void cpu_max_dim(const DimPlan& plan);
void cpu_scatter_dim(const DimPlan& plan);

void cpu_softmax(const SoftmaxPlan& plan);
void cpu_norm_forward(const NormPlan& plan);
void cpu_norm_backward(const NormPlan& plan);
// Throws InvalidArgument for a target outside [0, vocab_size) that is not ignore_index.
void cpu_cross_entropy(const CrossEntropyPlan& plan);
// Throw InvalidArgument for an id outside [0, num_embeddings).
void cpu_embedding_forward(const EmbeddingPlan& plan);
void cpu_embedding_backward(const EmbeddingPlan& plan);

void cpu_optimizer_step(const OptimPlan& plan);

}  // namespace kernels::detail
