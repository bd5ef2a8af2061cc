#include "dtensor/plan/transition.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <bit>

#include "dtensor/layout.h"
#include "kernels/checked.h"
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
    if (is_ragged(src[m]))
      throw Unsupported(fmt::format("{}: {} -> {} is not supported (a RaggedShard never becomes Partial)", what,
                                    to_string(src[m]), to_string(dst[m])));
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

// NOTE [wire dtype] in dtensor/exec/executor.h: the wire must be a floating dtype no wider than
// the reduce dtype, and the reductions it carries linear (a local sum of the wire values).
void check_wire(const DTensorSpec& src, const ReducePolicy& policy) {
  if (!policy.wire_dtype) return;
  const DType wire = *policy.wire_dtype, red = policy.reduce_dtype.value_or(src.dtype);
  const std::string what = fmt::format("wire dtype {} with reduce dtype {}", kernels::to_string(wire),
                                       kernels::to_string(red));
  if (!kernels::is_floating_point(wire) || !kernels::is_floating_point(red))
    throw InvalidArgument(fmt::format("{}: both must be floating point (expected e.g. wire bf16 or f8e5m2 with reduce f32)", what));
  if (wire == red) return;
  if (kernels::itemsize(wire) >= kernels::itemsize(red))
    throw InvalidArgument(fmt::format("{}: the wire must be narrower than the reduce dtype (or the same dtype)", what));
  for (const Placement& p : src.placements)
    if (const auto* q = std::get_if<Partial>(&p); q && q->op != ReduceOp::kSum && q->op != ReduceOp::kAvg)
      throw InvalidArgument(fmt::format("{}: a narrower wire carries sum and avg reductions only, not {} ({})", what,
                                        kernels::to_string(q->op), to_string(src.placements)));
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
  mix_dims(h, t.tensor_shape);
  for (const PlacementList* ps : {&t.user_src, &t.user_dst}) {
    mix(h, ps->size());
    for (const Placement& p : *ps) mix_placement(h, p);
  }
  mix(h, t.policy.reduce_dtype ? static_cast<uint64_t>(*t.policy.reduce_dtype) : ~0ull);
  mix(h, std::bit_cast<uint64_t>(t.policy.divide_factor));
  mix(h, static_cast<uint64_t>(t.policy.force_sum));
  mix(h, t.policy.wire_dtype ? static_cast<uint64_t>(*t.policy.wire_dtype) : ~0ull);
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
  check_pair(t.src, t.dst, allow_partial_target);
  if (auto mapped = map_ragged_transition(t.mesh_shape, t.shape, t.source(), t.target())) {
    if (!also_valid_for.empty())
      throw Unsupported(fmt::format("cannot redistribute [{}] -> [{}] for several shapes at once: RaggedShard plans "
                                    "are made per shape (NOTE [ragged plans])",
                                    text(t.src), text(t.dst)));
    t.tensor_shape = t.shape;
    t.user_src = t.src;
    t.user_dst = t.dst;
    t.shape = mapped->view;
    t.src.assign(mapped->src.begin(), mapped->src.end());
    t.dst.assign(mapped->dst.begin(), mapped->dst.end());
  }
  check_wire(src, policy);
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
  if (!t.tensor_shape.empty())
    return fmt::format("[{}] -> [{}] on mesh [{}], {} [{}] (view [{}])", text(t.user_src), text(t.user_dst),
                       fmt::join(t.mesh_shape, ","), kernels::to_string(t.dtype), fmt::join(t.tensor_shape, ","),
                       fmt::join(t.shape, ","));
  return fmt::format("[{}] -> [{}] on mesh [{}], {} [{}]", text(t.src), text(t.dst), fmt::join(t.mesh_shape, ","),
                     kernels::to_string(t.dtype), fmt::join(t.shape, ","));
}

