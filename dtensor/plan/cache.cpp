#include "dtensor/plan/cache.h"

namespace dtensor {

PlanCache::Found PlanCache::find(const Transition& t) {
  {
    std::lock_guard lk(mu_);
    if (auto it = entries_.find(t); it != entries_.end()) return {&it->second->plan, it->second->recipe};
  }
  auto entry = std::make_unique<Entry>();
  entry->plan = plan_transition(t);  // outside the lock: planning may take a while, or throw
  std::lock_guard lk(mu_);
  auto [it, inserted] = entries_.try_emplace(t, std::move(entry));
  return {&it->second->plan, it->second->recipe};
}

const Plan& PlanCache::get(const DTensorSpec& src, const Placements& dst, PlannerKind kind, const CostModel& cost,
                           bool allow_partial_target, const std::vector<Dims>& also_valid_for) {
  return plan(make_transition(src, dst, kind, {}, std::nullopt, cost, allow_partial_target, also_valid_for));
}

void PlanCache::set_recipe(const Transition& t, std::shared_ptr<const Recipe> recipe) {
  std::lock_guard lk(mu_);
  auto it = entries_.find(t);
  if (it == entries_.end()) return;
  if (!it->second->recipe) {
    if (recipes_ >= kMaxRecipes) {
      for (auto& [key, e] : entries_) e->recipe.reset();
      recipes_ = 0;
    }
    ++recipes_;
  }
  it->second->recipe = std::move(recipe);
}

size_t PlanCache::size() const {
  std::lock_guard lk(mu_);
  return entries_.size();
}

}  // namespace dtensor
