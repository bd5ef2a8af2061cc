#include "dtensor/plan/planner.h"

#include <boost/container_hash/hash.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <optional>
#include <queue>
#include <unordered_map>

#include "kernels/error.h"
#include "kernels/overloaded.h"

namespace dtensor {

using kernels::Unsupported;

namespace {

bool shards_within(const Placements& placements, int tensor_ndim) {
  for (const Placement& p : placements)
    if (auto d = shard_dim(p); d && *d >= tensor_ndim) return false;
  return true;
}

bool is_shard_like(const Placement& p) { return shard_dim(p).has_value(); }

// PyTorch 2.15's one way into a new Partial: a plain Shard becoming P(sum) (a local zero-fill).
bool shard_to_partial_sum(const Placement& from, const Placement& to) {
  return is_shard(from) && to == Placement{Partial{ReduceOp::kSum}};
}

// One planning call: the shapes the plan must serve, step validity and costs, and the work
// budget they all draw from (NOTE [planning cost]).
class Context {
 public:
  Context(const Transition& t, const StepOracle& oracle)
      : t_(t), oracle_(oracle), work_(kMaxPlanWork, [this] { return fmt::format("planning {}", to_string(t_)); }) {
    // The extra shapes may have another ndim (a batch of weights and biases moving with one
    // plan): a state that shards a dim a shape lacks is simply not valid for it.
    shapes_.push_back(t.shape);
    for (const Dims& s : t.also_valid_for) shapes_.push_back(s);
  }

  // The transition's wire dtype on a reducing step of a group of k > 1 (NOTE [wire dtype] in
  // dtensor/exec/executor.h), when it is narrower than the reduce dtype (make_transition checked).
  Step with_wire(Step step) const {
    const std::optional<DType>& wire = t_.policy.wire_dtype;
    if (!wire || *wire == t_.policy.reduce_dtype.value_or(t_.dtype) || t_.mesh_shape[mesh_dim_of(step)] == 1)
      return step;
    if (auto* a = std::get_if<AllReduce>(&step)) a->wire = wire;
    if (auto* r = std::get_if<ReduceScatter>(&step)) r->wire = wire;
    return step;
  }

  bool valid(const Step& step, const Placements& before) {
    // apply_step changes only the step's mesh dim.
    const std::optional<int> d = shard_dim(placement_after(step));
    for (const Dims& s : shapes_)
      if (!shards_within(before, s.size()) || (d && *d >= s.size())) return false;
    for (const Dims& s : shapes_)
      if (!oracle_.valid(step, before, s, t_.mesh_shape, work_)) return false;
    return true;
  }
  Traffic traffic(const Step& step, const Placements& before) {
    return oracle_.step(step, before, t_.shape, t_.mesh_shape, t_.dtype, work_);
  }
  bool moves(const Step& step) const { return communicates(step) && t_.mesh_shape[mesh_dim_of(step)] > 1; }
  double cost(const Step& step, const Placements& before) {
    if (!moves(step)) return 1e-9;  // prefer fewer steps
    return t_.cost.latency_us + static_cast<double>(traffic(step, before).max_received()) / (t_.cost.bandwidth_gb_per_s * 1e3);
  }
  const Transition& transition() const { return t_; }
  const StepOracle& oracle() const { return oracle_; }
  const std::vector<Dims>& shapes() const { return shapes_; }
  WorkBudget& work() { return work_; }

 private:
  const Transition& t_;
  const StepOracle& oracle_;
  WorkBudget work_;
  std::vector<Dims> shapes_;
};

class Builder {
 public:
  Builder(Context& ctx, PlannerKind kind) : ctx_(ctx) {
    plan_.src = ctx.transition().source();
    plan_.dst = ctx.transition().target();
    plan_.planner = kind;
    plan_.states.push_back(plan_.src);
  }

  const Placements& current() const { return plan_.states.back(); }

  void add(const Step& step) {
    if (!ctx_.valid(step, current()))
      throw kernels::InternalError(fmt::format("planner produced an invalid step {} from [{}]", to_string(step),
                                               to_string(current())));
    plan_.steps.push_back(step);
    plan_.states.push_back(apply_step(step, current()));
  }

