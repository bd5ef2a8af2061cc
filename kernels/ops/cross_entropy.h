// Cross-entropy over logits [N, V] and integer targets [N], with the logits' gradient computed
// in the same pass (no softmax tensor is materialised), plus the per-row pieces of the same loss
// on a vocab shard (logits [N, V_local], columns vocab_start.. of the full vocab), so a
// loss-parallel layer all-reduces only a few scalars per row and never gathers the logits.
//
//   Tensor logits = ...;                                  // [N, V] f32 or bf16
//   Tensor targets = Tensor::from_vector({3, -100, 0}, {3}, DType::kI64);
//   CrossEntropyOutput ce = cross_entropy(logits, targets);
//   // ce.loss: 0-d f32, mean over the 2 rows whose target is not ignore_index (-100)
//   // ce.dlogits: [N, V], (softmax(logits) - onehot(target)) / 2, zero on the ignored row
//
// Loss parallel on vocab shards (each rank holds logits[:, vocab_start : vocab_start + V_local]):
//   CrossEntropyRowStats s = cross_entropy_shard_stats(logits_shard, targets, vocab_start, V);
//   Tensor gmax = s.max.clone();            all_reduce(gmax, kMax);
//   rescale_sum_exp_(s.sum_exp, s.max, gmax);    // now relative to the global row max
//   all_reduce(s.sum_exp, kSum);  all_reduce(s.target_logit, kSum);   // (may share one buffer)
//   Tensor loss = cross_entropy_loss_from_stats(gmax, s.sum_exp, s.target_logit, targets);
//   cross_entropy_shard_backward_out(dlogits_shard, logits_shard, targets, vocab_start, gmax,
//                                    s.sum_exp);          // this shard's slice of dlogits
// The loss is bitwise identical on every rank (it is computed from all-reduced values only),
// and equals cross_entropy on the gathered logits up to rounding of the sum of exponentials.
//
// Rules: logits floating (f32, f64, bf16, f16), [N, V], any strided view; targets i64 or i32,
// [N], any stride. Row statistics, the loss and the arithmetic are f32 (f64 for f64 logits);
// dlogits is an out of any floating dtype, or the logits' dtype for the functional form. Every
// target is either ignore_index or in [0, V) (V = vocab_size for a shard); InvalidArgument names
// the first other value and its row. Reductions (PyTorch's): kMean divides by the number of
// non-ignored rows (NaN when there are none, as PyTorch); kSum; kNone returns the [N] per-row
// losses (0 on ignored rows). label_smoothing is not supported. All operands on one device.
#pragma once

#include <cstdint>

#include "kernels/tensor.h"

namespace kernels {

enum class LossReduction { kMean, kSum, kNone };

struct CrossEntropyOptions {
  int64_t ignore_index = -100;
  LossReduction reduction = LossReduction::kMean;
  // Multiplies dlogits: the upstream gradient of the (reduced) loss. With kNone, dlogits is the
  // gradient of grad_scale * sum(per-row losses).
  double grad_scale = 1.0;
};

struct CrossEntropyOutput {
  Tensor loss;     // 0-d, or [N] for kNone
  Tensor dlogits;  // [N, V]; undefined when not requested
};

// compute_grad: also return dlogits (the fused backward).
CrossEntropyOutput cross_entropy(const Tensor& logits, const Tensor& targets,
                                 const CrossEntropyOptions& options = {}, bool compute_grad = true);
// loss: 0-d (or [N] for kNone), f32 (f64 for f64 logits). dlogits: [N, V] or undefined.
void cross_entropy_out(const Tensor& loss, const Tensor& dlogits, const Tensor& logits,
                       const Tensor& targets, const CrossEntropyOptions& options = {});

// ---- the pieces on a vocab shard ----

struct CrossEntropyRowStats {
  Tensor max;           // [N]: max over this shard's columns (-inf for an empty shard)
  Tensor sum_exp;       // [N]: sum over the columns of exp(logit - max) (0 for an empty shard)
  Tensor target_logit;  // [N]: the target's logit when it lies in this shard, else 0 (and 0
                        //      on ignored rows)
};
// logits [N, V_local] hold global columns [vocab_start, vocab_start + V_local) of a vocab of
// vocab_size. REQUIRES: 0 <= vocab_start, vocab_start + V_local <= vocab_size.
CrossEntropyRowStats cross_entropy_shard_stats(const Tensor& logits, const Tensor& targets,
                                               int64_t vocab_start, int64_t vocab_size,
                                               int64_t ignore_index = -100);
// sum_exp *= exp(local_max - global_max), in place, so shards' sums can be added; a row with
// local_max = -inf (an empty shard) keeps 0. All three [N] of the stats dtype.
void rescale_sum_exp_(const Tensor& sum_exp, const Tensor& local_max, const Tensor& global_max);
// The loss from the global (all-reduced) row statistics: per row log(sum_exp) + max -
// target_logit, reduced as options.reduction says (ignored rows excluded). Returns 0-d or [N].
Tensor cross_entropy_loss_from_stats(const Tensor& global_max, const Tensor& global_sum_exp,
                                     const Tensor& global_target_logit, const Tensor& targets,
                                     const CrossEntropyOptions& options = {});
// This shard's dlogits [N, V_local] = (exp(logit - global_max) / global_sum_exp - onehot) * g,
// g = options.grad_scale / (non-ignored count for kMean, else 1), zero on ignored rows.
void cross_entropy_shard_backward_out(const Tensor& dlogits, const Tensor& logits,
                                      const Tensor& targets, int64_t vocab_start,
                                      const Tensor& global_max, const Tensor& global_sum_exp,
                                      const CrossEntropyOptions& options = {});

}  // namespace kernels
