#include "kernels/ops/cross_entropy.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/compute.h"
#include "kernels/cuda/cuda_compute.h"
#include "kernels/detail/row_plan.h"
#include "kernels/error.h"
#include "kernels/format.h"
#include "kernels/ops/common.h"
#include "kernels/ops/elementwise.h"
#include "kernels/ops/reduction.h"

namespace kernels {
namespace {

using detail::CrossEntropyMode;
using detail::CrossEntropyPlan;

// logits [N, V] and targets [N]; returns N.
int64_t check_logits(const char* op, const Tensor& logits, const Tensor& targets) {
  detail::check_floating(op, logits, "logits");
  detail::check_index(op, targets, "targets");
  if (logits.ndim() != 2) {
    throw InvalidArgument(
        fmt::format("{}: logits have shape {}, expected 2 dims [N, V]", op, logits.shape()));
  }
  detail::check_shape(op, targets, "targets", Dims{logits.size(0)});
  detail::check_same_device(op, {{"logits", logits}, {"targets", targets}});
  return logits.size(0);
}

int64_t target_value(const std::vector<double>& host, size_t i) {
  return static_cast<int64_t>(host[i]);
}

// The targets on the host (for counting and range checks of CUDA targets).
std::vector<double> host_targets(const Tensor& targets) { return targets.to_vector(); }

// Number of rows whose target is not ignore_index; for CUDA tensors also the range check the
// CPU kernel does inline (one device-to-host copy of the [N] targets).
int64_t count_and_check(const char* op, const Tensor& targets, int64_t vocab_size,
                        int64_t ignore_index, bool range_check) {
  const std::vector<double> t = host_targets(targets);
  int64_t count = 0;
  for (size_t i = 0; i < t.size(); ++i) {
    const int64_t v = target_value(t, i);
    if (v == ignore_index) continue;
    ++count;
    if (range_check && (v < 0 || v >= vocab_size)) {
      throw InvalidArgument(
          fmt::format("{}: target {} at row {} is out of range (expected 0..{} or ignore_index {})",
                      op, v, i, vocab_size - 1, ignore_index));
    }
  }
  return count;
}

CrossEntropyPlan base_plan(CrossEntropyMode mode, const Tensor& logits, const Tensor& targets,
                           int64_t vocab_start, int64_t vocab_size, int64_t ignore_index) {
  CrossEntropyPlan p;
  p.mode = mode;
  p.n = logits.size(0);
  p.len = logits.size(1);
  p.vocab_start = vocab_start;
  p.vocab_size = vocab_size;
  p.ignore_index = ignore_index;
  if (logits.numel() > 0) {
    p.logits.data = logits.data_ptr();
    p.logits.dtype = logits.dtype();
    p.logits.outer_strides = Dims{logits.stride(0)};
    p.logits.stride = logits.stride(1);
  } else {
    p.logits.dtype = logits.dtype();
    p.logits.outer_strides = Dims{0};
  }
  if (targets.numel() > 0) {
    p.targets = targets.data_ptr();
    p.targets_dtype = targets.dtype();
    p.targets_stride = targets.stride(0);
  }
  return p;
}

void run(const CrossEntropyPlan& p, const Tensor& logits) {
  if (p.n == 0) return;
  if (logits.device().is_cuda()) {
    detail::cuda_cross_entropy(p, logits.device().index);
  } else {
    detail::cpu_cross_entropy(p);
  }
}

void check_dlogits(const char* op, const Tensor& dlogits, const Tensor& logits,
                   const Tensor& targets) {
  detail::check_floating(op, dlogits, "dlogits");
  detail::check_shape(op, dlogits, "dlogits", logits.shape());
  detail::check_writable(op, dlogits, "dlogits");
  detail::check_same_device(op, {{"logits", logits}, {"dlogits", dlogits}});
  if (!detail::same_view(dlogits, logits) && detail::may_overlap(dlogits, logits)) {
    throw InvalidArgument(
        fmt::format("{}: dlogits overlaps logits without being the same view", op));
  }
  if (detail::may_overlap(dlogits, targets)) {
    throw InvalidArgument(fmt::format("{}: dlogits overlaps targets", op));
  }
}

// Reduces the per-row losses [N] (stats dtype) as options say into `loss`.
void reduce_losses(const Tensor& loss, const Tensor& row_losses, int64_t count,
                   const CrossEntropyOptions& o) {
  switch (o.reduction) {
    case LossReduction::kNone:
      Tensor(loss).copy_(row_losses);
      return;
    case LossReduction::kSum:
      sum_out(loss, row_losses, {0});
      return;
    case LossReduction::kMean:
      sum_out(loss, row_losses, {0});
      scale_out(
          loss, loss,
          count == 0 ? std::numeric_limits<double>::quiet_NaN() : 1.0 / static_cast<double>(count));
      return;
  }
}

Dims loss_shape(int64_t n, const CrossEntropyOptions& o) {
  return o.reduction == LossReduction::kNone ? Dims{n} : Dims{};
}

double row_grad_scale(int64_t count, const CrossEntropyOptions& o) {
  if (o.reduction != LossReduction::kMean) return o.grad_scale;
  return count == 0 ? 0.0 : o.grad_scale / static_cast<double>(count);
}

}  // namespace

CrossEntropyOutput cross_entropy(const Tensor& logits, const Tensor& targets,
                                 const CrossEntropyOptions& options, bool compute_grad) {
  const int64_t n = check_logits("cross_entropy", logits, targets);
  const DType stats = detail::stats_dtype(logits.dtype());
  CrossEntropyOutput r;
  r.loss = Tensor::empty(loss_shape(n, options), stats, logits.device());
  if (compute_grad) r.dlogits = Tensor::empty(logits.shape(), logits.dtype(), logits.device());
  cross_entropy_out(r.loss, r.dlogits, logits, targets, options);
  return r;
}

void cross_entropy_out(const Tensor& loss, const Tensor& dlogits, const Tensor& logits,
                       const Tensor& targets, const CrossEntropyOptions& options) {
  constexpr const char* kOp = "cross_entropy";
  const int64_t n = check_logits(kOp, logits, targets);
  const DType stats = detail::stats_dtype(logits.dtype());
  detail::check_defined(kOp, loss, "loss");
  detail::check_shape(kOp, loss, "loss", loss_shape(n, options));
  detail::check_dtype(kOp, loss, "loss", stats);
  detail::check_same_device(kOp, {{"logits", logits}, {"loss", loss}});
  if (dlogits.defined()) check_dlogits(kOp, dlogits, logits, targets);
  const int64_t v = logits.size(1);
  const int64_t count =
      count_and_check(kOp, targets, v, options.ignore_index, logits.device().is_cuda());
  Tensor row_losses = Tensor::empty({n}, stats, logits.device());
  CrossEntropyPlan p =
      base_plan(CrossEntropyMode::kFused, logits, targets, 0, v, options.ignore_index);
  if (n > 0) p.row_losses = row_losses.data_ptr();
  if (dlogits.defined() && dlogits.numel() > 0) p.dlogits = detail::as_rows(dlogits, 1);
  p.grad_scale = row_grad_scale(count, options);
  run(p, logits);
  reduce_losses(loss, row_losses, count, options);
}

CrossEntropyRowStats cross_entropy_shard_stats(const Tensor& logits, const Tensor& targets,
                                               int64_t vocab_start, int64_t vocab_size,
                                               int64_t ignore_index) {
  constexpr const char* kOp = "cross_entropy_shard_stats";
  const int64_t n = check_logits(kOp, logits, targets);
  if (vocab_start < 0 || vocab_start + logits.size(1) > vocab_size) {
    throw InvalidArgument(fmt::format(
        "{}: the shard holds columns [{}, {}) but the vocab has {} (expected 0 <= vocab_start "
        "and vocab_start + V_local <= vocab_size)",
        kOp, vocab_start, vocab_start + logits.size(1), vocab_size));
  }
  if (logits.device().is_cuda()) count_and_check(kOp, targets, vocab_size, ignore_index, true);
  const DType stats = detail::stats_dtype(logits.dtype());
  CrossEntropyRowStats s{Tensor::empty({n}, stats, logits.device()),
                         Tensor::empty({n}, stats, logits.device()),
                         Tensor::empty({n}, stats, logits.device())};
  CrossEntropyPlan p =
      base_plan(CrossEntropyMode::kStats, logits, targets, vocab_start, vocab_size, ignore_index);
  if (n > 0) {
    p.stat_max = s.max.data_ptr();
    p.stat_sum_exp = s.sum_exp.data_ptr();
    p.stat_target = s.target_logit.data_ptr();
  }
  run(p, logits);
  return s;
}

void rescale_sum_exp_(const Tensor& sum_exp, const Tensor& local_max, const Tensor& global_max) {
  constexpr const char* kOp = "rescale_sum_exp_";
  for (const auto& [name, t] : {std::pair<const char*, const Tensor&>{"sum_exp", sum_exp},
                                {"local_max", local_max},
                                {"global_max", global_max}}) {
    detail::check_floating(kOp, t, name);
    if (t.ndim() != 1) {
      throw InvalidArgument(fmt::format("{}: {} has shape {}, expected [N]", kOp, name, t.shape()));
    }
  }
  if (sum_exp.dtype() != DType::kF32 && sum_exp.dtype() != DType::kF64) {
    throw InvalidArgument(
        fmt::format("{}: sum_exp has dtype {}, expected f32 or f64 (the stats "
                    "dtype)",
                    kOp, sum_exp.dtype()));
  }
  detail::check_shape(kOp, local_max, "local_max", sum_exp.shape());
  detail::check_shape(kOp, global_max, "global_max", sum_exp.shape());
  detail::check_same_dtype(
      kOp, {{"sum_exp", sum_exp}, {"local_max", local_max}, {"global_max", global_max}});
  detail::check_same_device(
      kOp, {{"sum_exp", sum_exp}, {"local_max", local_max}, {"global_max", global_max}});
  if (sum_exp.numel() == 0) return;
  if (sum_exp.device().is_cuda()) {
    detail::cuda_rescale_sum_exp(sum_exp.data_ptr(), sum_exp.stride(0), local_max.data_ptr(),
                                 local_max.stride(0), global_max.data_ptr(), global_max.stride(0),
                                 sum_exp.dtype(), sum_exp.numel(), sum_exp.device().index);
    return;
  }
  // A few scalars per row: plain loop in the stats dtype (f64 arithmetic).
  Tensor s = sum_exp;
  const std::vector<double> lm = local_max.to_vector(), gm = global_max.to_vector();
  const std::vector<double> se = sum_exp.to_vector();
  for (int64_t i = 0; i < sum_exp.numel(); ++i) {
    const auto u = static_cast<size_t>(i);
    const double r =
        lm[u] == -std::numeric_limits<double>::infinity() ? 0.0 : se[u] * std::exp(lm[u] - gm[u]);
    s.set_item({i}, r);
  }
}

Tensor cross_entropy_loss_from_stats(const Tensor& global_max, const Tensor& global_sum_exp,
                                     const Tensor& global_target_logit, const Tensor& targets,
                                     const CrossEntropyOptions& options) {
  constexpr const char* kOp = "cross_entropy_loss_from_stats";
  detail::check_index(kOp, targets, "targets");
  if (targets.ndim() != 1) {
    throw InvalidArgument(
        fmt::format("{}: targets have shape {}, expected [N]", kOp, targets.shape()));
  }
  const int64_t n = targets.size(0);
  for (const auto& [name, t] : {std::pair<const char*, const Tensor&>{"global_max", global_max},
                                {"global_sum_exp", global_sum_exp},
                                {"global_target_logit", global_target_logit}}) {
    detail::check_floating(kOp, t, name);
    detail::check_shape(kOp, t, name, Dims{n});
  }
  detail::check_same_dtype(kOp, {{"global_max", global_max},
                                 {"global_sum_exp", global_sum_exp},
                                 {"global_target_logit", global_target_logit}});
  detail::check_same_device(kOp, {{"global_max", global_max}, {"targets", targets}});
  // N scalars: computed on the host in f64 and rounded once to the stats dtype, so every rank
  // (same inputs) gets the same bits whatever its device.
  const std::vector<double> m = global_max.to_vector(), s = global_sum_exp.to_vector(),
                            t = global_target_logit.to_vector(), tg = targets.to_vector();
  std::vector<double> rows(static_cast<size_t>(n), 0.0);
  int64_t count = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    if (static_cast<int64_t>(tg[i]) == options.ignore_index) continue;
    ++count;
    rows[i] = std::log(s[i]) + m[i] - t[i];
  }
  const DType stats = global_max.dtype();
  Tensor out = Tensor::from_vector(rows, {n}, stats).to(global_max.device());
  if (options.reduction == LossReduction::kNone) return out;
  Tensor loss = Tensor::empty({}, stats, global_max.device());
  reduce_losses(loss, out, count, options);
  return loss;
}

