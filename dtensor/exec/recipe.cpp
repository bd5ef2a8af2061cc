#include "dtensor/exec/recipe.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>

#include "dtensor/exec/memory_check.h"
#include "kernels/error.h"

namespace dtensor {

using collectives::Reduction;
using kernels::InvalidArgument;

namespace {

ReduceOp op_of(const Step& step) {
  if (const auto* a = std::get_if<AllReduce>(&step)) return a->op;
  return std::get<ReduceScatter>(step).op;
}

std::optional<DType> wire_of(const Step& step) {
  if (const auto* a = std::get_if<AllReduce>(&step)) return a->wire;
  if (const auto* r = std::get_if<ReduceScatter>(&step)) return r->wire;
  return std::nullopt;
}

std::string shape_text(const Dims& d) { return fmt::format("[{}]", fmt::join(d, ",")); }

}  // namespace

bool is_reducing(const Step& step) {
  return std::holds_alternative<AllReduce>(step) || std::holds_alternative<ReduceScatter>(step);
}

std::vector<ExecStep> plan_dtypes(const Plan& plan, const Dims& mesh_shape, DType input, DType output,
                                  const ReducePolicy& policy) {
  const size_t n = plan.steps.size();
  std::vector<size_t> reducing;
  for (size_t i = 0; i < n; ++i)
    if (is_reducing(plan.steps[i])) reducing.push_back(i);
  const DType red = policy.reduce_dtype.value_or(input);
  if (policy.divide_factor <= 0 || !std::isfinite(policy.divide_factor))
    throw InvalidArgument(fmt::format("redistribute: divide_factor {} (expected a positive finite number)",
                                      policy.divide_factor));
  if (policy.reduce_dtype && (red == DType::kF8E4M3 || red == DType::kF8E5M2))
    throw InvalidArgument(fmt::format("redistribute: reduce dtype {} is storage-only (use f32, bf16, f16 or f64)",
                                      kernels::to_string(red)));
  const bool divides = policy.divide_factor != 1.0 || policy.force_sum;
  if (policy.divide_factor != 1.0 && !kernels::is_floating_point(red))
    throw InvalidArgument(fmt::format("redistribute: divide_factor {} needs a floating-point reduce dtype, not {}",
                                      policy.divide_factor, kernels::to_string(red)));
  if (policy.divide_factor != 1.0 && reducing.empty())
    throw InvalidArgument(fmt::format(
        "redistribute [{}] -> [{}]: divide_factor {} needs a reduction, and the transition reduces nothing",
        to_string(plan.src), to_string(plan.dst), policy.divide_factor));
  for (size_t i : reducing)
    if (divides && op_of(plan.steps[i]) != ReduceOp::kSum)
      throw InvalidArgument(fmt::format(
          "redistribute [{}] -> [{}]: a divide factor ({}) or force_sum applies to P(sum); step {} reduces "
          "with {}",
          to_string(plan.src), to_string(plan.dst), policy.divide_factor, to_string(plan.steps[i]),
          kernels::to_string(op_of(plan.steps[i]))));
  std::vector<ExecStep> out(n);
  const size_t first = reducing.empty() ? n : reducing.front(), last = reducing.empty() ? n : reducing.back();
  for (size_t i = 0; i < n; ++i) {
    ExecStep& p = out[i];
    if (reducing.empty() || i < first) p.in = p.out = p.work = input;
    else if (i > last) p.in = p.out = p.work = output;
    else {
      p.in = i == first ? input : red;
      p.out = i == last ? output : red;
      p.work = red;
    }
    if (is_reducing(plan.steps[i])) p.reduction = Reduction(op_of(plan.steps[i]));
    p.wire = p.work;
    if (const std::optional<DType> wire = wire_of(plan.steps[i]); wire && *wire != p.work) {
      if (!kernels::is_floating_point(p.work) || kernels::itemsize(*wire) >= kernels::itemsize(p.work))
        throw InvalidArgument(fmt::format("redistribute: step {} moves wire dtype {}, which is not narrower than "
                                          "its reduce dtype {}",
                                          to_string(plan.steps[i]), kernels::to_string(*wire),
                                          kernels::to_string(p.work)));
      p.wire = *wire;
    }
  }
  if (reducing.empty() || !divides) return out;
  const double f = policy.divide_factor;
  double k_all = 1;
  for (size_t i : reducing) k_all *= static_cast<double>(mesh_shape[mesh_dim_of(plan.steps[i])]);
  const double k_first = static_cast<double>(mesh_shape[mesh_dim_of(plan.steps[first])]);
  const bool overflow_risk = red != DType::kF32 && red != DType::kBF16;
  if (!overflow_risk && !policy.force_sum) {
    if (f == k_all) {
      for (size_t i : reducing) out[i].reduction = Reduction(ReduceOp::kAvg);
    } else if (f == k_first) {
      out[first].reduction = Reduction(ReduceOp::kAvg);
    } else {
      out[first].reduction = Reduction::premul_sum(1.0 / f);
    }
    return out;
  }
  double pre = 1;
  if (overflow_risk) {
    // FSDP2's pre-divide: p doubles while p divides f and f / p > p.
    const auto divides_f = [&](double p) { return std::fmod(f, p) == 0; };
    while (divides_f(pre) && f / pre > pre) pre *= 2;
  }
  if (pre != 1) out[first].reduction = Reduction::premul_sum(1.0 / pre);
  out[last].post_scale = pre / f;
  return out;
}

int64_t Recipe::schedule_bytes() const {
  int64_t n = static_cast<int64_t>(sizeof(Recipe) + steps.size() * sizeof(ExecStep));
  for (const PerStep& ps : per_step) {
    n += static_cast<int64_t>(sizeof(PerStep) + ps.after.size() * sizeof(Placement));
    for (const auto& s : ps.by_path)
      if (s) n += s->bytes();
  }
  return n;
}

std::shared_ptr<const Recipe> make_recipe(const RankContext& rc, const Plan& plan, const DTensorSpec& spec,
                                          DType output, const ReducePolicy& policy) {
  // NOTE [step validity]: a step valid for one global shape may not be for another.
  if (!plan.on_view() && !plan.valid_for(spec.shape))  // a view's plan: the executor checked the caller's shape
    throw InvalidArgument(fmt::format("execute: global shape {} is not one the plan {} was made for (plan it for this shape)",
                                      shape_text(spec.shape), to_string(plan)));
  auto r = std::make_shared<Recipe>();
  const Dims& mesh_shape = rc.mesh_shape;
  r->steps = plan_dtypes(plan, mesh_shape, spec.dtype, output, policy);
  r->src_local = compute_layout(spec.shape, mesh_shape, plan.src, rc.coord).local_shape;
  r->dst_local = compute_layout(spec.shape, mesh_shape, plan.dst, rc.coord).local_shape;
  if (plan.on_view()) {
    r->user_src_local = compute_layout(plan.tensor_shape, mesh_shape, plan.user_src, rc.coord).local_shape;
    r->user_dst_local = compute_layout(plan.tensor_shape, mesh_shape, plan.user_dst, rc.coord).local_shape;
  }
  for (size_t i = 0; i < plan.steps.size(); ++i) {
    const Step& step = plan.steps[i];
    const Placements& before = plan.states[i];
    Recipe::PerStep ps;
    ps.after = apply_step(step, before);
    ps.plain = is_plain_step(step, before, mesh_shape);
    const int m = mesh_dim_of(step);
    const int64_t k = mesh_shape[m];
    if (k > 1) {
      const DType moved = r->steps[i].work;
      auto add = [&](Path path) {
        ps.by_path[static_cast<size_t>(path)] = make_schedule(rc, spec.shape, before, ps.after, m, path, moved);
      };
      const Path exchange = rc.views[m] ? Path::kViews : Path::kPacked;
      std::visit(
          [&](const auto& s) {
            using T = std::decay_t<decltype(s)>;
            if constexpr (std::is_same_v<T, AllGather>) {
              add(Path::kAllGather);
              // The exchange serves an all-gather that cannot go straight into the result; one
              // that can needs it only for an input that is not contiguous (computed then).
              const bool direct = s.tensor_dim == 0 && ps.plain &&
                                  ps.by_path[static_cast<size_t>(Path::kAllGather)]->post_shape[0] % k == 0;
              if (!direct) add(exchange);
            } else if constexpr (std::is_same_v<T, StridedAllGather> || std::is_same_v<T, AllToAll> ||
                                 std::is_same_v<T, Regroup>) {
              add(exchange);
            } else if constexpr (std::is_same_v<T, ReduceScatter>) {
              if (r->steps[i].wire != moved)  // NOTE [wire dtype]: the per-member pieces
                ps.by_path[static_cast<size_t>(Path::kReduceScatter)] =
                    make_schedule(rc, spec.shape, before, ps.after, m, Path::kReduceScatter, moved, true);
              else
                add(Path::kReduceScatter);
            } else if constexpr (std::is_same_v<T, LocalChunk>) {
              add(Path::kLocalChunk);
            }
          },
          step);
    }
    r->per_step.push_back(std::move(ps));
  }
  std::vector<const DTensorSpec*> specs{&spec};
  std::vector<StepDTypes> dtypes;
  for (const ExecStep& p : r->steps) dtypes.push_back({p.in, p.out, p.work, p.post_scale != 1.0, p.wire});
  r->bytes = transition_bytes(plan, specs, rc, dtypes, false);
  r->bytes_with_out = transition_bytes(plan, specs, rc, dtypes, true);
  return r;
}

}  // namespace dtensor
