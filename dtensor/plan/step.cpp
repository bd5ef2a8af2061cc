#include "dtensor/plan/step.h"

#include <fmt/format.h>

#include "kernels/error.h"

namespace dtensor {

namespace {

template <class... Ts>
struct Overloaded : Ts... {
  using Ts::operator()...;
};
// Needed by clang 14 (no aggregate deduction yet); the sanitizer and fuzz builds use clang.
template <class... Ts>
Overloaded(Ts...) -> Overloaded<Ts...>;

// Tensor dims the step splits or joins (NOTE [step validity]).
std::vector<int> touched_dims(const Step& step) {
  return std::visit(
      Overloaded{
          [](const AllGather& s) { return std::vector<int>{s.tensor_dim}; },
          [](const StridedAllGather& s) { return std::vector<int>{s.tensor_dim}; },
          [](const AllToAll& s) { return std::vector<int>{s.from_dim, s.to_dim}; },
          [](const AllReduce&) { return std::vector<int>{}; },
          [](const ReduceScatter& s) { return std::vector<int>{s.tensor_dim}; },
          [](const LocalChunk& s) { return std::vector<int>{*shard_dim(s.to)}; },
          [](const LocalPartial&) { return std::vector<int>{}; },
          [](const Regroup& s) { return std::vector<int>{*shard_dim(s.from)}; },
      },
      step);
}

}  // namespace

int mesh_dim_of(const Step& step) {
  return std::visit([](const auto& s) { return s.mesh_dim; }, step);
}

bool communicates(const Step& step) {
  return !std::holds_alternative<LocalChunk>(step) && !std::holds_alternative<LocalPartial>(step);
}

Placement source_of(const Step& step, const Placements& before) { return before[mesh_dim_of(step)]; }

Placements apply_step(const Step& step, const Placements& placements) {
  Placements out = placements;
  const int m = mesh_dim_of(step);
  out[m] = std::visit(
      Overloaded{
          [](const AllGather&) -> Placement { return Replicate{}; },
          [](const StridedAllGather&) -> Placement { return Replicate{}; },
          [](const AllToAll& s) -> Placement { return Shard{s.to_dim}; },
          [](const AllReduce&) -> Placement { return Replicate{}; },
          [](const ReduceScatter& s) -> Placement { return Shard{s.tensor_dim}; },
          [](const LocalChunk& s) -> Placement { return s.to; },
          [](const LocalPartial& s) -> Placement { return Partial{s.op}; },
          [](const Regroup& s) -> Placement { return s.to; },
      },
      step);
  return out;
}

std::string to_string(const Step& step) {
  return std::visit(
      Overloaded{
          [](const AllGather& s) { return fmt::format("AG({})", s.mesh_dim); },
          [](const StridedAllGather& s) {
            return fmt::format("_AG({},sf={})", s.mesh_dim, s.split_factor);
          },
          [](const AllToAll& s) {
            return fmt::format("A2A({}:{}->{})", s.mesh_dim, s.from_dim, s.to_dim);
          },
          [](const AllReduce& s) {
            return fmt::format("AR({},{})", s.mesh_dim, kernels::to_string(s.op));
          },
          [](const ReduceScatter& s) {
            return fmt::format("RS({}:{},{})", s.mesh_dim, s.tensor_dim, kernels::to_string(s.op));
          },
          [](const LocalChunk& s) { return fmt::format("chunk({}->{})", s.mesh_dim, to_string(s.to)); },
          [](const LocalPartial& s) {
            return fmt::format("partial({},{})", s.mesh_dim, kernels::to_string(s.op));
          },
          [](const Regroup& s) {
            return fmt::format("regroup({}:{}->{})", s.mesh_dim, to_string(s.from), to_string(s.to));
          },
      },
      step);
}

std::optional<Step> step_between(int m, const Placement& from, const Placement& to, bool direct) {
  if (from == to) return std::nullopt;
  const std::optional<int> fd = shard_dim(from), td = shard_dim(to);
  if (is_replicate(to)) {
    if (const auto* s = std::get_if<Shard>(&from)) return AllGather{m, s->dim};
    if (const auto* s = std::get_if<StridedShard>(&from)) return StridedAllGather{m, s->dim, s->split_factor};
    if (const auto* p = std::get_if<Partial>(&from)) return AllReduce{m, p->op};
    return std::nullopt;
  }
  if (is_replicate(from)) {
    if (td) return LocalChunk{m, to};
    if (const auto* p = std::get_if<Partial>(&to)) return LocalPartial{m, p->op};
    return std::nullopt;
  }
  if (const auto* p = std::get_if<Partial>(&from)) {
    if (const auto* s = std::get_if<Shard>(&to)) return ReduceScatter{m, s->dim, p->op};
    return std::nullopt;  // P -> _S goes through R; P(a) -> P(b) is an error
  }
  // Both shard-like.
  if (fd && td) {
    if (is_shard(from) && is_shard(to) && *fd != *td) return AllToAll{m, *fd, *td};
    if (direct && *fd == *td) return Regroup{m, from, to};
  }
  return std::nullopt;
}

bool is_valid_step(const Step& step, const Placements& before, const Dims& mesh_shape) {
  const int m = mesh_dim_of(step);
  if (m < 0 || m >= static_cast<int>(before.size()) || mesh_shape.size() != static_cast<int>(before.size()))
    return false;
  for (int d : touched_dims(step))
    for (int later = m + 1; later < mesh_shape.size(); ++later)
      if (mesh_shape[later] > 1 && shard_dim(before[later]) == d) return false;
  // The step must start from what it converts.
  return std::visit(
      Overloaded{
          [&](const AllGather& s) { return before[m] == Placement{Shard{s.tensor_dim}}; },
          [&](const StridedAllGather& s) {
            return before[m] == Placement{StridedShard{s.tensor_dim, s.split_factor}};
          },
          [&](const AllToAll& s) { return before[m] == Placement{Shard{s.from_dim}}; },
          [&](const AllReduce& s) { return before[m] == Placement{Partial{s.op}}; },
          [&](const ReduceScatter& s) { return before[m] == Placement{Partial{s.op}}; },
          [&](const LocalChunk&) { return is_replicate(before[m]); },
          [&](const LocalPartial&) { return is_replicate(before[m]); },
          [&](const Regroup& s) { return before[m] == s.from; },
      },
      step);
}

}  // namespace dtensor
