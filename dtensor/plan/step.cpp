#include "dtensor/plan/step.h"

#include <fmt/format.h>

#include <algorithm>

#include "dtensor/plan/traffic.h"
#include "kernels/error.h"
#include "kernels/overloaded.h"

namespace dtensor {

namespace {

using kernels::Overloaded;

std::string wire_text(const std::optional<kernels::DType>& wire) {
  return wire ? fmt::format(",wire={}", kernels::to_string(*wire)) : std::string();
}

// The step starts from the placement it converts.
bool starts_right(const Step& step, const Placements& before) {
  const int m = mesh_dim_of(step);
  return std::visit(
      Overloaded{
          [&](const AllGather& s) {
            return before[m] == Placement{Shard{s.tensor_dim}} || ragged_dim(before[m]) == s.tensor_dim;
          },
          [&](const StridedAllGather& s) {
            return before[m] == Placement{StridedShard{s.tensor_dim, s.split_factor}};
          },
          [&](const AllToAll& s) { return before[m] == Placement{Shard{s.from_dim}}; },
          [&](const AllReduce& s) { return before[m] == Placement{Partial{s.op}}; },
          [&](const ReduceScatter& s) { return before[m] == Placement{Partial{s.op}}; },
          [&](const LocalChunk& s) {
            // From Replicate to a shard (PyTorch's chunk); from a shard when every rank already
            // holds its new layout (a relabel or a narrowing, e.g. _S(0,1) -> S(0)).
            return !is_partial(before[m]) && !is_partial(s.to) && before[m] != s.to &&
                   (split_dim(s.to).has_value() || split_dim(before[m]).has_value());
          },
          [&](const LocalPartial&) { return is_replicate(before[m]); },
          [&](const Regroup& s) {
            return before[m] == s.from && split_dim(s.from) && split_dim(s.to) && s.from != s.to;
          },
          [&](const LocalEmbed& s) { return before[m] == Placement{Shard{s.tensor_dim}}; },
      },
      step);
}

}  // namespace

std::optional<int> split_dim(const Placement& p) {
  if (std::optional<int> d = shard_dim(p)) return d;
  return ragged_dim(p);
}

std::optional<bool> ragged_step_valid(const Step& step, const Placements& before, const Placements& after,
                                      const Dims& view_shape, const Dims& mesh_shape) {
  const int r = std::max(ragged_mesh_dim(before), ragged_mesh_dim(after));
  if (r < 0) return std::nullopt;
  // Both states must be layouts of this view (NOTE [ragged view]).
  for (const Placements* ps : {&before, &after}) {
    if (ragged_mesh_dim(*ps) < 0) continue;
    try {
      if (!(ragged_view(view_shape, *ps) == view_shape)) return false;
    } catch (const kernels::Unsupported&) {
      return false;
    } catch (const kernels::InvalidArgument&) {
      return false;
    }
    const auto& rg = std::get<RaggedShard>((*ps)[ragged_mesh_dim(*ps)]);
    if (static_cast<int64_t>(rg.units.size()) != mesh_shape[ragged_mesh_dim(*ps)]) return false;
  }
  // NOTE [ragged plans]: steps on the ragged dim only where no other mesh dim splits it; steps
  // on other dims only while the ragged mesh dim stays put.
  const int m = mesh_dim_of(step);
  // Beside the ragged mesh dim, only all-reduces (HSDP's replicate dim: P -> R of every piece).
  if (m != r) return std::holds_alternative<AllReduce>(step);
  const int d = view_shape.size() - 1;
  const std::vector<int> touched = touched_dims(step);
  if (std::find(touched.begin(), touched.end(), d) == touched.end()) return false;
  for (int q = 0; q < mesh_shape.size(); ++q)
    if (q != m && mesh_shape[q] > 1 && (split_dim(before[q]) == d || split_dim(after[q]) == d)) return false;
  return true;
}

int mesh_dim_of(const Step& step) {
  return std::visit([](const auto& s) { return s.mesh_dim; }, step);
}

bool communicates(const Step& step) {
  return !std::holds_alternative<LocalChunk>(step) && !std::holds_alternative<LocalPartial>(step) &&
         !std::holds_alternative<LocalEmbed>(step);
}

Placements apply_step(const Step& step, const Placements& placements) {
  Placements out = placements;
  out[mesh_dim_of(step)] = placement_after(step);
  return out;
}

Placement placement_after(const Step& step) {
  return std::visit(
      Overloaded{
          [](const AllGather&) -> Placement { return Replicate{}; },
          [](const StridedAllGather&) -> Placement { return Replicate{}; },
          [](const AllToAll& s) -> Placement { return Shard{s.to_dim}; },
          [](const AllReduce&) -> Placement { return Replicate{}; },
          [](const ReduceScatter& s) -> Placement {
            if (s.ragged) return *s.ragged;
            if (s.split_factor > 0) return StridedShard{s.tensor_dim, s.split_factor};
            return Shard{s.tensor_dim};
          },
          [](const LocalChunk& s) -> Placement { return s.to; },
          [](const LocalPartial& s) -> Placement { return Partial{s.op}; },
          [](const Regroup& s) -> Placement { return s.to; },
          [](const LocalEmbed&) -> Placement { return Partial{ReduceOp::kSum}; },
      },
      step);
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
            return fmt::format("AR({},{}{})", s.mesh_dim, kernels::to_string(s.op), wire_text(s.wire));
          },
          [](const ReduceScatter& s) {
            if (s.ragged)
              return fmt::format("RS({}:{},{}{})", s.mesh_dim, to_string(Placement{*s.ragged}), kernels::to_string(s.op),
                                 wire_text(s.wire));
            if (s.split_factor > 0)
              return fmt::format("RS({}:{},{}{})", s.mesh_dim,
                                 to_string(Placement{StridedShard{s.tensor_dim, s.split_factor}}),
                                 kernels::to_string(s.op), wire_text(s.wire));
            return fmt::format("RS({}:{},{}{})", s.mesh_dim, s.tensor_dim, kernels::to_string(s.op), wire_text(s.wire));
          },
          [](const LocalChunk& s) { return fmt::format("chunk({}->{})", s.mesh_dim, to_string(s.to)); },
          [](const LocalPartial& s) {
            return fmt::format("partial({},{})", s.mesh_dim, kernels::to_string(s.op));
          },
          [](const Regroup& s) {
            return fmt::format("regroup({}:{}->{})", s.mesh_dim, to_string(s.from), to_string(s.to));
          },
          [](const LocalEmbed& s) { return fmt::format("embed({}:S({})->P(sum))", s.mesh_dim, s.tensor_dim); },
      },
      step);
}

