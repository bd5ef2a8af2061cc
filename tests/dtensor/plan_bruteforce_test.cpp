// The planner against an independent brute force. The model below knows nothing of the planner's
// code (no Step, no step_between, no is_valid_step, no traffic_of): it holds every rank's element
// set under a placement list (tests/support/layout_model.h), decides whether one mesh dim may
// change from one placement to another by what the ranks hold, costs the change by the elements
// each rank receives, and runs its own shortest-path search over all placement lists. Then:
//  - every step of every plan (greedy and search) is valid in the model, and the plan's cost is
//    the model's cost of the same route;
//  - the search plan costs exactly the model's optimum, greedy never less (so "search never
//    costs more than greedy" is checked against an optimum computed independently: a missing
//    edge, a wrong validity rule or a wrong cost in the planner makes these fail);
//  - the planner's step validity equals the model's on every single-mesh-dim change;
//  - every valid step that is not a plain collective moves the right data on local ranks.
#include <catch2/catch.hpp>

#include <map>
#include <queue>
#include <random>
#include <set>

#include "support/checks.h"
#include "support/dtensor_data.h"
#include "support/layout_model.h"
#include "support/placement_lists.h"
#include "support/redistribute_check.h"

#include "collectives/local.h"
#include "dtensor/exec/executor.h"
#include "dtensor/plan/planner.h"

using namespace dtensor;
using testing_support::Indices;

namespace {

// ---- The model -------------------------------------------------------------------------------

// What a one-mesh-dim change does, decided by the placement kinds alone.
enum class Move { kNone, kExchange, kEmbed, kReduceScatter, kAllReduce, kLocal };

Move move_of(const Placement& from, const Placement& to) {
  if (from == to) return Move::kNone;
  const bool from_shard = shard_dim(from).has_value(), to_shard = shard_dim(to).has_value();
  if (from_shard && (to_shard || is_replicate(to))) return Move::kExchange;
  if (from_shard && is_partial(to))
    return is_shard(from) && std::get<Partial>(to).op == ReduceOp::kSum ? Move::kEmbed : Move::kNone;
  if (is_replicate(from)) return Move::kLocal;  // to S, _S or P
  if (is_partial(from)) {
    if (is_replicate(to)) return Move::kAllReduce;
    if (to_shard) return Move::kReduceScatter;
  }
  return Move::kNone;  // P(a) -> P(b)
}

bool subset(const Indices& a, const Indices& b) { return std::includes(b.begin(), b.end(), a.begin(), a.end()); }

int64_t overlap(const Indices& a, const Indices& b) {
  Indices out;
  std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(out));
  return static_cast<int64_t>(out.size());
}

class Model {
 public:
  Model(Dims shape, Dims mesh, int64_t itemsize) : shape_(std::move(shape)), mesh_(std::move(mesh)), item_(itemsize) {}

  const std::vector<Indices>& sets(const Placements& ps) {
    auto [it, inserted] = cache_.try_emplace(to_string(ps));
    if (inserted)
      for (int64_t p = 0; p < mesh_.product(); ++p)
        it->second.push_back(testing_support::model_elements(shape_, mesh_, ps, unravel_index(p, mesh_)));
    return it->second;
  }

  // The cost of changing mesh dim m of `before` to `to`, or nullopt when the ranks' groups along
  // m cannot produce the new layout from what they hold.
  std::optional<double> cost(const Placements& before, int m, const Placement& to, const CostModel& cm) {
    const std::string key = fmt::format("{}|{}|{}|{}|{}", to_string(before), m, to_string(to), cm.latency_us,
                                        cm.bandwidth_gb_per_s);
    auto it = edges_.find(key);
    if (it == edges_.end()) it = edges_.emplace(key, compute(before, m, to, cm)).first;
    return it->second;
  }

  const Dims& mesh() const { return mesh_; }