  // One primitive when there is one, else through Replicate (PyTorch's fallback).
  void move(int m, const Placement& to) {
    const Placement from = current()[m];
    if (from == to) return;
    if (auto step = step_between(m, from, to, /*direct=*/false)) return add(ctx_.with_wire(*step));
    auto up = step_between(m, from, Replicate{}, false);
    auto down = step_between(m, Replicate{}, to, false);
    if (!up || !down)
      throw Unsupported(fmt::format("no route for mesh dim {}: {} -> {}", m, to_string(from), to_string(to)));
    add(ctx_.with_wire(*up));
    add(ctx_.with_wire(*down));
  }

  Plan finish() {
    if (current() != plan_.dst)
      throw kernels::InternalError(
          fmt::format("plan ends at [{}], not at [{}]", to_string(current()), to_string(plan_.dst)));
    const Transition& t = ctx_.transition();
    plan_.shapes = ctx_.shapes();
    plan_.plain = true;
    for (size_t i = 0; i < plan_.steps.size(); ++i) {
      const Step& step = plan_.steps[i];
      plan_.plain = plan_.plain && is_plain_step(step, plan_.states[i], t.mesh_shape);
      plan_.communicating.push_back(ctx_.moves(step));
      plan_.step_traffic.push_back(ctx_.moves(step) ? ctx_.traffic(step, plan_.states[i]) : Traffic{});
      if (ctx_.moves(step)) plan_.cost_us += ctx_.cost(step, plan_.states[i]);
    }
    plan_.traffic = ctx_.oracle().route(plan_.steps, plan_.states, t.shape, t.mesh_shape, t.dtype, ctx_.work());
    return std::move(plan_);
  }

