// Softmax and log-softmax along one dim, numerically stable (the row maximum is subtracted
// before exponentiating), with their backward from the saved output.
//
//   Tensor x = Tensor::from_vector({1, 2, 3, 1000, 1000, -1000}, {2, 3});
//   Tensor y = softmax(x, -1);         // [[0.090, 0.245, 0.665], [0.5, 0.5, 0]]: no overflow
//   Tensor dx = softmax_backward(dy, y, -1);   // dx = y * (dy - sum(dy * y, dim))
//
// Rules: floating dtypes (f32, f64, bf16, f16); rows are computed in f32 (f64 for f64) and
// rounded once to the output dtype (the input's for the functional forms, any floating dtype
// for an out). Any strided views, CPU or CUDA. A row of -inf gives NaN (as PyTorch); an empty
// dim gives an empty result.
#pragma once

#include "kernels/tensor.h"

namespace kernels {

Tensor softmax(const Tensor& x, int dim);
void softmax_out(const Tensor& y, const Tensor& x, int dim);
// REQUIRES: dy and y have the same shape; y is softmax's output.
Tensor softmax_backward(const Tensor& dy, const Tensor& y, int dim);
void softmax_backward_out(const Tensor& dx, const Tensor& dy, const Tensor& y, int dim);

// log_softmax = x - max - log(sum(exp(x - max))).
Tensor log_softmax(const Tensor& x, int dim);
void log_softmax_out(const Tensor& y, const Tensor& x, int dim);
// dx = dy - exp(y) * sum(dy, dim), y being log_softmax's output.
Tensor log_softmax_backward(const Tensor& dy, const Tensor& y, int dim);
void log_softmax_backward_out(const Tensor& dx, const Tensor& dy, const Tensor& y, int dim);

}  // namespace kernels