 private:
  std::optional<double> compute(const Placements& before, int m, const Placement& to, const CostModel& cm) {
    const Move move = move_of(before[m], to);
    if (move == Move::kNone) return std::nullopt;
    Placements after = before;
    after[m] = to;
    const std::vector<Indices>& pre = sets(before);
    const std::vector<Indices>& post = sets(after);
    const int64_t k = mesh_[m];
    int64_t busiest = 0;
    for (int64_t p = 0; p < mesh_.product(); ++p) {
      const Dims coord = unravel_index(p, mesh_);
      std::vector<const Indices*> group;
      for (int64_t g = 0; g < k; ++g) {
        Dims c = coord;
        c[m] = g;
        group.push_back(&pre[ravel_index(c, mesh_)]);
      }
      int64_t received = 0;
      switch (move) {
        case Move::kExchange:
        case Move::kEmbed: {
          // Every element of the new layout is held by exactly one member.
          std::vector<int> count(shape_.product(), 0);
          for (const Indices* s : group)
            for (int64_t e : *s) ++count[e];
          for (int64_t e : post[p])
            if (count[e] != 1) return std::nullopt;
          if (move == Move::kExchange)
            for (int64_t g = 0; g < k; ++g)
              if (g != coord[m]) received += overlap(*group[g], post[p]);
          break;
        }
        case Move::kReduceScatter:
        case Move::kAllReduce:
          for (const Indices* s : group)
            if (*s != pre[p]) return std::nullopt;  // a Partial group holds one extent
          if (!subset(post[p], pre[p])) return std::nullopt;
          received = move == Move::kReduceScatter
                         ? (k - 1) * static_cast<int64_t>(post[p].size())
                         : (2 * (k - 1) * static_cast<int64_t>(pre[p].size()) + k - 1) / k;
          break;
        case Move::kLocal:
          if (!subset(post[p], pre[p])) return std::nullopt;
          break;
        case Move::kNone: return std::nullopt;
      }
      busiest = std::max(busiest, received);
    }
    // A change that delivers nothing to any rank is no collective (e.g. _S(0,1) -> S(0)).
    const bool communicates = (move == Move::kExchange && busiest > 0) || move == Move::kReduceScatter ||
                              move == Move::kAllReduce;
    if (!communicates || k == 1) return 0.0;
    return cm.latency_us + static_cast<double>(busiest * item_) / (cm.bandwidth_gb_per_s * 1e3);
  }

  Dims shape_, mesh_;
  int64_t item_;
  std::map<std::string, std::vector<Indices>> cache_;
  std::map<std::string, std::optional<double>> edges_;
};

// The cheapest route from src to dst over every placement list built from `options[m]` per
// mesh dim, Partial states limited as PyTorch limits them (the target's own Partial, reached
// from the source's Partial or from a plain Shard turning P(sum)).
double brute_force(Model& model, const Placements& src, const Placements& dst,
                   const std::vector<std::vector<Placement>>& options, const CostModel& cm) {
  auto allowed = [&](int m, const Placement& c) {
    if (!is_partial(c)) return true;
    return c == dst[m] && (c == src[m] || (is_shard(src[m]) && c == Placement{Partial{ReduceOp::kSum}}));
  };
  std::map<std::string, double> best;
  using Item = std::pair<double, Placements>;
  auto cmp = [](const Item& a, const Item& b) { return a.first > b.first; };
  std::priority_queue<Item, std::vector<Item>, decltype(cmp)> queue(cmp);
  best[to_string(src)] = 0;
  queue.push({0, src});
  std::set<std::string> done;
  while (!queue.empty()) {
    auto [d, state] = queue.top();
    queue.pop();
    const std::string key = to_string(state);
    if (!done.insert(key).second) continue;
    if (state == dst) return d;
    for (int m = 0; m < static_cast<int>(state.size()); ++m)
      for (const Placement& c : options[m]) {
        if (c == state[m] || !allowed(m, c)) continue;
        std::optional<double> w = model.cost(state, m, c, cm);
        if (!w) continue;
        Placements next = state;
        next[m] = c;
        const std::string nk = to_string(next);
        auto it = best.find(nk);
        if (it == best.end() || d + *w < it->second - 1e-12) {
          best[nk] = d + *w;
          queue.push({d + *w, next});
        }
      }
  }
  return -1;  // unreachable
}

// The per-mesh-dim placements a route may use: Replicate, every Shard, the source's and
// target's own placements, and every StridedShard either of them uses (on any mesh dim).
std::vector<std::vector<Placement>> route_options(const Placements& src, const Placements& dst, int tensor_ndim) {
  std::vector<std::vector<Placement>> out(src.size());
  for (size_t m = 0; m < src.size(); ++m) {
    auto add = [&](const Placement& p) {
      if (std::find(out[m].begin(), out[m].end(), p) == out[m].end()) out[m].push_back(p);
    };
    add(Replicate{});
    for (int t = 0; t < tensor_ndim; ++t) add(Shard{t});
    add(src[m]);
    add(dst[m]);
    for (size_t i = 0; i < src.size(); ++i)
      for (const Placement& p : {src[i], dst[i]})
        if (is_strided_shard(p)) add(p);
  }
  return out;
}

// The model's cost of a plan's route; nullopt when some step is not valid in the model.
std::optional<double> route_cost(Model& model, const Plan& plan, const CostModel& cm) {
  double total = 0;
  for (size_t i = 0; i < plan.steps.size(); ++i) {
    const Placements &a = plan.states[i], &b = plan.states[i + 1];
    int changed = -1;
    for (size_t m = 0; m < a.size(); ++m)
      if (a[m] != b[m]) {
        if (changed >= 0) return std::nullopt;
        changed = static_cast<int>(m);
      }
    if (changed < 0) return std::nullopt;
    std::optional<double> w = model.cost(a, changed, b[changed], cm);
    if (!w) return std::nullopt;
    total += *w;
  }
  return total;
}

