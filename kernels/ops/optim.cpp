// Stubs: the API of kernels/ops/optim.h, implementations to follow.
#include "kernels/ops/optim.h"

#include "kernels/error.h"

namespace kernels {

void adamw_step(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t, const AdamWOptions&) {
  throw Unsupported("adamw_step: not implemented yet");
}
void sgd_step(const Tensor&, const Tensor&, const Tensor&, bool, const SgdOptions&) {
  throw Unsupported("sgd_step: not implemented yet");
}

}  // namespace kernels
