// Redistribute planning: pure and rank-independent, so every rank derives the same collective
// sequence (the SPMD rule). A Plan is data: a list of single-mesh-dim Steps with a printable
// route and a cost.
//
//   Plan p = plan_redistribute(src_spec, parse_placements("R,S(1)"), PlannerKind::kGreedy);
//   to_string(p) == "[S(0),R] -AG(0)-> [R,R] -chunk(1->S(1))-> [R,S(1)]"
//
// Two planners behind one signature:
//  - kGreedy: PyTorch's default algorithm (docs/pytorch-semantics.md 4.2), step for step, for
//    default-order specs; StridedShard is treated like Shard by its consistency checks, and a
//    transition no single primitive performs goes through Replicate (as PyTorch does). PyTorch
//    itself never runs this algorithm on StridedShard (its graph planner takes those), so with
//    _S greedy is "PyTorch's greedy rules applied to _S", not PyTorch's route.
//  - kSearch: Dijkstra over placement states with the CostModel below (bytes the busiest rank
//    receives over a bandwidth, plus a latency per communicating step). Its edges are every
//    single-mesh-dim step that is valid by layouts (NOTE [step validity] in step.h), including
//    the ones PyTorch lacks: StridedShard <-> Shard moves (Regroup) and P -> _S reduce-scatters.
//    Never worse than greedy under that cost: the greedy plan is a path of the same graph.
// Plans depend on the global shape (validity does, for uneven sizes): Plan::shapes lists the
// shapes a plan was checked for, and plans made of plain steps hold for any shape.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "dtensor/plan/step.h"
#include "dtensor/spec.h"

namespace dtensor {

// Planning limits. The traffic model compares each rank with every member of its group, so one
// step costs about mesh.size() x group size: meshes where that product exceeds
// kMaxPlanRankPairs are refused (Unsupported naming the shape; a 1-D mesh of 4096 ranks is the
// largest 1-D one, about a second of planning). The search planner stops after kMaxSearchWork
// units (a rank layout computed, per mesh dim, or a rank pair compared) and returns the greedy
// route instead:
// meshes of many dims can have millions of placement states.
inline constexpr int64_t kMaxPlanRankPairs = int64_t{1} << 24;
inline constexpr int64_t kMaxSearchWork = int64_t{1} << 22;

enum class PlannerKind { kGreedy, kSearch };
std::string_view to_string(PlannerKind kind);
PlannerKind parse_planner(std::string_view text);  // "greedy" | "search"

// cost(step) = latency_us + max over ranks of the bytes the rank receives / bandwidth.
struct CostModel {
  double latency_us = 10.0;
  double bandwidth_gb_per_s = 20.0;  // 1 GB/s = 1e3 bytes/us
};

// Bytes moved by one step or a whole plan, per rank (index = position in mesh.ranks()).
struct Traffic {
  std::vector<int64_t> sent, received;
  int64_t max_sent() const;
  int64_t max_received() const;
};

struct Plan {
  Placements src, dst;
  std::vector<Step> steps;
  std::vector<Placements> states;  // states[i] is before steps[i]; states.back() == dst
  std::vector<char> communicating;  // per step: moves data (a collective on a group of k > 1)
  PlannerKind planner = PlannerKind::kGreedy;
  Traffic traffic;                 // summed over the steps
  double cost_us = 0;
  std::vector<Dims> shapes;        // global shapes every step was checked valid for
  bool plain = false;              // every step is plain (is_plain_step): valid for any shape

  int collectives() const;         // communicating steps
  int64_t bytes_per_rank() const { return traffic.max_sent(); }
  // True when the plan may run on a tensor of this global shape (the executor's contract).
  bool valid_for(const Dims& global_shape) const;
};

// "[S(0),S(1)] -AG(1)-> [S(0),R] -A2A(0:0->1)-> [S(1),R] -chunk(1->S(0))-> [S(1),S(0)]";
// a plan without steps prints "[S(0)]" alone.
std::string to_string(const Plan& plan);

// Validates the transition and plans it. Throws Unsupported for what PyTorch also rejects (a
// StridedShard source turning Partial, a Shard turning P(avg/min/max/prod), P(a) -> P(b), a
// new Partial target from Replicate unless allow_partial_target) and InvalidArgument for
// malformed placements (mesh ndim, shard dims). S(d) -> P(sum) is allowed (PyTorch 2.15: a
// local zero-fill). allow_partial_target: R -> P(op) local partition is allowed (the partition
// distribute_tensor does by itself; no library caller asks for it). also_valid_for: more
// global shapes (any ndim) the plan must be valid for (a batch moving tensors of several shapes
// with one plan); the cost is that of src.shape.
Plan plan_redistribute(const DTensorSpec& src, const Placements& dst, PlannerKind kind,
                       const CostModel& cost = {}, bool allow_partial_target = false,
                       const std::vector<Dims>& also_valid_for = {});

// Traffic of one step from `before` (exact per rank, uneven shards included).
Traffic step_traffic(const Step& step, const DTensorSpec& spec, const Placements& before);
// The transition's lower bound, per rank: what no plan can go below.
//  - No Partial reduced: the elements a rank holds after and not before (exact per rank). A
//    new P(sum) target needs nothing (a zero-fill); it is counted as keeping its source.
//  - Partial mesh dims reduced (product of sizes C): each element's C contributions merge with
//    C-1 transfers and reach its D holders with D-1 more, so the mesh receives at least
//    numel x (C-2) + sum of the ranks' new local sizes per kept-Partial class; the busiest
//    rank at least that over the ranks, and at least its own new local size. Even splits meet
//    it on every rank (a reduce-scatter: (k-1)/k N; an all-reduce 2(k-1)/k N; HSDP's
//    reduce-scatter + all-reduce). An uneven reduce-scatter cannot: the rank owning the
//    largest chunk receives (k-1) x ceil(N/k) > (k-1) N / k.
Traffic lower_bound_traffic(const DTensorSpec& src, const Placements& dst);

// Memoises plans by (mesh shape, global shape, dtype, src, dst, planner, extra shapes).
// Thread-safe.
class PlanCache {
 public:
  const Plan& get(const DTensorSpec& src, const Placements& dst, PlannerKind kind,
                  const CostModel& cost = {}, bool allow_partial_target = false,
                  const std::vector<Dims>& also_valid_for = {});
  size_t size() const;

 private:
  using Key = std::tuple<std::vector<int64_t>, std::vector<int64_t>, int, std::string, std::string,
                         int, bool, double, double, std::vector<std::vector<int64_t>>>;
  mutable std::mutex mu_;
  std::map<Key, Plan> plans_;
};

}  // namespace dtensor
