#include "dtensor/plan/planner.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <functional>
#include <optional>
#include <queue>
#include <unordered_map>

#include "kernels/checked.h"
#include "kernels/error.h"

namespace dtensor {

using kernels::InvalidArgument;
using kernels::Unsupported;

namespace {

int64_t numel(const ShardLayout& l) { return l.local_shape.product(); }

__extension__ typedef __int128 Wide;  // __extension__: no -Wpedantic warning

// A byte count computed in 128 bits (so 2(k-1)N/k rounds exactly as in 64 bits when that does
// not overflow), narrowed with a check: an InvalidArgument naming the value, never a wrap.
int64_t to_bytes(Wide v, const DTensorSpec& spec) {
  if (v > kernels::kInt64Max || v < 0)
    throw InvalidArgument(fmt::format("the traffic of a redistribute of shape [{}] ({}) overflows int64 bytes",
                                      fmt::join(spec.shape, ","), kernels::to_string(spec.dtype)));
  return static_cast<int64_t>(v);
}

std::vector<ShardLayout> all_layouts(const DTensorSpec& spec, const Placements& placements) {
  return mesh_layouts(spec.shape, spec.mesh->shape(), placements);
}

// Every rank's layout per placement state for one global shape, computed once per planning call.
// It also counts the planning work (rank layouts computed, rank pairs compared by traffic_of)
// for the search budget.
class LayoutCache {
 public:
  LayoutCache(Dims shape, Dims mesh_shape) : shape_(std::move(shape)), mesh_shape_(std::move(mesh_shape)) {}
  const std::vector<ShardLayout>& get(const Placements& placements) {
    auto [it, inserted] = by_state_.try_emplace(to_string(placements));
    if (inserted) {
      it->second = mesh_layouts(shape_, mesh_shape_, placements);
      work_ += static_cast<int64_t>(it->second.size()) * static_cast<int64_t>(mesh_shape_.size());
    }
    return it->second;
  }
  void add_work(int64_t units) { work_ += units; }
  int64_t work() const { return work_; }

 private:
  Dims shape_, mesh_shape_;
  std::unordered_map<std::string, std::vector<ShardLayout>> by_state_;
  int64_t work_ = 0;
};

// NOTE [step validity] for every shape a plan must serve; the first is the spec's own (its
// layouts also serve the traffic and cost computations).
bool shards_within(const Placements& placements, int tensor_ndim) {
  for (const Placement& p : placements)
    if (auto d = shard_dim(p); d && *d >= tensor_ndim) return false;
  return true;
}

class Validity {
 public:
  // The extra shapes may have another ndim (a batch of weights and biases moving with one plan):
  // a state that shards a dim a shape lacks is simply not valid for it.
  Validity(const DTensorSpec& spec, const std::vector<Dims>& also_valid_for) : mesh_shape_(spec.mesh->shape()) {
    shapes_.push_back(spec.shape);
    for (const Dims& s : also_valid_for)
      if (std::find(shapes_.begin(), shapes_.end(), s) == shapes_.end()) shapes_.push_back(s);
    for (const Dims& s : shapes_) caches_.emplace_back(s, mesh_shape_);
  }

  bool valid(const Step& step, const Placements& before) {
    const Placements after = apply_step(step, before);
    for (const Dims& s : shapes_)
      if (!shards_within(before, s.size()) || !shards_within(after, s.size())) return false;
    if (is_plain_step(step, before, mesh_shape_)) return true;
    for (LayoutCache& c : caches_)
      if (!is_valid_step(step, before, c.get(before), c.get(after), mesh_shape_)) return false;
    return true;
  }
  LayoutCache& layouts() { return caches_.front(); }
  int64_t work() const {
    int64_t w = 0;
    for (const LayoutCache& c : caches_) w += c.work();
    return w;
  }
  const std::vector<Dims>& shapes() const { return shapes_; }