void cross_entropy_shard_backward_out(const Tensor& dlogits, const Tensor& logits,
                                      const Tensor& targets, int64_t vocab_start,
                                      const Tensor& global_max, const Tensor& global_sum_exp,
                                      const CrossEntropyOptions& options) {
  constexpr const char* kOp = "cross_entropy_shard_backward_out";
  const int64_t n = check_logits(kOp, logits, targets);
  check_dlogits(kOp, dlogits, logits, targets);
  const DType stats = detail::stats_dtype(logits.dtype());
  for (const auto& [name, t] : {std::pair<const char*, const Tensor&>{"global_max", global_max},
                                {"global_sum_exp", global_sum_exp}}) {
    detail::check_floating(kOp, t, name);
    detail::check_shape(kOp, t, name, Dims{n});
    detail::check_dtype(kOp, t, name, stats);
    detail::check_same_device(kOp, {{"logits", logits}, {name, t}});
  }
  if (vocab_start < 0) {
    throw InvalidArgument(fmt::format("{}: vocab_start is {}, expected >= 0", kOp, vocab_start));
  }
  // Targets are range-checked by cross_entropy_shard_stats; here only counted.
  const int64_t count = count_and_check(kOp, targets, 0, options.ignore_index, false);
  const Tensor gm = global_max.contiguous(), gs = global_sum_exp.contiguous();
  CrossEntropyPlan p = base_plan(CrossEntropyMode::kBackward, logits, targets, vocab_start,
                                 std::numeric_limits<int64_t>::max(), options.ignore_index);
  if (dlogits.numel() == 0) return;
  p.dlogits = detail::as_rows(dlogits, 1);
  p.global_max = gm.data_ptr();
  p.global_sum_exp = gs.data_ptr();
  p.grad_scale = row_grad_scale(count, options);
  run(p, logits);
}

}  // namespace kernels
