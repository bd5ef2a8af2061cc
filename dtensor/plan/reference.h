// The rank-by-rank reference of step validity, traffic and the lower bound: every rank's layout
// computed and compared with its group's, O(ranks x group) per step. The planner no longer uses
// it (NOTE [planning cost] in planner.h); the tests compare the layout algebra against it on
// small meshes, plan for plan (ReferenceOracle drives the same greedy and search logic).
#pragma once

#include <span>
#include <vector>

#include "dtensor/layout.h"
#include "dtensor/plan/planner.h"

namespace dtensor {

// Bytes per rank (index: row-major mesh position).
struct RankTraffic {
  std::vector<int64_t> sent, received;
  Traffic busiest() const;
};

// Every rank's layout under `placements`, indexed by row-major mesh position.
std::vector<ShardLayout> mesh_layouts(const Dims& global_shape, const Dims& mesh_shape, const Placements& placements);

// NOTE [step validity] decided on every rank's layouts.
bool reference_valid_step(const Step& step, const Placements& before, const Dims& global_shape, const Dims& mesh_shape);
// One valid step's bytes, per rank.
RankTraffic reference_step_traffic(const Step& step, const Placements& before, const Dims& global_shape,
                                   const Dims& mesh_shape, DType dtype);
// The lower bound (planner.h), per rank.
RankTraffic reference_lower_bound(const DTensorSpec& src, const Placements& dst);

class ReferenceOracle final : public StepOracle {
 public:
  bool valid(const Step& step, const Placements& before, const Dims& shape, const Dims& mesh_shape,
             WorkBudget& work) const override;
  Traffic step(const Step& step, const Placements& before, const Dims& shape, const Dims& mesh_shape, DType dtype,
               WorkBudget& work) const override;
  Traffic route(std::span<const Step> steps, std::span<const Placements> states, const Dims& shape,
                const Dims& mesh_shape, DType dtype, WorkBudget& work) const override;
};

}  // namespace dtensor
