// PlanCache: the one cache of a redistribute, keyed by its Transition (transition.h). An entry
// holds the plan (planned by plan_transition on the first request) and, for the executor, this
// rank's data for running it (its Recipe: step dtypes and schedules, dtensor/exec/), so a
// repeated DTensor::redistribute costs one hash look-up. Each MeshComms holds one (its recipes
// are its rank's); tools and tests may hold their own for plans alone.
//
//   PlanCache cache;
//   const Plan& p = cache.plan(make_transition(spec, parse_placements("R")));   // planned once
//   const Plan& q = cache.get(spec, parse_placements("R"), PlannerKind::kSearch); // the same entry
//   &p == &q
//
// Plans are never evicted (a reference stays valid while the cache lives; a plan is small and
// independent of the world size). Recipes are bounded: past kMaxRecipes the cache drops them
// all (they are rebuilt on the next use). Thread-safe.
#pragma once

#include <memory>
#include <mutex>
#include <unordered_map>

#include "dtensor/plan/planner.h"
#include "dtensor/plan/transition.h"

namespace dtensor {

struct Recipe;  // the executor's (dtensor/exec/recipe.h)

class PlanCache {
 public:
  static constexpr size_t kMaxRecipes = 4096;

  // One look-up: the plan of t (planned on a miss) and the recipe stored with it (null: none yet).
  struct Found {
    const Plan* plan = nullptr;
    std::shared_ptr<const Recipe> recipe;
  };
  Found find(const Transition& t);
  const Plan& plan(const Transition& t) { return *find(t).plan; }
  // make_transition + plan.
  const Plan& get(const DTensorSpec& src, const Placements& dst, PlannerKind kind, const CostModel& cost = {},
                  bool allow_partial_target = false, const std::vector<Dims>& also_valid_for = {});
  // Keeps the executor's recipe of t (after find(t)).
  void set_recipe(const Transition& t, std::shared_ptr<const Recipe> recipe);
  size_t size() const;

 private:
  struct Entry {
    Plan plan;
    std::shared_ptr<const Recipe> recipe;
  };
  mutable std::mutex mu_;
  std::unordered_map<Transition, std::unique_ptr<Entry>, TransitionHash> entries_;
  size_t recipes_ = 0;
};

}  // namespace dtensor
