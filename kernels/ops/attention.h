// Scaled dot-product attention with an optional causal mask (PyTorch's
// F.scaled_dot_product_attention(q, k, v, is_causal=...) without dropout), forward and backward.
// A plain reference built from the GEMMs of kernels/ops/matmul.h: per (batch, head) the scores
// S = scale * q @ k^T [T, S], masked, softmax, out = P @ v. The forward saves only the row
// log-sum-exp (like flash attention); the backward recomputes P from it, so no [T, S] tensor
// outlives a call.
//
//   // q, k, v as strided views of a fused projection qkv [B, T, 3, H, E] (no copies):
//   Tensor q = qkv.select(2, 0).transpose(1, 2);     // [B, H, T, E]
//   AttentionOutput a = attention(q, k, v);          // causal, scale 1/sqrt(E)
//   // a.out [B, H, T, E]; a.lse [B, H, T] f32
//   AttentionGrads g = attention_backward(dout, q, k, v, a.out, a.lse);
//   // or straight into the matching slices of a fused dqkv buffer:
//   attention_backward_out(dq_view, dk_view, dv_view, dout, q, k, v, a.out, a.lse);
//
// Shapes: q [..., T, E], k [..., S, E], v [..., S, Ev] with identical leading dims (no
// broadcasting); out [..., T, Ev]; lse [..., T]. causal masks key j for query i when j > i
// (top-left aligned, as PyTorch's is_causal, also when T != S). A query row that sees no key
// (S = 0) gets out 0, lse -inf and zero gradients (PyTorch's math kernel would give NaN).
// dtypes: q, k, v share f32, f64, bf16 or f16; the scores, softmax and lse are f32 (f64 for f64
// inputs); bf16/f16 products accumulate in f32. Any strided views. CPU or CUDA.
#pragma once

#include <optional>

#include "kernels/tensor.h"

namespace kernels {

struct AttentionOptions {
  bool causal = true;
  std::optional<double> scale;  // default 1 / sqrt(E)
  // CPU: passed to the products (MatmulOptions::num_threads), which split their batch of
  // (batch, head) matrices over this many threads.
  int num_threads = 1;
};

struct AttentionOutput {
  Tensor out;
  Tensor lse;  // saved for the backward
};
AttentionOutput attention(const Tensor& q, const Tensor& k, const Tensor& v,
                          const AttentionOptions& options = {});
// REQUIRES: out [..., T, Ev] of q's dtype or f32; lse [..., T] of the stats dtype. out must not
// overlap q, k or v.
void attention_out(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                   const Tensor& v, const AttentionOptions& options = {});

struct AttentionGrads {
  Tensor dq;
  Tensor dk;
  Tensor dv;
};
AttentionGrads attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                                  const Tensor& v, const Tensor& out, const Tensor& lse,
                                  const AttentionOptions& options = {});
// Writes (overwrites) dq, dk, dv (shapes of q, k, v; any floating dtype; any strided views that
// do not overlap each other or the inputs).
void attention_backward_out(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                            const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& out, const Tensor& lse,
                            const AttentionOptions& options = {});

}  // namespace kernels