// Costs are latencies (10 us) plus bytes over a bandwidth; the planner breaks ties between
// equal routes with 1e-9 us per local step, far below this tolerance.
bool close(double a, double b) { return std::abs(a - b) <= 1e-6 * std::max({1.0, std::abs(a), std::abs(b)}); }

DTensorSpec spec_of(const Dims& mesh, const Dims& shape, const Placements& ps) {
  return make_spec(std::make_shared<const DeviceMesh>(DeviceMesh::from_shape(mesh)), ps, shape, DType::kF32);
}

}  // namespace

TEST_CASE("search plans cost the brute-force optimum; greedy never less",
          "[dtensor][planner][bruteforce]") {
  const std::vector<Placement> sources = {Replicate{}, Shard{0}, Shard{1}, StridedShard{0, 2}, Partial{}};
  const std::vector<Placement> targets = {Replicate{}, Shard{0}, Shard{1}, StridedShard{0, 2},
                                          StridedShard{1, 3}, Partial{}};
  const CostModel cm;
  std::mt19937_64 rng(20261);
  int64_t pairs = 0, search_cheaper = 0, strided_pairs = 0;
  struct Setup {
    Dims mesh;
    std::vector<Dims> shapes;
    int sample;  // pairs per (mesh, shape) drawn at random; 0 = every pair
  };
  const std::vector<Setup> setups = {
      {{4}, {{7, 5}, {8, 6}}, 0},
      {{2, 2}, {{7, 5}, {8, 6}, {64, 48}}, 0},
      {{2, 3}, {{7, 5}, {12, 6}}, 0},
      {{3, 2}, {{7, 5}, {12, 6}}, 0},
      {{2, 2, 2}, {{8, 6}, {7, 5}}, 160},
  };
  for (const Setup& setup : setups)
    for (const Dims& shape : setup.shapes) {
      Model model(shape, setup.mesh, 4);
      std::vector<std::pair<Placements, Placements>> cases;
      for (const Placements& src : testing_support::placement_lists(setup.mesh.size(), sources))
        for (const Placements& dst : testing_support::placement_lists(setup.mesh.size(), targets)) {
          bool ok = true;  // only transitions PyTorch allows: a new Partial only from a plain Shard
          for (size_t m = 0; m < src.size(); ++m)
            if (is_partial(dst[m]) && src[m] != dst[m] && !is_shard(src[m])) ok = false;
          if (ok) cases.emplace_back(src, dst);
        }
      if (setup.sample > 0) {
        std::shuffle(cases.begin(), cases.end(), rng);
        cases.resize(setup.sample);
      }
      for (const auto& [src, dst] : cases) {
        const DTensorSpec spec = spec_of(setup.mesh, shape, src);
        const Plan g = plan_redistribute(spec, dst, PlannerKind::kGreedy, cm);
        const Plan q = plan_redistribute(spec, dst, PlannerKind::kSearch, cm);
        const double best = brute_force(model, src, dst, route_options(src, dst, shape.size()), cm);
        INFO("mesh " << setup.mesh.size() << "-d [" << setup.mesh[0] << "..] shape [" << shape[0] << ","
                     << shape[1] << "] greedy " << to_string(g) << " | search " << to_string(q)
                     << " | brute force " << best);
        REQUIRE(best >= 0);
        const std::optional<double> gc = route_cost(model, g, cm), qc = route_cost(model, q, cm);
        REQUIRE(gc.has_value());
        REQUIRE(qc.has_value());
        REQUIRE(close(*gc, g.cost_us));
        REQUIRE(close(*qc, q.cost_us));
        REQUIRE(close(q.cost_us, best));
        REQUIRE(g.cost_us >= best - 1e-6 * std::max(1.0, best));
        search_cheaper += q.cost_us < g.cost_us - 1e-6;
        strided_pairs += to_string(src).find("_S") != std::string::npos || to_string(dst).find("_S") != std::string::npos;
        ++pairs;
      }
    }
  INFO(pairs << " pairs, search strictly cheaper than greedy on " << search_cheaper);
  CHECK(pairs > 3000);
  CHECK(strided_pairs > 1000);
  CHECK(search_cheaper > 100);
}

