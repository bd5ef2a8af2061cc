// Built without CUDA: the compute entry points refuse (no CUDA tensor can exist in such a build,
// so the front ends never reach these; they are here for the linker).
#include <string>

#include "kernels/cuda/cuda_compute.h"
#include "kernels/error.h"

namespace kernels::detail {
namespace {

[[noreturn]] void no_cuda(const char* what) {
  throw Unsupported(
      std::string(what) +
      " on a CUDA tensor, but this build has no CUDA (configure with -Dcuda=enabled)");
}

}  // namespace

void cuda_gemm(const GemmPlan&, int) { no_cuda("matmul"); }
void cuda_map(MapOp, double, void*, DType, const Dims&, const Dims&, const MapOperand&,
              const MapOperand*, int) {
  no_cuda("an element-wise op");
}
void cuda_reduce(const ReducePlan&, int) { no_cuda("a reduction"); }
void cuda_max_dim(const DimPlan&, int) { no_cuda("max"); }
void cuda_scatter_dim(const DimPlan&, int) { no_cuda("max_backward"); }
void cuda_softmax(const SoftmaxPlan&, int) { no_cuda("softmax"); }
void cuda_norm_forward(const NormPlan&, int) { no_cuda("a norm"); }
void cuda_norm_backward(const NormPlan&, int) { no_cuda("a norm backward"); }
void cuda_cross_entropy(const CrossEntropyPlan&, int) { no_cuda("cross_entropy"); }
void cuda_embedding_forward(const EmbeddingPlan&, int) { no_cuda("embedding"); }
void cuda_embedding_backward(const EmbeddingPlan&, int) { no_cuda("embedding_backward"); }
void cuda_optimizer_step(const OptimPlan&, int) { no_cuda("an optimizer step"); }
void cuda_rescale_sum_exp(void*, int64_t, const void*, int64_t, const void*, int64_t, DType,
                          int64_t, int) {
  no_cuda("rescale_sum_exp_");
}

}  // namespace kernels::detail
