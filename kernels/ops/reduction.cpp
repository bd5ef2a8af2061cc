// Stubs: the API of kernels/ops/reduction.h, implementations to follow.
#include "kernels/ops/reduction.h"

#include "kernels/error.h"

namespace kernels {

Tensor sum(const Tensor&, const Dims&, bool) {
  throw Unsupported("sum: not implemented yet");
}
void sum_out(const Tensor&, const Tensor&, const Dims&, bool, bool) {
  throw Unsupported("sum_out: not implemented yet");
}
Tensor sum_all(const Tensor&) {
  throw Unsupported("sum_all: not implemented yet");
}
Tensor mean(const Tensor&, const Dims&, bool) {
  throw Unsupported("mean: not implemented yet");
}
void mean_out(const Tensor&, const Tensor&, const Dims&, bool) {
  throw Unsupported("mean_out: not implemented yet");
}
MaxResult max(const Tensor&, int, bool) {
  throw Unsupported("max: not implemented yet");
}
Tensor max_backward(const Tensor&, const Tensor&, int, const Dims&, bool) {
  throw Unsupported("max_backward: not implemented yet");
}
Tensor sum_to_shape(const Tensor&, const Dims&) {
  throw Unsupported("sum_to_shape: not implemented yet");
}
Tensor sum_of_squares(const Tensor&) {
  throw Unsupported("sum_of_squares: not implemented yet");
}

}  // namespace kernels