std::optional<Step> step_between(int m, const Placement& from, const Placement& to, bool direct) {
  if (from == to) return std::nullopt;
  const std::optional<int> fd = shard_dim(from), td = split_dim(to);
  if (is_replicate(to)) {
    if (const auto* s = std::get_if<Shard>(&from)) return AllGather{m, s->dim};
    if (const auto* r = std::get_if<RaggedShard>(&from)) return AllGather{m, r->dim};
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
    if (const auto* s = std::get_if<StridedShard>(&to); s && direct)
      return ReduceScatter{m, s->dim, p->op, s->split_factor};
    if (const auto* r = std::get_if<RaggedShard>(&to)) return ReduceScatter{m, r->dim, p->op, 0, std::nullopt, *r};
    return std::nullopt;  // P(a) -> P(b) is an error; PyTorch sends P -> _S through R
  }
  if (const auto* p = std::get_if<Partial>(&to)) {
    // PyTorch 2.15: only a plain Shard turns Partial, and only into a sum (a local zero-fill).
    const auto* s = std::get_if<Shard>(&from);
    if (s && p->op == ReduceOp::kSum) return LocalEmbed{m, s->dim};
    return std::nullopt;
  }
  // Both shard-like.
  if (is_shard(from) && is_shard(to)) return AllToAll{m, *fd, *td};
  // One exchange of the overlaps: always for a ragged side, otherwise only a direct planner's.
  // (One Regroup construction: with two, GCC 12 -O2 warns -Wmaybe-uninitialized moving it.)
  if (!direct && !is_ragged(from) && !is_ragged(to)) return std::nullopt;
  return Regroup{m, from, to};
}

