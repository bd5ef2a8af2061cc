// Redistribute planning: pure and rank-independent, so every rank derives the same collective
// sequence (the SPMD rule). A Plan is data: a list of single-mesh-dim Steps with a printable
// route and a cost.
//
//   Plan p = plan_redistribute(src_spec, parse_placements("R,S(1)"), PlannerKind::kGreedy);
//   to_string(p) == "[S(0),R] -AG(0)-> [R,R] -chunk(1->S(1))-> [R,S(1)]"
//
// Two planners behind one signature:
//  - kGreedy: PyTorch's default algorithm (dtensor-semantics.md 4.2), step for step, for
//    default-order specs; StridedShard is treated like Shard by its consistency checks, and a
//    transition no single primitive performs goes through Replicate (as PyTorch does).
//  - kSearch: Dijkstra over placement states with the CostModel below (bytes the busiest rank
//    receives over a bandwidth, plus a latency per communicating step), with direct
//    StridedShard <-> Shard moves (Regroup). Never worse than greedy under that cost: the
//    greedy plan is a path of the same graph, and the cheaper of the two is returned.
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

  int collectives() const;         // communicating steps
  int64_t bytes_per_rank() const { return traffic.max_sent(); }
};

// "[S(0),S(1)] -AG(1)-> [S(0),R] -A2A(0:0->1)-> [S(1),R] -chunk(1->S(0))-> [S(1),S(0)]";
// a plan without steps prints "[S(0)]" alone.
std::string to_string(const Plan& plan);

// Validates the transition and plans it. Throws Unsupported for what PyTorch also rejects (a
// Shard/StridedShard source turning Partial, P(a) -> P(b), a new Partial target unless
// allow_partial_target) and InvalidArgument for malformed placements (mesh ndim, shard dims).
// allow_partial_target: R -> P(op) local partition is allowed (distribute_tensor uses it).
Plan plan_redistribute(const DTensorSpec& src, const Placements& dst, PlannerKind kind,
                       const CostModel& cost = {}, bool allow_partial_target = false);

// Traffic of one step from `before` (exact per rank, uneven shards included) and the
// transition's lower bound (what must move: elements a rank needs and does not hold; for a
// reduction over one mesh dim of k, (k-1)/k of the reduced data per rank, twice that for an
// all-reduce).
Traffic step_traffic(const Step& step, const DTensorSpec& spec, const Placements& before);
Traffic lower_bound_traffic(const DTensorSpec& src, const Placements& dst);

// Memoises plans by (mesh shape, global shape, dtype, src, dst, planner). Thread-safe.
class PlanCache {
 public:
  const Plan& get(const DTensorSpec& src, const Placements& dst, PlannerKind kind,
                  const CostModel& cost = {}, bool allow_partial_target = false);
  size_t size() const;

 private:
  using Key = std::tuple<std::vector<int64_t>, std::vector<int64_t>, int, std::string, std::string,
                         int, bool, double, double>;
  mutable std::mutex mu_;
  std::map<Key, Plan> plans_;
};

}  // namespace dtensor
