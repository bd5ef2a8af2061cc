// Stubs: the API of kernels/ops/elementwise.h, implementations to follow.
#include "kernels/ops/elementwise.h"

#include "kernels/error.h"

namespace kernels {

Dims broadcast_shapes(const Dims&, const Dims&) {
  throw Unsupported("broadcast_shapes: not implemented yet");
}
Tensor expand(const Tensor&, const Dims&) {
  throw Unsupported("expand: not implemented yet");
}
Tensor add(const Tensor&, const Tensor&, double) {
  throw Unsupported("add: not implemented yet");
}
void add_out(const Tensor&, const Tensor&, const Tensor&, double) {
  throw Unsupported("add_out: not implemented yet");
}
Tensor mul(const Tensor&, const Tensor&) {
  throw Unsupported("mul: not implemented yet");
}
void mul_out(const Tensor&, const Tensor&, const Tensor&) {
  throw Unsupported("mul_out: not implemented yet");
}
Tensor scale(const Tensor&, double) {
  throw Unsupported("scale: not implemented yet");
}
void scale_out(const Tensor&, const Tensor&, double) {
  throw Unsupported("scale_out: not implemented yet");
}
Tensor gelu(const Tensor&, GeluApproximation) {
  throw Unsupported("gelu: not implemented yet");
}
void gelu_out(const Tensor&, const Tensor&, GeluApproximation) {
  throw Unsupported("gelu_out: not implemented yet");
}
Tensor gelu_backward(const Tensor&, const Tensor&, GeluApproximation) {
  throw Unsupported("gelu_backward: not implemented yet");
}
void gelu_backward_out(const Tensor&, const Tensor&, const Tensor&, GeluApproximation) {
  throw Unsupported("gelu_backward_out: not implemented yet");
}
Tensor silu(const Tensor&) {
  throw Unsupported("silu: not implemented yet");
}
void silu_out(const Tensor&, const Tensor&) {
  throw Unsupported("silu_out: not implemented yet");
}
Tensor silu_backward(const Tensor&, const Tensor&) {
  throw Unsupported("silu_backward: not implemented yet");
}
void silu_backward_out(const Tensor&, const Tensor&, const Tensor&) {
  throw Unsupported("silu_backward_out: not implemented yet");
}

}  // namespace kernels