std::optional<RaggedMapping> map_ragged_transition(const Dims& mesh_shape, const Dims& shape, const Placements& src,
                                                   const Placements& dst) {
  const int rs = ragged_mesh_dim(src), rd = ragged_mesh_dim(dst);
  if (rs < 0 && rd < 0) return std::nullopt;
  const std::string what = fmt::format("cannot redistribute [{}] -> [{}]", to_string(src), to_string(dst));
  const int d = rs >= 0 ? *ragged_dim(src[rs]) : *ragged_dim(dst[rd]);
  if (rs >= 0 && rd >= 0 && *ragged_dim(dst[rd]) != d)
    throw Unsupported(fmt::format("{}: the RaggedShards flatten from different dims ({} and {}; expected the same)",
                                  what, d, *ragged_dim(dst[rd])));
  if (rs >= 0 && rd >= 0 && rs != rd)
    throw Unsupported(fmt::format("{}: the RaggedShards sit on different mesh dims ({} and {}; expected the same)",
                                  what, rs, rd));
  // m: the ragged mesh dim. Besides it, a mesh dim may only go P -> R (an all-reduce: HSDP's
  // replicate dim) or stay as it is.
  const int m = rs >= 0 ? rs : rd;
  std::vector<int> changed;
  bool others_ok = true;
  for (size_t q = 0; q < src.size(); ++q) {
    if (src[q] == dst[q]) continue;
    changed.push_back(static_cast<int>(q));
    if (static_cast<int>(q) != m && !(is_partial(src[q]) && is_replicate(dst[q]))) others_ok = false;
  }
  if (!others_ok)
    throw Unsupported(fmt::format("{}: a RaggedShard transition changes one mesh dim at a time (here {}), besides "
                                  "all-reducing others (P -> R)",
                                  what, fmt::join(changed, ", ")));
  for (int q = 0; q < static_cast<int>(src.size()); ++q) {
    if (q == m) continue;
    const std::optional<int> t = shard_dim(src[q]);
    if ((t && *t >= d && mesh_shape[q] > 1) || is_ragged(src[q]) || is_ragged(dst[q]))
      throw Unsupported(fmt::format("{}: {} on mesh dim {} also splits the flattened dims {}.. (ragged transitions "
                                    "take R, P or S/_S of dims < {} on the other mesh dims)",
                                    what, to_string(src[q]), q, d, d));
  }
  // The placement at m on the view: R, P, Rg(d), and S(d) as the ragged ranges of its rows.
  const int64_t k = mesh_shape[m];
  auto on_view = [&](const Placement& p, bool target) -> Placement {
    if (is_replicate(p) || is_ragged(p)) return p;
    if (is_partial(p) && !target) return p;
    if (const auto* s = std::get_if<Shard>(&p); s && s->dim == d) {
      int64_t inner = 1;
      for (int t = d + 1; t < shape.size(); ++t) inner = kernels::checked_mul(inner, shape[t], "a RaggedShard's row size");
      RaggedShard r{d, {}, std::max<int64_t>(inner, 1)};
      for (int64_t c = 0; c < k; ++c) r.units.push_back(shape[d] == 0 ? 1 : chunk(shape[d], k, c).size);
      return r;
    }
    throw Unsupported(fmt::format(
        "{}: {} -> {} on mesh dim {} is not a RaggedShard transition (expected R, P (source only), S({}) or Rg({}) "
        "on either side; NOTE [ragged plans])",
        what, to_string(src[m]), to_string(dst[m]), m, d, d));
  };
  for (const Placements* ps : {&src, &dst})
    if (const int r = ragged_mesh_dim(*ps); r >= 0 && static_cast<int64_t>(std::get<RaggedShard>((*ps)[r]).units.size()) != mesh_shape[r])
      throw kernels::InvalidArgument(fmt::format("{}: {} on mesh dim {} has {} units for {} ranks (expected one per rank)",
                                                 what, to_string((*ps)[r]), r,
                                                 std::get<RaggedShard>((*ps)[r]).units.size(), mesh_shape[r]));
  RaggedMapping out{ragged_view(shape, rs >= 0 ? src : dst), src, dst};
  out.src[m] = on_view(src[m], false);
  out.dst[m] = on_view(dst[m], true);
  return out;
}

}  // namespace dtensor