 private:
  Dims mesh_shape_;
  std::vector<Dims> shapes_;
  std::vector<LayoutCache> caches_;
};

Traffic traffic_of(const Step& step, const DTensorSpec& spec, const Placements& before, LayoutCache& layouts);

bool is_shard_like(const Placement& p) { return shard_dim(p).has_value(); }

// PyTorch 2.15's one way into a new Partial: a plain Shard becoming P(sum) (a local zero-fill).
bool shard_to_partial_sum(const Placement& from, const Placement& to) {
  return is_shard(from) && to == Placement{Partial{ReduceOp::kSum}};
}

void check_transition(const DTensorSpec& src, const Placements& dst, bool allow_partial_target) {
  for (size_t m = 0; m < dst.size(); ++m) {
    const auto* to = std::get_if<Partial>(&dst[m]);
    if (!to || src.placements[m] == dst[m]) continue;
    const std::string what = fmt::format("cannot redistribute [{}] -> [{}] on mesh dim {}",
                                         to_string(src.placements), to_string(dst), m);
    if (is_partial(src.placements[m]))
      throw Unsupported(fmt::format("{}: {} -> {} changes the reduce op (a Partial keeps its op)",
                                    what, to_string(src.placements[m]), to_string(dst[m])));
    if (shard_to_partial_sum(src.placements[m], dst[m])) continue;
    if (is_shard_like(src.placements[m]))
      throw Unsupported(fmt::format(
          "{}: {} -> {} is not supported (only a Shard becomes Partial, and only P(sum), as in "
          "PyTorch 2.15)",
          what, to_string(src.placements[m]), to_string(dst[m])));
    if (!allow_partial_target)
      throw Unsupported(fmt::format(
          "{}: Replicate -> {} would create a new Partial (only a source's own Partial may stay "
          "Partial)",
          what, to_string(dst[m])));
  }
}

class Builder {
 public:
  Builder(const DTensorSpec& spec, const Placements& dst, PlannerKind kind, const CostModel& cost,
          Validity& validity)
      : spec_(spec), cost_(cost), validity_(validity) {
    plan_.src = spec.placements;
    plan_.dst = dst;
    plan_.planner = kind;
    plan_.states.push_back(spec.placements);
  }

  const Placements& current() const { return plan_.states.back(); }

  void add(const Step& step) {
    if (!validity_.valid(step, current()))
      throw kernels::InternalError(fmt::format("planner produced an invalid step {} from [{}]",
                                               to_string(step), to_string(current())));
    plan_.steps.push_back(step);
    plan_.states.push_back(apply_step(step, current()));
  }

  // One primitive when there is one, else through Replicate (PyTorch's fallback).
  void move(int m, const Placement& to) {
    const Placement from = current()[m];
    if (from == to) return;
    if (auto step = step_between(m, from, to, /*direct=*/false)) return add(*step);
    auto up = step_between(m, from, Replicate{}, false);
    auto down = step_between(m, Replicate{}, to, false);
    if (!up || !down)
      throw Unsupported(fmt::format("no route for mesh dim {}: {} -> {}", m, to_string(from),
                                    to_string(to)));
    add(*up);
    add(*down);
  }

  Plan finish(const Placements& dst);

