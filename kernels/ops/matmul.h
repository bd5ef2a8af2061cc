// Matrix products on Tensor views: one GEMM per matrix, straight from strided storage. A view
// whose last two dims have a unit stride in either of them (row-major, or a transpose of one) is
// passed to the GEMM as a transpose flag with its leading dimension; no copy is made. Only an
// operand with no unit stride in its last two dims (e.g. a view that steps over columns) is first
// copied into a contiguous temporary.
//
//   Tensor x = Tensor::arange({6, 4}, DType::kF32);            // [M=6, K=4]
//   Tensor w = Tensor::arange({5, 4}, DType::kF32);            // a Linear weight [out=5, in=4]
//   Tensor y = matmul(x, w.transpose(0, 1));                    // [6, 5] = x @ w^T, no copy of w
//   Tensor dw = Tensor::zeros({5, 4}, DType::kF32);
//   matmul_out(dw, y.transpose(0, 1), x, {.beta = 1.0});        // dw += y^T @ x   (accumulate)
//
// Batched: a [..., M, K] @ b [..., K, N] -> [..., M, N]. The leading (batch) dims broadcast by
// torch.matmul's rules (aligned at the right; a missing or size-1 dim stretches), so
// x [B, T, D] @ w^T [D, N] is one GEMM over B*T rows whenever x's batch dims fold into its rows
// (always for a contiguous x), and q [B, H, T, E] @ k^T [B, H, E, S] is B*H GEMMs on strided
// views (e.g. heads sliced out of a fused QKV projection). 1-D operands are not promoted: use
// unsqueeze.
//
// dtypes: a and b share one of f32, f64, bf16, f16. bf16 and f16 products accumulate in f32
// and round once on the store: on a CPU with AVX512-BF16 bf16 runs a native kernel (vdpbf16ps,
// which reads bf16 subnormals as zero, as oneDNN does); otherwise the operands are widened exactly
// to f32 blocks; on CUDA cuBLAS computes in f32. `out` has a's dtype, or f32 when a is bf16/f16 (gradients kept in f32).
// Devices: all operands on one device; CPU through Eigen (vectorised for the best of SSE2,
// AVX2+FMA and AVX-512 the CPU supports, chosen at run time), CUDA through cuBLAS.
// Threads: the CPU product runs on the calling thread unless num_threads > 1; no thread pool is
// shared between callers, so N rank threads calling matmul use N cores, not N x cores.
#pragma once

#include "kernels/tensor.h"

namespace kernels {

struct MatmulOptions {
  double alpha = 1.0;  // out = alpha * (a @ b) + beta * out
  // 0: out is overwritten (its old contents may be NaN); 1: accumulate (gradient buffers).
  double beta = 0.0;
  // CPU only: split the product over this many threads (the caller's plus num_threads - 1 new
  // ones, joined before returning). Products below ~1 MFLOP stay on the calling thread.
  int num_threads = 1;
};

// REQUIRES: a.ndim() >= 2, b.ndim() >= 2, a.size(-1) == b.size(-2), batch dims broadcastable.
// Returns a new contiguous tensor of a's dtype; options.beta must be 0.
Tensor matmul(const Tensor& a, const Tensor& b, const MatmulOptions& options = {});

// Writes into `out` (any view with the broadcast batch shape and [M, N] as its last two dims;
// strides are honoured, including a transposed out). REQUIRES: out does not overlap a or b;
// out's batch dims have no stride 0 (each output matrix written once).
void matmul_out(const Tensor& out, const Tensor& a, const Tensor& b,
                const MatmulOptions& options = {});

}  // namespace kernels
