// Stubs: the API of kernels/ops/attention.h, implementations to follow.
#include "kernels/ops/attention.h"

#include "kernels/error.h"

namespace kernels {

AttentionOutput attention(const Tensor&, const Tensor&, const Tensor&, const AttentionOptions&) {
  throw Unsupported("attention: not implemented yet");
}
void attention_out(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const AttentionOptions&) {
  throw Unsupported("attention_out: not implemented yet");
}
AttentionGrads attention_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const AttentionOptions&) {
  throw Unsupported("attention_backward: not implemented yet");
}
void attention_backward_out(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const AttentionOptions&) {
  throw Unsupported("attention_backward_out: not implemented yet");
}

}  // namespace kernels
