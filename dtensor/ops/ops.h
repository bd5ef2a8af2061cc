// Compute on DTensors: each op picks one sharding rule per mesh dim (dtensor/ops/rules.h),
// redistributes inputs that fit no rule by the cheapest plan, runs the kernel on every rank's
// local shard, and returns the output with the rule's placements. Each op has a backward that
// returns gradients with the rule's transposed placements (NOTE [gradient transpose]).
//
//   // x [B, T, K] sharded over the batch, w [N, K] sharded by rows over tp (ColwiseParallel):
//   Saved saved;
//   DTensor y = einsum("btk,nk->btn", x, w, opts, &saved);   // [S(0),S(2)], no communication
//   std::optional<DTensor> w_grad;                           // or a caller buffer to add to
//   const GradSink sinks[] = {GradSink{}, GradSink{true, &w_grad}};
//   Grads g = einsum_backward(saved, dy, sinks, opts);
//   // g[0] = dx [S(0),P(sum)] (each tp rank holds its part of the sum over N); w_grad holds
//   // [P(sum),S(0)] (summed over the batch this dp rank holds).
//
// Saved: what a forward call keeps for its backward (the inputs as the op used them, after
// any implicit redistribute, and the op's own statistics). The caller owns it (nn keeps it in
// the per-call context), so several calls, microbatches or recomputations can be in flight.
//
// Implicit redistributes (an input whose placements fit no rule) are logged to
// OpOptions::log, or refused with forbid_implicit. Their gradients are redistributed back to
// the transpose of the placements the caller passed.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dtensor/dtensor.h"
#include "dtensor/ops/rules.h"
#include "kernels/ops/cross_entropy.h"
#include "kernels/ops/elementwise.h"

namespace dtensor::ops {

using kernels::GeluApproximation;

// One implicit redistribute: input `input` of `op` moved from `from` to `to` along `route`.
struct RedistributeEvent {
  std::string op;
  int input = 0;
  Placements from, to;
  std::string route;      // to_string(plan)
  bool backward = false;  // a gradient mapped back to its input's placements
};
std::string to_string(const RedistributeEvent& event);

// Collects implicit redistributes (one per rank: not thread-safe, like the rank's ops).
class RedistributeLog {
 public:
  // Also hand every event to `sink` (e.g. print it) as it happens.
  std::function<void(const RedistributeEvent&)> sink;
  void record(RedistributeEvent event);
  const std::vector<RedistributeEvent>& events() const { return events_; }
  size_t size() const { return events_.size(); }
  void clear() { events_.clear(); }

