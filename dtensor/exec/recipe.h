// Recipe: everything one rank needs to run a plan for one tensor, computed once per transition
// and kept in its PlanCache entry (dtensor/plan/cache.h): the dtypes of every step (NOTE [reduce
// policy] in executor.h), each step's schedule (schedule.h) and the bytes issuing allocates.
// Internal to dtensor/exec/.
#pragma once

#include <array>
#include <memory>
#include <vector>

#include "collectives/communicator.h"
#include "dtensor/exec/schedule.h"
#include "dtensor/plan/planner.h"
#include "dtensor/plan/transition.h"

namespace dtensor {

// Per step: the dtypes in and out, and for reducing steps the reduction and a post-scale.
struct ExecStep {
  DType in = DType::kF32, out = DType::kF32, work = DType::kF32;  // work: what the step moves / reduces in
  DType wire = DType::kF32;  // what a reducing step moves: work, or the step's narrower wire dtype
  collectives::Reduction reduction;
  double post_scale = 1.0;
};

bool is_reducing(const Step& step);
// The dtypes and reductions of every step (NOTE [reduce policy]); throws InvalidArgument for a
// policy the plan cannot take (a divide factor without a P(sum) reduction, ...).
std::vector<ExecStep> plan_dtypes(const Plan& plan, const Dims& mesh_shape, DType input, DType output,
                                  const ReducePolicy& policy);

struct Recipe {
  Dims src_local, dst_local;  // this rank's local shapes before and after
  // A plan on a RaggedShard view (NOTE [ragged plans]): the recipe is of the view; these are the
  // caller's local shapes before and after (empty for other plans).
  Dims user_src_local, user_dst_local;
  std::vector<ExecStep> steps;
  struct PerStep {
    Placements after;
    bool plain = false;  // is_plain_step(the step, its placements before, the mesh)
    // The schedules the step's likely path needs; a path taken only for some inputs (an
    // all-gather's exchange when the input is not contiguous) is computed when it is taken.
    std::array<std::shared_ptr<const StepSchedule>, static_cast<size_t>(Path::kCount)> by_path;
  };
  std::vector<PerStep> per_step;
  // The bytes issuing allocates on this rank without an out, and with one (memory_check.h).
  int64_t bytes = 0, bytes_with_out = 0;

  // Bytes the recipe holds (dtensor-check plan's schedule_bytes).
  int64_t schedule_bytes() const;
};

// This rank's recipe for running `plan` on tensors of `spec`, the result in `output`.
// REQUIRES: plan.valid_for(spec.shape) (checked: InvalidArgument), comms in the mesh.
std::shared_ptr<const Recipe> make_recipe(const RankContext& rc, const Plan& plan, const DTensorSpec& spec,
                                          DType output, const ReducePolicy& policy);

}  // namespace dtensor