 private:
  const DTensorSpec& spec_;
  const CostModel& cost_;
  Validity& validity_;
  Plan plan_;
};

double step_cost(const Step& step, const DTensorSpec& spec, const Placements& before,
                 const CostModel& cost, LayoutCache& layouts) {
  if (!communicates(step) || spec.mesh->size(mesh_dim_of(step)) == 1) return 1e-9;  // prefer fewer steps
  const Traffic t = traffic_of(step, spec, before, layouts);
  return cost.latency_us + static_cast<double>(t.max_received()) / (cost.bandwidth_gb_per_s * 1e3);
}

Plan Builder::finish(const Placements& dst) {
  if (current() != dst)
    throw kernels::InternalError(fmt::format("plan ends at [{}], not at [{}]",
                                             to_string(current()), to_string(dst)));
  const int64_t n = spec_.mesh->size();
  LayoutCache& layouts = validity_.layouts();
  plan_.traffic.sent.assign(n, 0);
  plan_.traffic.received.assign(n, 0);
  plan_.shapes = validity_.shapes();
  plan_.plain = true;
  for (size_t i = 0; i < plan_.steps.size(); ++i) {
    const Step& step = plan_.steps[i];
    plan_.plain = plan_.plain && is_plain_step(step, plan_.states[i], spec_.mesh->shape());
    const bool moves = communicates(step) && spec_.mesh->size(mesh_dim_of(step)) > 1;
    plan_.communicating.push_back(moves);
    if (!moves) continue;
    const Traffic t = traffic_of(step, spec_, plan_.states[i], layouts);
    for (int64_t p = 0; p < n; ++p) {
      plan_.traffic.sent[p] = to_bytes(Wide{plan_.traffic.sent[p]} + t.sent[p], spec_);
      plan_.traffic.received[p] = to_bytes(Wide{plan_.traffic.received[p]} + t.received[p], spec_);
    }
    plan_.cost_us += step_cost(step, spec_, plan_.states[i], cost_, layouts);
  }
  return std::move(plan_);
}

// PyTorch's greedy planner (docs/pytorch-semantics.md 4.2).
Plan greedy(const DTensorSpec& spec, const Placements& dst, const CostModel& cost, Validity& validity) {
  Builder b(spec, dst, PlannerKind::kGreedy, cost, validity);
  const int ndim = spec.mesh->ndim();
  const Placements& src = spec.placements;
  if (ndim == 1) {
    b.move(0, dst[0]);
    return b.finish(dst);
  }
  int64_t num_shards = 1;
  for (int m = 0; m < ndim; ++m)
    if (is_shard_like(src[m])) num_shards *= spec.mesh->size(m);
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
  return b.finish(dst);
}

// Dijkstra over placement states; edges are the single steps valid by layouts (NOTE [step
// validity]), the ones PyTorch lacks included (Regroup, P -> _S). Gives up (nullopt) once the
// planning work exceeds kMaxSearchWork (meshes of many dims: millions of states).
std::optional<Plan> search(const DTensorSpec& spec, const Placements& dst, const CostModel& cost,
            bool allow_partial_target, Validity& validity) {
  const int ndim = spec.mesh->ndim();
  const Placements& src = spec.placements;
  std::vector<std::vector<Placement>> candidates(ndim);
  for (int m = 0; m < ndim; ++m) {
    auto add = [&](const Placement& p) {
      if (std::find(candidates[m].begin(), candidates[m].end(), p) == candidates[m].end())
        candidates[m].push_back(p);
    };
    add(Replicate{});
    add(src[m]);
    add(dst[m]);
    for (int t = 0; t < spec.tensor_ndim(); ++t) add(Shard{t});
    for (int i = 0; i < ndim; ++i)  // strided placements of src/dst may serve any mesh dim
      for (const Placement& p : {src[i], dst[i]})
        if (is_strided_shard(p)) add(p);
  }
  // A Partial state on mesh dim m: the target's, when the source had it, when new Partials are
  // allowed, or when a Shard source becomes P(sum).
  auto partial_allowed = [&](int m, const Placement& c) {
    return c == dst[m] && (c == src[m] || allow_partial_target || shard_to_partial_sum(src[m], c));
  };
  struct Entry {
    double cost;
    uint64_t order;
    std::string key;
    bool operator>(const Entry& o) const { return cost != o.cost ? cost > o.cost : order > o.order; }
  };
  struct Node {
    Placements state;
    double cost;
    std::string parent;
    std::optional<Step> via;
  };
  std::unordered_map<std::string, Node> nodes;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<>> queue;
  uint64_t order = 0;
  const std::string start = to_string(src), goal = to_string(dst);
  nodes[start] = {src, 0.0, "", std::nullopt};
  queue.push({0.0, order++, start});
  std::unordered_map<std::string, bool> done;
  while (!queue.empty()) {
    Entry e = queue.top();
    queue.pop();
    if (done[e.key]) continue;
    done[e.key] = true;
    if (e.key == goal) break;
    if (validity.work() > kMaxSearchWork) return std::nullopt;
    const Placements state = nodes[e.key].state;
    for (int m = 0; m < ndim; ++m)
      for (const Placement& c : candidates[m]) {
        if (c == state[m]) continue;
        if (is_partial(c) && !partial_allowed(m, c)) continue;
        std::optional<Step> step = step_between(m, state[m], c, /*direct=*/true);
        // A shard whose ranks already hold the new layout moves nothing: a local step.
        if (shard_dim(state[m]) && !is_partial(c) && validity.valid(LocalChunk{m, c}, state)) step = LocalChunk{m, c};
        if (!step || !validity.valid(*step, state)) continue;
        Placements next = apply_step(*step, state);
        const double total = e.cost + step_cost(*step, spec, state, cost, validity.layouts());
        const std::string key = to_string(next);
        auto it = nodes.find(key);
        if (it == nodes.end() || total < it->second.cost) {
          nodes[key] = {next, total, e.key, step};
          queue.push({total, order++, key});
        }
      }
  }
  if (!nodes.count(goal))
    throw Unsupported(fmt::format("no route from [{}] to [{}]", to_string(src), to_string(dst)));
  std::vector<Step> steps;
  for (std::string key = goal; key != start; key = nodes[key].parent) steps.push_back(*nodes[key].via);
  std::reverse(steps.begin(), steps.end());
  Builder b(spec, dst, PlannerKind::kSearch, cost, validity);
  for (const Step& s : steps) b.add(s);
  return b.finish(dst);
}

}  // namespace

std::string_view to_string(PlannerKind kind) {
  return kind == PlannerKind::kGreedy ? "greedy" : "search";
}

PlannerKind parse_planner(std::string_view text) {
  if (text == "greedy") return PlannerKind::kGreedy;
  if (text == "search") return PlannerKind::kSearch;
  throw InvalidArgument(fmt::format("unknown planner '{}': expected greedy or search", text));
}

int64_t Traffic::max_sent() const {
  return sent.empty() ? 0 : *std::max_element(sent.begin(), sent.end());
}
int64_t Traffic::max_received() const {
  return received.empty() ? 0 : *std::max_element(received.begin(), received.end());
}

int Plan::collectives() const {
  return static_cast<int>(std::count(communicating.begin(), communicating.end(), 1));
}

bool Plan::valid_for(const Dims& global_shape) const {
  return plain || std::find(shapes.begin(), shapes.end(), global_shape) != shapes.end();
}

std::string to_string(const Plan& plan) {
  std::string out = fmt::format("[{}]", to_string(plan.states.front()));
  for (size_t i = 0; i < plan.steps.size(); ++i)
    out += fmt::format(" -{}-> [{}]", to_string(plan.steps[i]), to_string(plan.states[i + 1]));
  return out;
}

Traffic step_traffic(const Step& step, const DTensorSpec& spec, const Placements& before) {
  LayoutCache layouts(spec.shape, spec.mesh->shape());
  return traffic_of(step, spec, before, layouts);
}

namespace {

Traffic traffic_of(const Step& step, const DTensorSpec& spec, const Placements& before, LayoutCache& layouts) {
  const DeviceMesh& mesh = *spec.mesh;
  const int64_t n = mesh.size();
  const int m = mesh_dim_of(step);
  const int64_t k = mesh.size(m);
  const int64_t item = static_cast<int64_t>(kernels::itemsize(spec.dtype));
  Traffic t;
  t.sent.assign(n, 0);
  t.received.assign(n, 0);
  if (!communicates(step) || k == 1) return t;
  layouts.add_work(n * k);
  const std::vector<ShardLayout>& pre = layouts.get(before);
  const std::vector<ShardLayout>& post = layouts.get(apply_step(step, before));
  for (int64_t p = 0; p < n; ++p) {
    Dims coord = unravel_index(p, mesh.shape());
    const int64_t r = coord[m];
    if (std::holds_alternative<AllReduce>(step)) {
      // The busiest member of a bandwidth-optimal all-reduce: 2(k-1)N/k, rounded up (a ring
      // reduce-scatter + all-gather over a balanced split of the N elements whose larger and
      // smaller pieces alternate around the ring reaches it exactly).
      const int64_t N = numel(pre[p]);
      t.sent[p] = t.received[p] = to_bytes((Wide{2} * (k - 1) * N + k - 1) / k * item, spec);
      continue;
    }
    if (std::holds_alternative<ReduceScatter>(step)) {
      t.sent[p] = to_bytes(Wide{numel(pre[p]) - numel(post[p])} * item, spec);
      t.received[p] = to_bytes(Wide{k - 1} * numel(post[p]) * item, spec);
      continue;
    }
    Wide sent = 0, received = 0;
    for (int64_t g = 0; g < k; ++g) {
      if (g == r) continue;
      coord[m] = g;
      const int64_t q = ravel_index(coord, mesh.shape());
      sent += Wide{common_elements(pre[p], post[q])} * item;
      received += Wide{common_elements(pre[q], post[p])} * item;
    }
    t.sent[p] = to_bytes(sent, spec);
    t.received[p] = to_bytes(received, spec);
  }
  return t;
}

}  // namespace

Traffic lower_bound_traffic(const DTensorSpec& src, const Placements& dst_in) {
  const DeviceMesh& mesh = *src.mesh;
  const int64_t n = mesh.size();
  const int64_t item = static_cast<int64_t>(kernels::itemsize(src.dtype));
  const Placements& from = src.placements;
  // What must be held after: a new Partial (a zero-fill) needs nothing beyond its source.
  Placements dst = normalize_placements(dst_in, mesh.ndim(), src.tensor_ndim());
  int64_t contributions = 1, classes = 1;
  for (int m = 0; m < mesh.ndim(); ++m) {
    if (is_partial(dst[m]) && !is_partial(from[m])) dst[m] = from[m];
    if (!is_partial(from[m]) || mesh.size(m) == 1) continue;
    if (from[m] == dst[m]) classes *= mesh.size(m);  // a kept Partial: separate values
    else contributions *= mesh.size(m);              // reduced
  }
  Traffic t;
  t.sent.assign(n, 0);
  t.received.assign(n, 0);
  const std::vector<ShardLayout> pre = all_layouts(src, from);
  const std::vector<ShardLayout> post = all_layouts(src, dst);
  if (contributions == 1) {
    for (int64_t p = 0; p < n; ++p)
      t.received[p] = to_bytes(Wide{numel(post[p]) - common_elements(pre[p], post[p])} * item, src);
    return t;
  }
  Wide held_after = 0;
  for (int64_t p = 0; p < n; ++p) held_after += numel(post[p]);
  const Wide total = Wide{src.shape.product()} * (contributions - 2) * classes + held_after;
  const Wide busiest = (total + n - 1) / n;
  for (int64_t p = 0; p < n; ++p) t.received[p] = to_bytes(std::max(busiest, Wide{numel(post[p])}) * item, src);
  return t;
}

Plan plan_redistribute(const DTensorSpec& src, const Placements& dst_in, PlannerKind kind,
                       const CostModel& cost, bool allow_partial_target,
                       const std::vector<Dims>& also_valid_for) {
  const Placements dst = normalize_placements(dst_in, src.mesh->ndim(), src.tensor_ndim());
  check_transition(src, dst, allow_partial_target);
  int64_t largest_group = 1;
  for (int m = 0; m < src.mesh->ndim(); ++m) largest_group = std::max(largest_group, src.mesh->size(m));
  if (src.mesh->size() * largest_group > kMaxPlanRankPairs)
    throw Unsupported(fmt::format(
        "cannot plan on mesh shape [{}]: {} ranks x a group of {} exceeds the planner's limit of {} rank pairs "
        "(its traffic model compares each rank with every member of its group)",
        fmt::join(src.mesh->shape(), ","), src.mesh->size(), largest_group, kMaxPlanRankPairs));
  Validity validity(src, also_valid_for);
  // The search's graph holds greedy's route, so it never costs more (checked against an
  // independent brute force in tests/dtensor/plan_bruteforce_test.cpp; no cost fallback hides a
  // miss). Only a search over its work budget returns greedy's route instead.
  if (kind == PlannerKind::kGreedy) return greedy(src, dst, cost, validity);
  if (std::optional<Plan> s = search(src, dst, cost, allow_partial_target, validity)) return std::move(*s);
  Plan g = greedy(src, dst, cost, validity);  // the layouts the search computed serve it too
  g.planner = PlannerKind::kSearch;
  return g;
}

const Plan& PlanCache::get(const DTensorSpec& src, const Placements& dst, PlannerKind kind,
                           const CostModel& cost, bool allow_partial_target,
                           const std::vector<Dims>& also_valid_for) {
  std::vector<std::vector<int64_t>> more;
  for (const Dims& d : also_valid_for) more.push_back(d.vec());
  std::sort(more.begin(), more.end());
  more.erase(std::unique(more.begin(), more.end()), more.end());
  Key key{src.mesh->shape().vec(), src.shape.vec(), static_cast<int>(src.dtype),
          to_string(src.placements),
          to_string(normalize_placements(dst, src.mesh->ndim(), src.tensor_ndim())),
          static_cast<int>(kind), allow_partial_target, cost.latency_us, cost.bandwidth_gb_per_s,
          std::move(more)};
  std::lock_guard lk(mu_);
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second;
  return plans_.emplace(key, plan_redistribute(src, dst, kind, cost, allow_partial_target, also_valid_for))
      .first->second;
}

size_t PlanCache::size() const {
  std::lock_guard lk(mu_);
  return plans_.size();
}

}  // namespace dtensor
