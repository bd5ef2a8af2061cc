// Traffic of steps, routes and transitions, from the layout algebra (dtensor/plan/chain.h): the
// bytes the busiest rank sends and receives, exact per rank (uneven shards included) without a
// layout per rank.
//
//   Traffic t = step_traffic(AllGather{0, 0}, parse_placements("S(0)"), Dims{13, 4}, Dims{4}, DType::kF32, work);
//   t.received == 40 * 4   // the rank holding the empty or smallest chunk: 13 - 3 = 10 rows... of 4
//
// How (NOTE [traffic by size classes]): a valid step moves, to each rank, a product over tensor
// dims of quantities that depend only on the rank's local sizes under a few chains (a gather
// along t: (|after_t| - |before_t|) x the other dims' sizes; an all-to-all i -> j: |after_j| x
// (|after_i| - |before_i|) x the others; a reduce-scatter: (k-1) x |after|; an all-reduce:
// 2(k-1)|before|/k), because a valid step's pieces nest (NOTE [step validity] in step.h). So the
// busiest rank is found among the size classes of those chains (for_each_size_class), whatever
// the number of ranks. A regroup between two splits of the same tensor dim (_S(0,2) -> S(0)) is
// the exception: what a rank keeps is an intersection, evaluated per coordinate of the step's
// mesh dim and the later ones (work bounded by their group sizes and split factors). A route's
// traffic is the busiest rank's sum over the route's steps, found the same way over the chains
// of every state.
#pragma once

#include <span>
#include <vector>

#include "dtensor/plan/chain.h"
#include "dtensor/plan/step.h"
#include "dtensor/spec.h"

namespace dtensor {

// The bytes the busiest rank sends and receives.
struct Traffic {
  int64_t sent = 0, received = 0;
  int64_t max_sent() const { return sent; }
  int64_t max_received() const { return received; }
  friend bool operator==(const Traffic&, const Traffic&) = default;
};

// One step from `before` for a tensor of global_shape and dtype: exact per rank, the busiest
// rank's; an all-reduce counts as a bandwidth-optimal one, 2(k-1)N/k rounded up. A step on a
// group of one, or a local step, moves nothing. Throws InvalidArgument naming the shape when a
// count overflows int64 bytes. REQUIRES: the step is valid (is_valid_step).
Traffic step_traffic(const Step& step, const Placements& before, const Dims& global_shape, const Dims& mesh_shape,
                     DType dtype, WorkBudget& work);

// A route (steps[i] runs from states[i]): per rank, the sum over its steps; the busiest rank's.
Traffic route_traffic(std::span<const Step> steps, std::span<const Placements> states, const Dims& global_shape,
                      const Dims& mesh_shape, DType dtype, WorkBudget& work);

// The transition's lower bound: what no plan can go below (the busiest rank's bytes received;
// see plan_redistribute in planner.h for the model).
Traffic lower_bound_traffic(const DTensorSpec& src, const Placements& dst);

}  // namespace dtensor
