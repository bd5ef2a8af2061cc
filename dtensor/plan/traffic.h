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

// The least any later owner keeps through a same-dim regroup at coordinate c of its mesh dim:
// ca and cb are the chains from that mesh dim on (their first splits at it, the same later ones),
// lo/hi the box of later coordinates per later split; the positions both first splits give c,
// counted per later owner through cb's list (0 when some owner of the box keeps none). by_runs:
// owner run by owner run (the reference; otherwise by owner segments, falling back to runs).
// Worked example: n 16, ca {_S(0,2) k 2}, cb {S(0) k 2}, c 0: pieces {0..3, 8..11} and {0..7}
// share 0..3 -> 4. REQUIRES: ca, cb non-empty; lo[i] < hi[i] <= cb[i + 1].k.
int64_t least_kept_in_box(int64_t n, std::span<const Split> ca, std::span<const Split> cb, int64_t c,
                          std::span<const int64_t> lo, std::span<const int64_t> hi, WorkBudget& work,
                          bool by_runs = false);

// The transition's lower bound: what no plan can go below (the busiest rank's bytes received;
// see plan_redistribute in planner.h for the model).
Traffic lower_bound_traffic(const DTensorSpec& src, const Placements& dst);

}  // namespace dtensor
