// Reductions over tensor dims: sum, mean, max (with argmax for the backward), a broadcast
// gradient's reduction back to an operand's shape, and the sum of squares behind a gradient norm.
//
//   Tensor x = Tensor::arange({2, 3}, DType::kF32);     // [[0,1,2],[3,4,5]]
//   sum(x, {1});                                         // [3, 12]
//   mean(x, {0}, /*keepdim=*/true);                      // [[1.5, 2.5, 3.5]]
//   MaxResult m = max(x, -1);                            // values [2, 5], indices [2, 2] (i64)
//   max_backward(Tensor::full({2}, 1.0, DType::kF32), m.indices, -1, x.shape());
//                                                        // [[0,0,1],[0,0,1]]
//   sum_to_shape(Tensor::full({4, 2, 3}, 1.0, DType::kF32), {3});   // [8, 8, 8] (a bias grad)
//
// Rules (all functions): floating inputs (f32, f64, bf16, f16), any strided view, CPU or CUDA.
// `dims` lists tensor dims (negative counts from the end) without repeats; the reduced dims are
// removed, or kept with size 1 when keepdim. Sums accumulate in f64 (CPU and CUDA) and round
// once to the output dtype: the input's for the functional forms; any floating dtype for an
// `out`. A sum over zero elements is 0, a mean over zero
// elements is NaN (as PyTorch); max over an empty dim throws InvalidArgument.
#pragma once

#include "kernels/dims.h"
#include "kernels/tensor.h"

namespace kernels {

// sum over `dims`; an empty list reduces nothing (a copy), unlike PyTorch's dim=[] which reduces
// everything: use sum_all for that.
Tensor sum(const Tensor& x, const Dims& dims, bool keepdim = false);
// Writes (accumulate: adds) the sum into out, whose shape is the reduced shape (with or without
// the kept size-1 dims, as keepdim says). REQUIRES: out does not overlap x.
void sum_out(const Tensor& out, const Tensor& x, const Dims& dims, bool keepdim = false,
             bool accumulate = false);
// Every element: a 0-d tensor.
Tensor sum_all(const Tensor& x);

Tensor mean(const Tensor& x, const Dims& dims, bool keepdim = false);

// torch.max(x, dim, keepdim): the largest value along `dim` and its index (i64, first occurrence
// among equal values). NaN is the largest value (it propagates, with its index).
struct MaxResult {
  Tensor values;
  Tensor indices;  // i64, same shape as values
};
MaxResult max(const Tensor& x, int dim, bool keepdim = false);
// dx of shape input_shape: dy scattered to the argmax positions, zero elsewhere (the
// gradient of torch.max(x, dim)). dy and indices have the shape max() returned with the same
// keepdim. Returns dy's dtype.
Tensor max_backward(const Tensor& dy, const Tensor& indices, int dim, const Dims& input_shape,
                    bool keepdim = false);

// Sums x down to `shape`, a shape x's shape is a broadcast of (the gradient of an operand that
// add/mul broadcast): leading extra dims are summed away and dims where shape has 1 are summed
// with keepdim. Throws InvalidArgument when shape does not broadcast to x's shape.
Tensor sum_to_shape(const Tensor& x, const Dims& shape);

// sum of x^2 over every element as a 0-d tensor of dtype f64 (accumulated in f64 on the CPU and
// on CUDA): the per-shard piece of a global gradient norm (clip_grad_norm_ all-reduces it).
Tensor sum_of_squares(const Tensor& x);

}  // namespace kernels
