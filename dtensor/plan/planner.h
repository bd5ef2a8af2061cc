// Redistribute planning: a pure function of a Transition (transition.h), the same on every rank,
// so every rank derives the same collective sequence (the SPMD rule). A Plan is data: a list of
// single-mesh-dim Steps with a printable route, the traffic of its busiest rank and a cost.
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
//  - kSearch: Dijkstra over placement states with the CostModel (bytes the busiest rank
//    receives over a bandwidth, plus a latency per communicating step). Its edges are every
//    single-mesh-dim step that is valid (NOTE [step validity] in step.h), including the ones
//    PyTorch lacks: StridedShard <-> Shard moves (Regroup) and P -> _S reduce-scatters. Never
//    worse than greedy under that cost: the greedy plan is a path of the same graph.
// NOTE [planning cost] Nothing here computes a layout per rank: validity and traffic come from
// the layout algebra (chain.h, traffic.h), so planning costs the same on 8 ranks as on 2^20 for
// the transitions users run. Every call has a work budget (kMaxPlanWork); a search that would
// run past it (meshes of many dims have millions of placement states) fails with Unsupported
// naming the transition, never returning a worse route. The rank-by-rank computation the
// algebra replaces stays as the tests' reference (dtensor/plan/reference.h).
// Plans depend on the global shape (validity does, for uneven sizes): Plan::shapes lists the
// shapes a plan was checked for, and plans made of plain steps hold for any shape.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dtensor/plan/step.h"
#include "dtensor/plan/traffic.h"
#include "dtensor/plan/transition.h"
#include "dtensor/spec.h"

namespace dtensor {

struct Plan {
  Placements src, dst;
  std::vector<Step> steps;
  std::vector<Placements> states;  // states[i] is before steps[i]; states.back() == dst
  std::vector<char> communicating;  // per step: moves data (a collective on a group of k > 1)
  std::vector<Traffic> step_traffic;  // per step: its busiest rank's bytes
  PlannerKind planner = PlannerKind::kGreedy;
  Traffic traffic;                 // per rank summed over the steps: the busiest rank's
  double cost_us = 0;
  std::vector<Dims> shapes;        // global shapes every step was checked valid for
  bool plain = false;              // every step is plain (is_plain_step): valid for any shape
  // NOTE [ragged plans] (transition.h): the steps and states are of the flattened view `shape`
  // above; src and dst above are the view's placements, user_src / user_dst the caller's, of a
  // tensor of global shape `tensor_shape` (empty when the plan is not on a view).
  Dims tensor_shape;
  Placements user_src, user_dst;
  bool on_view() const { return !tensor_shape.empty(); }

  int collectives() const;         // communicating steps
  int64_t bytes_per_rank() const { return traffic.max_sent(); }
  // True when the plan may run on a tensor of this global shape (the executor's contract).
  bool valid_for(const Dims& global_shape) const;
};

// "[S(0),S(1)] -AG(1)-> [S(0),R] -A2A(0:0->1)-> [S(1),R] -chunk(1->S(0))-> [S(1),S(0)]";
// a plan without steps prints "[S(0)]" alone. A plan on a view (NOTE [ragged plans]) names the
// caller's placements where they differ from the view's: "[S(0)] as [Rg(0,[3,3,3,0],4)] -...".
std::string to_string(const Plan& plan);

// The planner: a pure function of the transition (its planner kind, cost model, shapes). Throws
// Unsupported when no route exists or the search runs past its work budget.
Plan plan_transition(const Transition& t);

// Where a planner gets step validity and traffic: the layout algebra (what plan_transition(t)
// uses) or, in tests, the rank-by-rank reference (reference.h). The search and
// greedy logic is the same for both.
class StepOracle {
 public:
  virtual ~StepOracle() = default;
  virtual bool valid(const Step& step, const Placements& before, const Dims& shape, const Dims& mesh_shape,
                     WorkBudget& work) const = 0;
  virtual Traffic step(const Step& step, const Placements& before, const Dims& shape, const Dims& mesh_shape,
                       DType dtype, WorkBudget& work) const = 0;
  virtual Traffic route(std::span<const Step> steps, std::span<const Placements> states, const Dims& shape,
                        const Dims& mesh_shape, DType dtype, WorkBudget& work) const = 0;
};
Plan plan_transition(const Transition& t, const StepOracle& oracle);

// make_transition (its errors) + plan_transition.
Plan plan_redistribute(const DTensorSpec& src, const Placements& dst, PlannerKind kind,
                       const CostModel& cost = {}, bool allow_partial_target = false,
                       const std::vector<Dims>& also_valid_for = {});

// The lower bound (traffic.h) counts, per rank:
//  - No Partial reduced: the elements a rank holds after and not before (exact per rank). A
//    new P(sum) target needs nothing (a zero-fill); it is counted as keeping its source.
//  - Partial mesh dims reduced (product of sizes C): each element's C contributions merge with
//    C-1 transfers and reach its D holders with D-1 more, so the mesh receives at least
//    numel x (C-2) + sum of the ranks' new local sizes per kept-Partial class; the busiest
//    rank at least that over the ranks, and at least its own new local size. Even splits meet
//    it on every rank (a reduce-scatter: (k-1)/k N; an all-reduce 2(k-1)/k N; HSDP's
//    reduce-scatter + all-reduce). An uneven reduce-scatter cannot: the rank owning the
//    largest chunk receives (k-1) x ceil(N/k) > (k-1) N / k.

}  // namespace dtensor