std::vector<int> touched_dims(const Step& step) {
  return std::visit(
      Overloaded{
          [](const AllGather& s) { return std::vector<int>{s.tensor_dim}; },
          [](const StridedAllGather& s) { return std::vector<int>{s.tensor_dim}; },
          [](const AllToAll& s) { return std::vector<int>{s.from_dim, s.to_dim}; },
          [](const AllReduce&) { return std::vector<int>{}; },
          [](const ReduceScatter& s) { return std::vector<int>{s.tensor_dim}; },
          [](const LocalChunk& s) { return std::vector<int>{*split_dim(s.to)}; },
          [](const LocalPartial&) { return std::vector<int>{}; },
          [](const Regroup& s) {
            std::vector<int> dims{*split_dim(s.from)};
            if (*split_dim(s.to) != dims[0]) dims.push_back(*split_dim(s.to));
            return dims;
          },
          [](const LocalEmbed& s) { return std::vector<int>{s.tensor_dim}; },
      },
      step);
}

bool starts_from(const Step& step, const Placements& before, const Dims& mesh_shape) {
  const int m = mesh_dim_of(step);
  if (m < 0 || m >= static_cast<int>(before.size()) || mesh_shape.size() != static_cast<int>(before.size())) return false;
  return starts_right(step, before);
}

bool is_plain_step(const Step& step, const Placements& before, const Dims& mesh_shape) {
  if (!starts_from(step, before, mesh_shape)) return false;
  const int m = mesh_dim_of(step);
  // A LocalChunk from a shard holds only when the layouts say so.
  if (std::holds_alternative<LocalChunk>(step) && !is_replicate(before[m])) return false;
  for (int d : touched_dims(step))
    for (int later = m + 1; later < mesh_shape.size(); ++later)
      if (mesh_shape[later] > 1 && split_dim(before[later]) == d) return false;
  return true;
}

namespace {

bool append_placement(WorkBudget::Key& key, const Placement& p) {
  key.push_back(static_cast<int64_t>(p.index()));
  return std::visit(Overloaded{
                        [&](const Shard& s) { return key.push_back(s.dim), true; },
                        [&](const StridedShard& s) { return key.insert(key.end(), {s.dim, s.split_factor}), true; },
                        [](const Replicate&) { return true; },
                        [&](const Partial& s) { return key.push_back(static_cast<int64_t>(s.op)), true; },
                        [](const RaggedShard&) { return false; },
                    },
                    p);
}

int64_t wire_code(const std::optional<kernels::DType>& wire) { return wire ? static_cast<int64_t>(*wire) : -1; }

}  // namespace

