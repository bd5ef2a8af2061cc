#include "dtensor/exec/memory_check.h"

#include <fmt/format.h>

#include <limits>
#include <type_traits>
#include <vector>

#include "dtensor/layout.h"
#include "dtensor/mesh_comms.h"
#include "kernels/error.h"

namespace dtensor {

namespace {

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

// a + b * c for non-negative numbers, saturating at INT64_MAX (the point is "more than there is").
int64_t add_bytes(int64_t a, int64_t b, int64_t c) {
  if (b == 0 || c == 0) return a;
  if (b > kMax / c) return kMax;
  const int64_t bc = b * c;
  return a > kMax - bc ? kMax : a + bc;
}

int64_t size_of(kernels::DType d) { return static_cast<int64_t>(kernels::itemsize(d)); }

}  // namespace

bool all_reduces_in_place(const Step& step, int64_t group_size, const StepDTypes& d) {
  return std::holds_alternative<AllReduce>(step) && group_size > 1 && d.in == d.work && d.out == d.work &&
         !d.scaled && (!d.wire || *d.wire == d.work);
}

int64_t transition_bytes(const Plan& plan, std::span<const DTensorSpec* const> specs, const RankContext& rank,
                         std::span<const StepDTypes> dtypes, bool caller_outs) {
  const size_t n = plan.steps.size();
  if (n == 0 || specs.empty()) return 0;
  const Dims& mesh_shape = rank.mesh_shape;
  const Dims& coord = rank.coord;
  // Local element counts of the batch before and after every step (summed over the tensors).
  std::vector<int64_t> numel(n + 1, 0);
  for (const DTensorSpec* spec : specs)
    for (size_t i = 0; i <= n; ++i) {
      const int64_t e = compute_layout(spec->shape, mesh_shape, plan.states[i], coord).local_shape.product();
      numel[i] = numel[i] > kMax - e ? kMax : numel[i] + e;
    }
  const bool batch = specs.size() > 1;
  // The first step that writes into the caller's outs: the final one, or the one before a run of
  // in-place all-reduces (the issuer's rule).
  size_t writes_out = n - 1;
  while (writes_out > 0 && !batch &&
         all_reduces_in_place(plan.steps[writes_out], mesh_shape[mesh_dim_of(plan.steps[writes_out])], dtypes[writes_out]))
    --writes_out;
  int64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    const Step& step = plan.steps[i];
    const StepDTypes& d = dtypes[i];
    const int m = mesh_dim_of(step);
    const int64_t k = mesh_shape[m];
    const int64_t pre = numel[i], post = numel[i + 1];
    const int64_t in_sz = size_of(d.in), out_sz = size_of(d.out), work_sz = size_of(d.work);
    const bool reducing = std::holds_alternative<AllReduce>(step) || std::holds_alternative<ReduceScatter>(step);
    // The caller's out holds the final result when its dtype is the step's (the executor writes
    // straight into it then, else it allocates the result and copies at the end).
    const bool result_is_out = caller_outs && i >= writes_out;
    if (k == 1) {
      // Nothing moves; a reduction over one member that casts or scales makes a new tensor.
      if (reducing && (d.in != d.out || d.work != d.out || d.scaled)) {
        total = add_bytes(total, pre, work_sz);
        if (!result_is_out) total = add_bytes(total, post, out_sz);
      }
      continue;
    }
    std::visit(
        [&](const auto& s) {
          using T = std::decay_t<decltype(s)>;
          const bool wire = d.wire && *d.wire != d.work;
          const int64_t wire_sz = wire ? size_of(*d.wire) : 0;
          // Staged in the work dtype for an fp8 wire's scale or an input wider than the work dtype.
          const bool staged = wire && (*d.wire == kernels::DType::kF8E4M3 || *d.wire == kernels::DType::kF8E5M2 ||
                                       in_sz > work_sz);
          const int64_t stage_sz = staged ? work_sz : 0;
          if constexpr (std::is_same_v<T, AllReduce>) {
            if (wire) {
              const int64_t chunk = pre / k + 1;
              total = add_bytes(total, pre, stage_sz + wire_sz);             // the input (staged), packed
              total = add_bytes(total, add_bytes(0, k - 1, chunk), wire_sz);  // the pieces received
              total = add_bytes(total, add_bytes(0, 2, chunk), work_sz);      // the sum, its staging
              total = add_bytes(total, post, wire_sz);                       // the gathered result
              if (!result_is_out) total = add_bytes(total, post, out_sz);
              return;
            }
            if (d.in != d.work || batch) total = add_bytes(total, pre, work_sz);  // the input copy
            const bool into_result = !batch && d.out == d.work && !d.scaled;
            // In place on the previous reduction's result (a new buffer or the caller's out).
            const bool on_previous = into_result && d.in == d.work && i > 0 &&
                                     (std::holds_alternative<AllReduce>(plan.steps[i - 1]) ||
                                      std::holds_alternative<ReduceScatter>(plan.steps[i - 1])) &&
                                     mesh_shape[mesh_dim_of(plan.steps[i - 1])] > 1 &&
                                     (!dtypes[i - 1].wire || *dtypes[i - 1].wire == dtypes[i - 1].work);
            if (!on_previous) total = add_bytes(total, post, work_sz);  // the reduced buffer (the result when into_result)
            if (!into_result && !result_is_out) total = add_bytes(total, post, out_sz);
          } else if constexpr (std::is_same_v<T, ReduceScatter>) {
            if (wire) {
              total = add_bytes(total, pre, stage_sz + wire_sz);      // the input (staged), packed
              total = add_bytes(total, k - 1, add_bytes(0, post, wire_sz));  // the pieces received
              total = add_bytes(total, add_bytes(0, 2, post), work_sz);  // the sum, its staging
              if (!result_is_out) total = add_bytes(total, post, out_sz);
              return;
            }
            total = add_bytes(total, pre, work_sz);   // the packed (or cast) input
            total = add_bytes(total, post, work_sz);  // the reduced chunk
            if (pre != k * post) total = add_bytes(total, k - 1, add_bytes(0, post, work_sz));  // uneven: per peer
            if (!result_is_out) total = add_bytes(total, post, out_sz);
          } else if constexpr (std::is_same_v<T, LocalChunk> || std::is_same_v<T, LocalPartial>) {
            if (!result_is_out) total = add_bytes(total, post, out_sz);
          } else if constexpr (std::is_same_v<T, LocalEmbed>) {
            total = add_bytes(total, pre, in_sz);  // the packed shard
            if (!result_is_out) total = add_bytes(total, post, out_sz);
          } else {  // data movement: all-gathers, all-to-alls, regroups (NOTE [exchange])
            const bool staged = !rank.views[m] || (std::is_same_v<T, AllGather> && batch);
            if (staged) total = add_bytes(add_bytes(total, pre, work_sz), post, work_sz);
            if (!result_is_out) total = add_bytes(total, post, work_sz);
          }
        },
        step);
  }
  return total;
}

int64_t transition_bytes(const Plan& plan, std::span<const DTensorSpec* const> specs, const MeshComms& comms,
                         std::span<const StepDTypes> dtypes, bool caller_outs) {
  return transition_bytes(plan, specs, RankContext::of(comms), dtypes, caller_outs);
}

}  // namespace dtensor
