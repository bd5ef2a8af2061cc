// Stubs: the API of kernels/ops/norm.h, implementations to follow.
#include "kernels/ops/norm.h"

#include "kernels/error.h"

namespace kernels {

RmsNormOutput rms_norm(const Tensor&, const Tensor&, double) {
  throw Unsupported("rms_norm: not implemented yet");
}
void rms_norm_out(const Tensor&, const Tensor&, const Tensor&, const Tensor&, double) {
  throw Unsupported("rms_norm_out: not implemented yet");
}
RmsNormGrads rms_norm_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  throw Unsupported("rms_norm_backward: not implemented yet");
}
void rms_norm_backward_out(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool) {
  throw Unsupported("rms_norm_backward_out: not implemented yet");
}
LayerNormOutput layer_norm(const Tensor&, const Tensor&, const Tensor&, double) {
  throw Unsupported("layer_norm: not implemented yet");
}
void layer_norm_out(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, double) {
  throw Unsupported("layer_norm_out: not implemented yet");
}
LayerNormGrads layer_norm_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  throw Unsupported("layer_norm_backward: not implemented yet");
}
void layer_norm_backward_out(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool) {
  throw Unsupported("layer_norm_backward_out: not implemented yet");
}

}  // namespace kernels
