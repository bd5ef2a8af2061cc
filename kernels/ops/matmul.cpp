// Stubs: the API of kernels/ops/matmul.h, implementations to follow.
#include "kernels/ops/matmul.h"

#include "kernels/error.h"

namespace kernels {

Tensor matmul(const Tensor&, const Tensor&, const MatmulOptions&) {
  throw Unsupported("matmul: not implemented yet");
}
void matmul_out(const Tensor&, const Tensor&, const Tensor&, const MatmulOptions&) {
  throw Unsupported("matmul_out: not implemented yet");
}

}  // namespace kernels