 private:
  std::vector<RedistributeEvent> events_;
};

struct OpOptions {
  RedistributeLog* log = nullptr;  // records every implicit redistribute
  bool forbid_implicit = false;    // throw Unsupported instead of redistributing implicitly
  ChooseOptions choose;            // planner and cost model that price the choices
  int num_threads = 1;             // CPU threads per matmul / attention kernel call
};

// What an op's backward needs of its forward call.
struct Saved {
  std::string op;
  std::string equation;  // einsum
  Strategy strategy;
  std::vector<Placements> given;  // input placements as passed
  std::vector<DTensor> inputs;    // as used (only those the backward reads)
  std::vector<DTensor> extras;    // op statistics (rstd, lse, dlogits ...)
  std::vector<double> scalars;    // op parameters (scale factors ...)
};

// Where a gradient goes. `into` empty: the gradient is stored there; holding a tensor: the
// gradient is added to it (accumulate) or written over it, converted to its placements and dtype
// when they differ (e.g. a caller-provided flat buffer view). into == nullptr: returned.
struct GradSink {
  bool needed = true;
  std::optional<DTensor>* into = nullptr;
  bool accumulate = true;
};
using Grads = std::vector<std::optional<DTensor>>;  // one per input (nullopt: sunk or not needed)

// ---- contraction ----

// Two-operand einsum over single-letter labels (see einsum_rules): e.g. "btk,nk->btn" (a
// Linear), "btn,btk->nk" (its weight gradient), "bhts,bhsd->bhtd".
DTensor einsum(std::string_view equation, const DTensor& a, const DTensor& b, const OpOptions& options = {},
               Saved* saved = nullptr);
Grads einsum_backward(const Saved& saved, const DTensor& dy, std::span<const GradSink> sinks,
                      const OpOptions& options = {});
// torch.matmul for a [..., M, K] with b [K, N] (broadcast) or b [..., K, N] (same batch dims).
DTensor matmul(const DTensor& a, const DTensor& b, const OpOptions& options = {}, Saved* saved = nullptr);

// ---- element-wise ----

// a + alpha * b, b broadcast into a from the right (bias [N] into [B, T, N]).
DTensor add(const DTensor& a, const DTensor& b, double alpha = 1.0, const OpOptions& options = {},
            Saved* saved = nullptr);
Grads add_backward(const Saved& saved, const DTensor& dy, std::span<const GradSink> sinks,
                   const OpOptions& options = {});
DTensor mul(const DTensor& a, const DTensor& b, const OpOptions& options = {}, Saved* saved = nullptr);
Grads mul_backward(const Saved& saved, const DTensor& dy, std::span<const GradSink> sinks,
                   const OpOptions& options = {});
DTensor scale(const DTensor& x, double alpha, const OpOptions& options = {}, Saved* saved = nullptr);
DTensor gelu(const DTensor& x, GeluApproximation approximation, const OpOptions& options = {},
             Saved* saved = nullptr);
DTensor silu(const DTensor& x, const OpOptions& options = {}, Saved* saved = nullptr);
// The backward of scale, gelu and silu (the op is recorded in saved).
DTensor unary_backward(const Saved& saved, const DTensor& dy, const OpOptions& options = {});

// ---- reductions and softmax ----

DTensor sum(const DTensor& x, const Dims& dims, const OpOptions& options = {}, Saved* saved = nullptr);
DTensor sum_backward(const Saved& saved, const DTensor& dy, const OpOptions& options = {});
// Softmax over the last dim.
DTensor softmax(const DTensor& x, const OpOptions& options = {}, Saved* saved = nullptr);
DTensor softmax_backward(const Saved& saved, const DTensor& dy, const OpOptions& options = {});

// ---- normalisation over the last dim (inputs: x, then weight, then bias) ----

// weight may be nullptr (no affine weight).
DTensor rms_norm(const DTensor& x, const DTensor* weight, double eps, const OpOptions& options = {},
                 Saved* saved = nullptr);
// weight and bias may be nullptr.
DTensor layer_norm(const DTensor& x, const DTensor* weight, const DTensor* bias, double eps,
                   const OpOptions& options = {}, Saved* saved = nullptr);
// sinks: x, then weight and bias where the forward had them.
Grads norm_backward(const Saved& saved, const DTensor& dy, std::span<const GradSink> sinks,
                    const OpOptions& options = {});

// ---- embedding, loss, attention ----

// weight [V, D], ids (i64 or i32) [...] -> [..., D]. Ids outside [0, V) raise InvalidArgument.
DTensor embedding(const DTensor& weight, const DTensor& ids, const OpOptions& options = {},
                  Saved* saved = nullptr);
// The weight's gradient (ids have none): sinks[0] is the weight's sink.
Grads embedding_backward(const Saved& saved, const DTensor& dy, std::span<const GradSink> sinks,
                         const OpOptions& options = {});

// Mean (or sum) cross-entropy of logits [..., V] against targets [...] (ignore_index rows
// excluded), a 0-d DTensor. On vocab-sharded logits (loss parallel) it all-reduces per-row
// statistics over the vocab's mesh dims and never gathers the logits. The gradient of the
// logits is computed in the same pass and kept in saved.
DTensor cross_entropy(const DTensor& logits, const DTensor& targets,
                      kernels::LossReduction reduction = kernels::LossReduction::kMean,
                      int64_t ignore_index = -100, const OpOptions& options = {}, Saved* saved = nullptr);
// dloss: the upstream gradient (0-d); the logits' gradient, of the logits' placements.
DTensor cross_entropy_backward(const Saved& saved, const DTensor& dloss, const OpOptions& options = {});

// Causal scaled dot-product attention, q, k, v [B, H, T, E], scale 1/sqrt(E).
DTensor attention(const DTensor& q, const DTensor& k, const DTensor& v, const OpOptions& options = {},
                  Saved* saved = nullptr);
Grads attention_backward(const Saved& saved, const DTensor& dout, std::span<const GradSink> sinks,
                         const OpOptions& options = {});

// ---- views (no data movement where the placements allow) ----

DTensor transpose(const DTensor& x, int d0, int d1, const OpOptions& options = {});
// Splits one dim or merges adjacent dims (see view_rules). The local result is a view when the
// local strides allow it, else a copy.
DTensor view(const DTensor& x, const Dims& shape, const OpOptions& options = {});

// The gradient of a redistribute from placements `given` (what the caller held) for a
// gradient `grad` of the redistributed tensor: grad moved to the transpose of `given`
// (S stays S, P becomes R, R keeps a P(sum) gradient as is). No-op when already there.
DTensor grad_to(const DTensor& grad, const Placements& given, const OpOptions& options = {},
                std::string_view op = "grad_to");

// Adds g into the sink (see GradSink), redistributing and casting as needed. Returns g when the
// sink is a plain return (into == nullptr), else nullopt.
std::optional<DTensor> sink_grad(const GradSink& sink, DTensor g, const OpOptions& options = {});

}  // namespace dtensor::ops