bool step_key(int64_t tag, const Step& step, const Placements& before, const Dims& global_shape,
              const Dims& mesh_shape, WorkBudget::Key& key) {
  key.assign({tag, static_cast<int64_t>(global_shape.size())});
  key.insert(key.end(), global_shape.begin(), global_shape.end());
  key.push_back(static_cast<int64_t>(mesh_shape.size()));
  key.insert(key.end(), mesh_shape.begin(), mesh_shape.end());
  key.push_back(static_cast<int64_t>(step.index()));
  const bool plain = std::visit(
      Overloaded{
          [&](const AllGather& s) { return key.insert(key.end(), {s.mesh_dim, s.tensor_dim}), true; },
          [&](const StridedAllGather& s) {
            return key.insert(key.end(), {s.mesh_dim, s.tensor_dim, s.split_factor}), true;
          },
          [&](const AllToAll& s) { return key.insert(key.end(), {s.mesh_dim, s.from_dim, s.to_dim}), true; },
          [&](const AllReduce& s) {
            return key.insert(key.end(), {int64_t{s.mesh_dim}, static_cast<int64_t>(s.op), wire_code(s.wire)}), true;
          },
          [&](const ReduceScatter& s) {
            if (s.ragged) return false;
            return key.insert(key.end(), {int64_t{s.mesh_dim}, int64_t{s.tensor_dim}, static_cast<int64_t>(s.op),
                                          int64_t{s.split_factor}, wire_code(s.wire)}),
                   true;
          },
          [&](const LocalChunk& s) { return key.push_back(s.mesh_dim), append_placement(key, s.to); },
          [&](const LocalPartial& s) { return key.insert(key.end(), {s.mesh_dim, static_cast<int>(s.op)}), true; },
          [&](const Regroup& s) {
            key.push_back(s.mesh_dim);
            return append_placement(key, s.from) && append_placement(key, s.to);
          },
          [&](const LocalEmbed& s) { return key.insert(key.end(), {s.mesh_dim, s.tensor_dim}), true; },
      },
      step);
  if (!plain) return false;
  key.push_back(static_cast<int64_t>(before.size()));
  for (const Placement& p : before)
    if (!append_placement(key, p)) return false;
  return true;
}

bool is_valid_step(const Step& step, const Placements& before, const Dims& global_shape, const Dims& mesh_shape,
                   WorkBudget& work) {
  if (!starts_from(step, before, mesh_shape)) return false;
  const Placements after = apply_step(step, before);
  for (const Placements* ps : {&before, &after})
    for (const Placement& p : *ps)
      if (auto d = split_dim(p); d && (*d < 0 || *d >= global_shape.size())) return false;
  if (const std::optional<bool> v = ragged_step_valid(step, before, after, global_shape, mesh_shape)) return *v;
  if (is_plain_step(step, before, mesh_shape)) return true;
  for (int64_t n : global_shape)
    if (n == 0) return true;  // every rank holds nothing after the step
  const int m = mesh_dim_of(step);
  if (std::holds_alternative<LocalChunk>(step) && shard_dim(before[m])) {
    // A shard relabelled in place: valid exactly when the exchange that moves it is, and that
    // exchange delivers nothing to any rank (every rank holds its new layout already).
    const std::optional<Step> exchange = step_between(m, before[m], std::get<LocalChunk>(step).to, /*direct=*/true);
    if (!exchange || !is_valid_step(*exchange, before, global_shape, mesh_shape, work)) return false;
    return step_traffic(*exchange, before, global_shape, mesh_shape, kernels::DType::kU8, work).received == 0;
  }
  // Every touched tensor dim keeps the owners of the later mesh dims (NOTE [layout algebra]).
  for (int t : touched_dims(step)) {
    const SplitList a_chain = chain_of(before, mesh_shape, t), b_chain = chain_of(after, mesh_shape, t);
    if (a_chain == b_chain) continue;
    SplitList prefix, later;
    std::optional<Split> a, b;
    for (const Split& s : a_chain) {
      if (s.mesh_dim < m) prefix.push_back(s);
      else if (s.mesh_dim == m) a = s;
      else later.push_back(s);
    }
    for (const Split& s : b_chain)
      if (s.mesh_dim == m) b = s;
    if (later.empty()) continue;
    if (prefix.empty()) {  // one list: the whole dim
      if (!same_later_owners(global_shape[t], a, b, span_of(later), work)) return false;
      continue;
    }
    for (int64_t n : distinct_sizes(global_shape[t], span_of(prefix), mesh_shape, work))
      if (!same_later_owners(n, a, b, span_of(later), work)) return false;
  }
  return true;
}

bool is_valid_step(const Step& step, const Placements& before, const Dims& global_shape, const Dims& mesh_shape) {
  WorkBudget work(kMaxPlanWork, [&] { return fmt::format("checking {} from [{}]", to_string(step), to_string(before)); });
  return is_valid_step(step, before, global_shape, mesh_shape, work);
}

}  // namespace dtensor
