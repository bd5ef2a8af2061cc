#include "dtensor/plan/transition.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <bit>

#include "kernels/error.h"

namespace dtensor {

using kernels::InvalidArgument;
using kernels::Unsupported;

namespace {

std::string text(const PlacementList& ps) { return to_string(Placements(ps.begin(), ps.end())); }

// PyTorch 2.15's one way into a new Partial: a plain Shard becoming P(sum) (a local zero-fill).
bool shard_to_partial_sum(const Placement& from, const Placement& to) {
  return is_shard(from) && to == Placement{Partial{ReduceOp::kSum}};
}

void check_pair(const PlacementList& src, const PlacementList& dst, bool allow_partial_target) {
  for (size_t m = 0; m < dst.size(); ++m) {
    const auto* to = std::get_if<Partial>(&dst[m]);
    if (!to || src[m] == dst[m]) continue;
    const std::string what =
        fmt::format("cannot redistribute [{}] -> [{}] on mesh dim {}", text(src), text(dst), m);
    if (is_partial(src[m]))
      throw Unsupported(fmt::format("{}: {} -> {} changes the reduce op (a Partial keeps its op)", what,
                                    to_string(src[m]), to_string(dst[m])));
    if (shard_to_partial_sum(src[m], dst[m])) continue;
    if (shard_dim(src[m]).has_value())
      throw Unsupported(fmt::format(
          "{}: {} -> {} is not supported (only a Shard becomes Partial, and only P(sum), as in PyTorch 2.15)", what,
          to_string(src[m]), to_string(dst[m])));
    if (!allow_partial_target)
      throw Unsupported(fmt::format(
          "{}: Replicate -> {} would create a new Partial (only a source's own Partial may stay Partial)", what,
          to_string(dst[m])));
  }
}

void mix(size_t& h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
}

void mix_placement(size_t& h, const Placement& p) {
  mix(h, p.index());
  mix(h, static_cast<uint64_t>(shard_dim(p).value_or(-1)));
  if (const auto* s = std::get_if<StridedShard>(&p)) mix(h, static_cast<uint64_t>(s->split_factor));
  if (const auto* q = std::get_if<Partial>(&p)) mix(h, static_cast<uint64_t>(q->op));
  if (const auto* r = std::get_if<RaggedShard>(&p)) {
    mix(h, static_cast<uint64_t>(r->dim));
    mix(h, static_cast<uint64_t>(r->align));
    mix(h, r->units.size());
    for (int64_t u : r->units) mix(h, static_cast<uint64_t>(u));
  }
}

void mix_dims(size_t& h, const Dims& d) {
  mix(h, static_cast<uint64_t>(d.size()));
  for (int64_t v : d) mix(h, static_cast<uint64_t>(v));
}

}  // namespace

std::string_view to_string(PlannerKind kind) { return kind == PlannerKind::kGreedy ? "greedy" : "search"; }

PlannerKind parse_planner(std::string_view text) {
  if (text == "greedy") return PlannerKind::kGreedy;
  if (text == "search") return PlannerKind::kSearch;
  throw InvalidArgument(fmt::format("unknown planner '{}': expected greedy or search", kernels::clip(text, 40)));
}

size_t TransitionHash::operator()(const Transition& t) const {
  size_t h = 0;
  mix_dims(h, t.mesh_shape);
  mix_dims(h, t.shape);
  mix(h, static_cast<uint64_t>(t.dtype));
  for (const PlacementList* ps : {&t.src, &t.dst}) {
    mix(h, ps->size());
    for (const Placement& p : *ps) mix_placement(h, p);
  }
  mix(h, static_cast<uint64_t>(t.planner));
  mix(h, std::bit_cast<uint64_t>(t.cost.latency_us));
  mix(h, std::bit_cast<uint64_t>(t.cost.bandwidth_gb_per_s));
  mix(h, static_cast<uint64_t>(t.allow_partial_target));
  for (const Dims& d : t.also_valid_for) mix_dims(h, d);
  mix(h, t.policy.reduce_dtype ? static_cast<uint64_t>(*t.policy.reduce_dtype) : ~0ull);
  mix(h, std::bit_cast<uint64_t>(t.policy.divide_factor));
  mix(h, static_cast<uint64_t>(t.policy.force_sum));
  mix(h, t.out_dtype ? static_cast<uint64_t>(*t.out_dtype) : ~0ull);
  return h;
}

Transition make_transition(const DTensorSpec& src, const Placements& dst, PlannerKind planner,
                           const ReducePolicy& policy, std::optional<DType> out_dtype, const CostModel& cost,
                           bool allow_partial_target, const std::vector<Dims>& also_valid_for) {
  const int mesh_ndim = src.mesh->ndim(), tensor_ndim = src.tensor_ndim();
  if (static_cast<int>(dst.size()) != mesh_ndim)
    throw InvalidArgument(fmt::format("{} placements ({}) for a {}-d mesh (expected {})", dst.size(), to_string(dst),
                                      mesh_ndim, mesh_ndim));
  Transition t;
  t.mesh_shape = src.mesh->shape();
  t.shape = src.shape;
  t.dtype = src.dtype;
  t.src.assign(src.placements.begin(), src.placements.end());
  std::optional<ReduceOp> partial_op;
  for (const Placement& p : dst) {
    t.dst.push_back(normalize(p, tensor_ndim));
    if (const auto* partial = std::get_if<Partial>(&p)) {
      // Mixed Partial ops are rejected, except sum with avg (docs/pytorch-semantics.md 2.5).
      auto linear = [](ReduceOp op) { return op == ReduceOp::kSum || op == ReduceOp::kAvg; };
      if (partial_op && *partial_op != partial->op && !(linear(*partial_op) && linear(partial->op)))
        throw InvalidArgument(fmt::format("placements {} mix Partial ops {} and {}: only sum and avg may be mixed",
                                          to_string(dst), kernels::to_string(*partial_op),
                                          kernels::to_string(partial->op)));
      partial_op = partial->op;
    }
  }
  for (const PlacementList* ps : {&t.src, &t.dst})
    for (const Placement& p : *ps)
      if (is_ragged(p))
        throw Unsupported(fmt::format("cannot redistribute [{}] -> [{}]: {} transitions are not planned yet",
                                      text(t.src), text(t.dst), to_string(p)));
  check_pair(t.src, t.dst, allow_partial_target);
  t.planner = planner;
  t.cost = cost;
  t.allow_partial_target = allow_partial_target;
  for (const Dims& d : also_valid_for)
    if (!(d == t.shape)) t.also_valid_for.push_back(d);
  std::sort(t.also_valid_for.begin(), t.also_valid_for.end(),
            [](const Dims& a, const Dims& b) { return std::lexicographical_compare(a.begin(), a.end(), b.begin(), b.end()); });
  t.also_valid_for.erase(std::unique(t.also_valid_for.begin(), t.also_valid_for.end()), t.also_valid_for.end());
  t.policy = policy;
  t.out_dtype = out_dtype;
  return t;
}

std::string to_string(const Transition& t) {
  return fmt::format("[{}] -> [{}] on mesh [{}], {} [{}]", text(t.src), text(t.dst), fmt::join(t.mesh_shape, ","),
                     kernels::to_string(t.dtype), fmt::join(t.shape, ","));
}

}  // namespace dtensor
