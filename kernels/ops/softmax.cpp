// Stubs: the API of kernels/ops/softmax.h, implementations to follow.
#include "kernels/ops/softmax.h"

#include "kernels/error.h"

namespace kernels {

Tensor softmax(const Tensor&, int) {
  throw Unsupported("softmax: not implemented yet");
}
void softmax_out(const Tensor&, const Tensor&, int) {
  throw Unsupported("softmax_out: not implemented yet");
}
Tensor softmax_backward(const Tensor&, const Tensor&, int) {
  throw Unsupported("softmax_backward: not implemented yet");
}
void softmax_backward_out(const Tensor&, const Tensor&, const Tensor&, int) {
  throw Unsupported("softmax_backward_out: not implemented yet");
}
Tensor log_softmax(const Tensor&, int) {
  throw Unsupported("log_softmax: not implemented yet");
}
void log_softmax_out(const Tensor&, const Tensor&, int) {
  throw Unsupported("log_softmax_out: not implemented yet");
}
Tensor log_softmax_backward(const Tensor&, const Tensor&, int) {
  throw Unsupported("log_softmax_backward: not implemented yet");
}
void log_softmax_backward_out(const Tensor&, const Tensor&, const Tensor&, int) {
  throw Unsupported("log_softmax_backward_out: not implemented yet");
}

}  // namespace kernels