 private:
  Context& ctx_;
  Plan plan_;
};

// PyTorch's greedy planner (docs/pytorch-semantics.md 4.2).
Plan greedy(Context& ctx) {
  Builder b(ctx, PlannerKind::kGreedy);
  const Transition& t = ctx.transition();
  const int ndim = t.mesh_shape.size();
  const Placements src = t.source(), dst = t.target();
  if (ndim == 1) {
    b.move(0, dst[0]);
    return b.finish();
  }
  int64_t num_shards = 1;
  for (int m = 0; m < ndim; ++m)
    if (is_shard_like(src[m])) num_shards *= t.mesh_shape[m];
  if (num_shards > 1) {
    for (int m = ndim - 1; m >= 0; --m) {  // inner -> outer
      Placement target = dst[m];
      if (std::optional<int> d = shard_dim(target)) {
        // Misaligned nesting: the earlier mesh dims must shard d the same way in cur and dst.
        bool aligned = true;
        for (int i = 0; i < m; ++i) {
          const bool in_cur = shard_dim(b.current()[i]) == d, in_dst = shard_dim(dst[i]) == d;
          if (in_cur != in_dst || (in_cur && b.current()[i] != dst[i])) aligned = false;
        }
        if (!aligned) target = Replicate{};
      }
      b.move(m, target);
    }
  }
  for (int m = 0; m < ndim; ++m) b.move(m, dst[m]);  // outer -> inner
  return b.finish();
}

// Placements as a hash key (RaggedShard by its dim and sizes; equality compares its units).
struct StateHash {
  size_t operator()(const Placements& ps) const {
    size_t h = ps.size();
    for (const Placement& p : ps) {
      boost::hash_combine(h, p.index());
      std::visit(kernels::Overloaded{
                     [&](const Shard& s) { boost::hash_combine(h, s.dim); },
                     [&](const StridedShard& s) {
                       boost::hash_combine(h, s.dim);
                       boost::hash_combine(h, s.split_factor);
                     },
                     [](const Replicate&) {},
                     [&](const Partial& s) { boost::hash_combine(h, static_cast<int>(s.op)); },
                     [&](const RaggedShard& s) {
                       boost::hash_combine(h, s.dim);
                       boost::hash_combine(h, s.units.size());
                       boost::hash_combine(h, s.align);
                     },
                 },
                 p);
    }
    return h;
  }
};

// Dijkstra over placement states; edges are the valid single steps (NOTE [step validity]), the
// ones PyTorch lacks included (Regroup, P -> _S). Every edge draws kEdgeWork units on the work
// budget besides what its validity and cost take, so a mesh of many dims (millions of states)
// fails in about a second instead of searching for minutes.
constexpr int64_t kEdgeWork = 16;
Plan search(Context& ctx) {
  const Transition& t = ctx.transition();
  const int ndim = t.mesh_shape.size();
  const Placements src = t.source(), dst = t.target();
  std::vector<std::vector<Placement>> candidates(ndim);
  for (int m = 0; m < ndim; ++m) {
    auto add = [&](const Placement& p) {
      if (std::find(candidates[m].begin(), candidates[m].end(), p) == candidates[m].end()) candidates[m].push_back(p);
    };
    add(Replicate{});
    add(src[m]);
    add(dst[m]);
    for (int d = 0; d < t.shape.size(); ++d) add(Shard{d});
    for (int i = 0; i < ndim; ++i)  // strided placements of src/dst may serve any mesh dim
      for (const Placement& p : {src[i], dst[i]})
        if (is_strided_shard(p)) add(p);
  }
  // A Partial state on mesh dim m: the target's, when the source had it, when new Partials are
  // allowed, or when a Shard source becomes P(sum).
  auto partial_allowed = [&](int m, const Placement& c) {
    return c == dst[m] && (c == src[m] || t.allow_partial_target || shard_to_partial_sum(src[m], c));
  };
  struct Entry {
    double cost;
    uint64_t order;
    size_t node;
    bool operator>(const Entry& o) const { return cost != o.cost ? cost > o.cost : order > o.order; }
  };
  struct Node {
    Placements state;
    double cost;
    size_t parent;
    std::optional<Step> via;
    bool done = false;
  };
  std::vector<Node> nodes;
  std::unordered_map<Placements, size_t, StateHash> index;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<>> queue;
  uint64_t order = 0;
  nodes.push_back({src, 0.0, 0, std::nullopt});
  index.emplace(src, 0);
  queue.push({0.0, order++, 0});
  std::optional<size_t> goal, goal_seen;  // settled; reached
  if (src == dst) goal_seen = 0;
  while (!queue.empty()) {
    const Entry e = queue.top();
    queue.pop();
    if (nodes[e.node].done) continue;
    nodes[e.node].done = true;
    if (nodes[e.node].state == dst) {
      goal = e.node;
      break;
    }
    ctx.work().add(1);
    const Placements state = nodes[e.node].state;
    for (int m = 0; m < ndim; ++m)
      for (const Placement& c : candidates[m]) {
        if (c == state[m]) continue;
        if (is_partial(c) && !partial_allowed(m, c)) continue;
        ctx.work().add(kEdgeWork);
        // Every step on mesh dim m to c leads to the same state; a state already settled never
        // takes a new parent, so its edges are not evaluated.
        Placements next = state;
        next[m] = c;
        const auto it = index.find(next);
        if (it != index.end() && nodes[it->second].done) continue;
        std::optional<Step> step = step_between(m, state[m], c, /*direct=*/true);
        const bool local_possible = shard_dim(state[m]) && !is_partial(c);
        // No cost below `least` (a moving step costs its latency and more): an edge that cannot
        // improve on the state's current cost, or reach it below the goal's, changes nothing.
        double least = step && ctx.moves(*step) ? t.cost.latency_us : 1e-9;
        if (local_possible) least = std::min(least, 1e-9);
        if (it != index.end() && e.cost + least >= nodes[it->second].cost) continue;
        if (goal_seen && e.cost + least >= nodes[*goal_seen].cost) continue;
        // A shard whose ranks already hold the new layout moves nothing: a local step.
        bool checked = false;
        if (local_possible && ctx.valid(LocalChunk{m, c}, state)) {
          step = LocalChunk{m, c};
          checked = true;
        }
        if (!step || (!checked && !ctx.valid(*step, state))) continue;
        step = ctx.with_wire(*step);
        if (mesh_dim_of(*step) != m || placement_after(*step) != c)
          throw kernels::InternalError(fmt::format("step {} from [{}] does not lead to [{}]", to_string(*step),
                                                   to_string(state), to_string(next)));
        const double total = e.cost + ctx.cost(*step, state);
        if (it == index.end()) {
          if (next == dst) goal_seen = nodes.size();
          index.emplace(next, nodes.size());
          queue.push({total, order++, nodes.size()});
          nodes.push_back({std::move(next), total, e.node, step});
        } else if (total < nodes[it->second].cost) {
          nodes[it->second] = {std::move(next), total, e.node, step};
          queue.push({total, order++, it->second});
        }
      }
  }
  if (!goal) throw Unsupported(fmt::format("no route from [{}] to [{}]", to_string(src), to_string(dst)));
  std::vector<Step> steps;
  for (size_t n = *goal; n != 0; n = nodes[n].parent) steps.push_back(*nodes[n].via);
  std::reverse(steps.begin(), steps.end());
  Builder b(ctx, PlannerKind::kSearch);
  for (const Step& s : steps) b.add(s);
  return b.finish();
}

}  // namespace

int Plan::collectives() const { return static_cast<int>(std::count(communicating.begin(), communicating.end(), 1)); }

bool Plan::valid_for(const Dims& global_shape) const {
  if (on_view()) return global_shape == tensor_shape;
  return plain || std::find(shapes.begin(), shapes.end(), global_shape) != shapes.end();
}

std::string to_string(const Plan& plan) {
  std::string out;
  if (plan.on_view() && plan.user_src != plan.states.front()) out = fmt::format("[{}] as ", to_string(plan.user_src));
  out += fmt::format("[{}]", to_string(plan.states.front()));
  for (size_t i = 0; i < plan.steps.size(); ++i)
    out += fmt::format(" -{}-> [{}]", to_string(plan.steps[i]), to_string(plan.states[i + 1]));
  if (plan.on_view() && plan.user_dst != plan.states.back()) out += fmt::format(" as [{}]", to_string(plan.user_dst));
  return out;
}

class Algebra final : public StepOracle {
 public:
  bool valid(const Step& step, const Placements& before, const Dims& shape, const Dims& mesh_shape,
             WorkBudget& work) const override {
    return is_valid_step(step, before, shape, mesh_shape, work);
  }
  Traffic step(const Step& step, const Placements& before, const Dims& shape, const Dims& mesh_shape, DType dtype,
               WorkBudget& work) const override {
    return step_traffic(step, before, shape, mesh_shape, dtype, work);
  }
  Traffic route(std::span<const Step> steps, std::span<const Placements> states, const Dims& shape,
                const Dims& mesh_shape, DType dtype, WorkBudget& work) const override {
    return route_traffic(steps, states, shape, mesh_shape, dtype, work);
  }
};

Plan plan_transition(const Transition& t) { return plan_transition(t, Algebra{}); }

Plan plan_transition(const Transition& t, const StepOracle& oracle) {
  Context ctx(t, oracle);
  if (!t.tensor_shape.empty()) {
    // NOTE [ragged plans]: each changed mesh dim moves by its one direct step, for either
    // planner; with several (HSDP: P -> R beside the ragged dim), the cheapest order.
    std::vector<int> changed;
    for (int m = 0; m < t.mesh_shape.size(); ++m)
      if (t.src[m] != t.dst[m]) changed.push_back(m);
    std::optional<Plan> best;
    do {
      Builder b(ctx, t.planner);
      bool ok = true;
      for (int m : changed) {
        std::optional<Step> step = step_between(m, b.current()[m], t.dst[m], /*direct=*/true);
        if (!step || !ctx.valid(ctx.with_wire(*step), b.current())) {
          ok = false;
          break;
        }
        b.add(ctx.with_wire(*step));
      }
      if (!ok) continue;
      Plan q = b.finish();
      if (!best || q.cost_us < best->cost_us) best = std::move(q);
    } while (std::next_permutation(changed.begin(), changed.end()));
    if (!best) throw Unsupported(fmt::format("no route for {}", to_string(t)));
    Plan p = std::move(*best);
    p.tensor_shape = t.tensor_shape;
    p.user_src = {t.user_src.begin(), t.user_src.end()};
    p.user_dst = {t.user_dst.begin(), t.user_dst.end()};
    return p;
  }
  // The search's graph holds greedy's route, so it never costs more (checked against an
  // independent brute force in tests/dtensor/plan_bruteforce_test.cpp; no cost fallback hides a
  // miss).
  return t.planner == PlannerKind::kGreedy ? greedy(ctx) : search(ctx);
}

Plan plan_redistribute(const DTensorSpec& src, const Placements& dst, PlannerKind kind, const CostModel& cost,
                       bool allow_partial_target, const std::vector<Dims>& also_valid_for) {
  return plan_transition(make_transition(src, dst, kind, {}, std::nullopt, cost, allow_partial_target, also_valid_for));
}

}  // namespace dtensor
