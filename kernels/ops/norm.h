// RMSNorm and LayerNorm over the last dim, forward and backward, with the statistics the
// backward needs saved by the forward (no recomputation of the row reductions).
//
//   Tensor x = Tensor::arange({2, 4}, DType::kF32);           // [..., D = 4]
//   Tensor w = Tensor::full({4}, 1.0, DType::kF32);
//   RmsNormOutput f = rms_norm(x, w, 1e-6);                    // f.y [2, 4], f.rstd [2] (f32)
//   RmsNormGrads g = rms_norm_backward(dy, x, w, f.rstd);      // g.dx [2, 4], g.dweight [4]
//   LayerNormOutput l = layer_norm(x, w, b, 1e-5);             // l.y, l.mean [2], l.rstd [2]
//
// Definitions (PyTorch's, normalized_shape = [D]):
//   rms_norm:   rstd = 1 / sqrt(mean(x^2) + eps);         y = x * rstd * weight
//   layer_norm: mean = mean(x); var = mean((x - mean)^2) (biased);
//               rstd = 1 / sqrt(var + eps);               y = (x - mean) * rstd * weight + bias
// PyTorch's defaults for eps: nn.LayerNorm 1e-5; nn.RMSNorm eps=None, which means
// torch.finfo(x.dtype).eps (1.19e-7 for f32, 7.8e-3 for bf16): pass that explicitly.
//
// Rules: x floating (f32, f64, bf16, f16), shape [..., D], any strided view. weight and bias are
// [D] of any floating dtype, or undefined Tensor() for elementwise_affine=False (weight 1,
// bias 0). Statistics (mean, rstd) have shape x.shape[:-1] and dtype f32 (f64 for f64 x); rows
// are computed in that dtype and y is rounded once to its dtype (x's for the functional forms).
// Gradients: dx has x's shape; dweight / dbias are [D], reduced over every row in f64 on the CPU
// (so they do not depend on how rows are split), returned in weight's dtype (an out may be any
// floating dtype). Rows of D = 0 give empty outputs; zero rows give zero weight gradients.
// All operands on one device (CPU or CUDA).
#pragma once

#include "kernels/tensor.h"

namespace kernels {

struct RmsNormOutput {
  Tensor y;
  Tensor rstd;  // saved for the backward
};
RmsNormOutput rms_norm(const Tensor& x, const Tensor& weight, double eps);
// REQUIRES: y has x's shape; rstd has shape x.shape[:-1] and dtype f32 (f64 for f64 x).
void rms_norm_out(const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& weight,
                  double eps);

struct RmsNormGrads {
  Tensor dx;
  Tensor dweight;  // undefined when weight is undefined
};
RmsNormGrads rms_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                               const Tensor& rstd);
// dx or dweight may be undefined (not computed). accumulate: dweight += instead of =.
void rms_norm_backward_out(const Tensor& dx, const Tensor& dweight, const Tensor& dy,
                           const Tensor& x, const Tensor& weight, const Tensor& rstd,
                           bool accumulate = false);

struct LayerNormOutput {
  Tensor y;
  Tensor mean;  // saved for the backward
  Tensor rstd;
};
LayerNormOutput layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps);
void layer_norm_out(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                    const Tensor& weight, const Tensor& bias, double eps);

struct LayerNormGrads {
  Tensor dx;
  Tensor dweight;  // undefined when weight is undefined
  Tensor dbias;    // undefined when bias is undefined
};
LayerNormGrads layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                                   const Tensor& bias, const Tensor& mean, const Tensor& rstd);
// Any of dx, dweight, dbias may be undefined (not computed). `bias` is only consulted for its
// presence and dtype. accumulate: dweight/dbias += instead of =.
void layer_norm_backward_out(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                             const Tensor& dy, const Tensor& x, const Tensor& weight,
                             const Tensor& mean, const Tensor& rstd, bool accumulate = false);

}  // namespace kernels
