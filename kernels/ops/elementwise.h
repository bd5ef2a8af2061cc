// Element-wise arithmetic and activations on Tensor views, with their backward.
//
//   Tensor y = Tensor::arange({2, 3}, DType::kF32);
//   Tensor b = Tensor::from_vector({10, 20, 30}, {3});
//   Tensor z = add(y, b);                     // [[10,21,32],[13,24,35]]: b broadcasts over rows
//   add_out(y, y, b, -1.0);                   // in place: y -= b
//   Tensor g = gelu(z);                       // erf form, PyTorch's nn.GELU() default
//   Tensor dz = gelu_backward(Tensor::full({2, 3}, 1.0, DType::kF32), z);
//
// NOTE [element-wise rules] (every function in this header)
// - dtypes: floating inputs (f32, f64, bf16, f16). Arithmetic happens in f64 when an input is
//   f64 and in f32 otherwise (bf16/f16 are widened, computed in f32 and rounded once on the
//   store, like PyTorch's opmath). The two inputs of add/mul may differ (an f32 gradient buffer
//   += a bf16 gradient); the functional forms return the promoted dtype (the common dtype, else
//   f64 if either is f64, else f32, as torch's promotion); an `out` may have any floating dtype
//   (the result is rounded to it). The backward maps need dy and x of one dtype.
// - shapes: binary ops broadcast by torch's rules (dims aligned at the right; a missing or size-1
//   dim stretches). An `out` must have exactly the broadcast shape.
// - views: every operand and out may be any strided view (transposed, narrowed, expanded with
//   stride 0 on inputs). Nothing is copied.
// - aliasing: out may be the very same view as an input (in-place: add_out(t, t, g) is
//   t += g); any other overlap between out and an input is not allowed, and out must not have
//   stride 0 on a dim of size > 1.
// - devices: all operands on one device (CPU or CUDA).
#pragma once

#include "kernels/dims.h"
#include "kernels/tensor.h"

namespace kernels {

// torch.broadcast_shapes; throws InvalidArgument naming both shapes when they do not broadcast.
Dims broadcast_shapes(const Dims& a, const Dims& b);
// A view of t stretched to `shape` (stride 0 on broadcast dims), like torch.Tensor.expand.
Tensor expand(const Tensor& t, const Dims& shape);

// a + alpha * b
Tensor add(const Tensor& a, const Tensor& b, double alpha = 1.0);
void add_out(const Tensor& out, const Tensor& a, const Tensor& b, double alpha = 1.0);
// a * b
Tensor mul(const Tensor& a, const Tensor& b);
void mul_out(const Tensor& out, const Tensor& a, const Tensor& b);
// alpha * a
Tensor scale(const Tensor& a, double alpha);
void scale_out(const Tensor& out, const Tensor& a, double alpha);

// GELU. kNone is the exact form x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2)), the default of
// PyTorch's nn.GELU() / F.gelu(approximate='none'); kTanh is
// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (approximate='tanh', GPT-2's).
enum class GeluApproximation { kNone, kTanh };
Tensor gelu(const Tensor& x, GeluApproximation approximation = GeluApproximation::kNone);
void gelu_out(const Tensor& out, const Tensor& x,
              GeluApproximation approximation = GeluApproximation::kNone);
// dx = dy * gelu'(x). REQUIRES: dy and x have the same shape.
Tensor gelu_backward(const Tensor& dy, const Tensor& x,
                     GeluApproximation approximation = GeluApproximation::kNone);
void gelu_backward_out(const Tensor& dx, const Tensor& dy, const Tensor& x,
                       GeluApproximation approximation = GeluApproximation::kNone);

// SiLU (swish): x * sigmoid(x); backward dx = dy * s (1 + x (1 - s)) with s = sigmoid(x).
Tensor silu(const Tensor& x);
void silu_out(const Tensor& out, const Tensor& x);
Tensor silu_backward(const Tensor& dy, const Tensor& x);
void silu_backward_out(const Tensor& dx, const Tensor& dy, const Tensor& x);

}  // namespace kernels