TEST_CASE("step validity equals the model's on every single-mesh-dim change", "[dtensor][planner][validity]") {
  // Placements over two tensor dims with strided factors 2 and 3, on meshes whose first dim is
  // 2, 3 or 4 (uneven strided nesting differs from shard order only there) and sizes 0..9.
  const std::vector<Placement> options = {Replicate{}, Shard{0}, Shard{1}, StridedShard{0, 2}, StridedShard{0, 3},
                                          StridedShard{1, 2}, Partial{}};
  int64_t checked = 0, valid = 0, valid_not_plain = 0, plain_invalid = 0;
  for (const Dims& mesh : std::vector<Dims>{{3}, {2, 2}, {3, 2}, {2, 3}, {4, 2}, {2, 2, 2}})
    for (int64_t a = 0; a <= 9; ++a)
      for (int64_t b : {1, 3, 4}) {
        if (mesh.size() == 3 && a % 2 == 1) continue;  // thinned: the 3-D lists are many
        const Dims shape{a, b};
        Model model(shape, mesh, 4);
        for (const Placements& before : testing_support::placement_lists(mesh.size(), options))
          for (int m = 0; m < mesh.size(); ++m)
            for (const Placement& to : options) {
              const std::optional<Step> step = step_between(m, before[m], to, /*direct=*/true);
              const bool model_valid = model.cost(before, m, to, CostModel{}).has_value();
              if (!step) {
                // step_between refuses only what no valid move does (P(a)->P(b), _S->P, R->R).
                if (model_valid && move_of(before[m], to) != Move::kLocal) {
                  FAIL_CHECK("no step for a valid move " << to_string(before) << " dim " << m << " -> " << to_string(to));
                }
                continue;
              }
              const bool planner_valid = is_valid_step(*step, before, shape, mesh);
              if (planner_valid != model_valid)
                FAIL_CHECK(to_string(*step) << " from [" << to_string(before) << "] shape [" << a << "," << b
                                            << "]: planner " << planner_valid << ", model " << model_valid);
              const bool plain = is_plain_step(*step, before, mesh);
              plain_invalid += plain && !model_valid;
              valid += model_valid;
              valid_not_plain += model_valid && !plain;
              ++checked;
            }
      }
  INFO(checked << " steps, " << valid << " valid, " << valid_not_plain << " valid but not plain");
  CHECK(plain_invalid == 0);  // a plain step is valid for every shape
  CHECK(checked > 100000);
  CHECK(valid_not_plain > 1000);
}

TEST_CASE("valid steps that are not plain collectives move the right data", "[dtensor][planner][validity][redistribute]") {
  // Every single-mesh-dim step the layouts allow although a later mesh dim shards the same
  // tensor dim, executed alone on local ranks (views and packed exchanges, reduce-scatters into
  // strided pieces, zero-fill embeds), checked element by element.
  const std::vector<Placement> options = {Replicate{}, Shard{0}, Shard{1}, StridedShard{0, 2}, StridedShard{0, 4},
                                          StridedShard{0, 3}, Partial{}};
  int64_t executed = 0;
  for (const Dims& mesh_shape : std::vector<Dims>{{2, 4}, {3, 2}, {2, 2, 2}}) {
    auto mesh = std::make_shared<const DeviceMesh>(DeviceMesh::from_shape(mesh_shape));
    struct Case {
      DTensorSpec src, dst;
      Plan plan;
    };
    std::vector<Case> cases;
    for (const Dims& shape : std::vector<Dims>{{16, 3}, {7, 2}, {13, 2}, {9, 1}})
      for (const Placements& before : testing_support::placement_lists(mesh_shape.size(), options))
        for (int m = 0; m < mesh_shape.size(); ++m)
          for (const Placement& to : options) {
            const std::optional<Step> step = step_between(m, before[m], to, /*direct=*/true);
            if (!step || is_plain_step(*step, before, mesh_shape) || !is_valid_step(*step, before, shape, mesh_shape))
              continue;
            Case c{make_spec(mesh, before, shape, DType::kF32), make_spec(mesh, apply_step(*step, before), shape, DType::kF32), {}};
            c.plan.src = before;
            c.plan.dst = c.dst.placements;
            c.plan.steps = {*step};
            c.plan.states = {before, c.dst.placements};
            c.plan.communicating = {communicates(*step)};
            c.plan.shapes = {shape};
            c.plan.plain = false;
            cases.push_back(std::move(c));
          }
    testing_support::Checks checks;
    collectives::run_ranks(static_cast<int>(mesh_shape.product()), [&](collectives::Communicator& world) {
      MeshComms comms(*mesh, world);
      for (const Case& c : cases) {
        const Tensor out = execute(c.plan, c.src, testing_support::make_local(c.src, world.rank()), comms);
        const std::string err = testing_support::check_redistributed(c.dst, out, comms);
        if (!err.empty()) checks.add(fmt::format("{} shape [{}] rank {}: {}", to_string(c.plan), fmt::join(c.src.shape, ","), world.rank(), err));
      }
    });
    checks.report();
    executed += static_cast<int64_t>(cases.size());
  }
  INFO(executed << " non-plain steps executed");
  CHECK(executed > 300);
}
