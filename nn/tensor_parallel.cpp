#include "nn/tensor_parallel.h"

#include <fmt/format.h>

#include <map>

#include "kernels/error.h"
#include "nn/moe.h"

namespace nn {

using dtensor::Partial;
using dtensor::Replicate;
using dtensor::Shard;
using kernels::InvalidArgument;

namespace {

Placement normalized(const Placement& p, int ndim) { return dtensor::normalize(p, ndim); }

// The placement a gradient takes for a tensor held as `given` on one mesh dim: S stays S, P
// becomes R, R stays R (strict) or keeps a Partial gradient (not strict).
Placement grad_placement(const Placement& given, const Placement& grad, bool strict) {
  if (dtensor::is_partial(given)) return Replicate{};
  if (dtensor::is_replicate(given))
    return !strict && dtensor::is_partial(grad) ? grad : Placement{Replicate{}};
  return given;
}

void set_tp_placement(Parameter* p, int tp, const Placement& placement) {
  if (!p) return;
  Placements pl = p->placements();
  if (tp < 0 || tp >= static_cast<int>(pl.size()))
    throw InvalidArgument(
        fmt::format("tensor parallel: mesh dim {} does not exist on a {}-d mesh", tp, pl.size()));
  pl[tp] = placement;
  p->set_placements(pl);
}

std::string hook_key(const char* what, int id) { return fmt::format("tp.{}.{}", what, id); }

}  // namespace

// ---- hooks ----

void add_input_redistribute(Module& module, int mesh_dim, Placement desired, bool strict) {
  // Each registration keeps its own record in the call's ctx, under a key unique per hook.
  auto key = std::make_shared<std::string>();
  const int id = module.register_forward_pre_hook([=](Module&, Ctx& ctx, DTensor& x) {
    const Placement want = normalized(desired, x.spec().tensor_ndim());
    const Placements given = x.placements();
    if (!(given[mesh_dim] == want)) {
      Placements to = given;
      to[mesh_dim] = want;
      x = x.redistribute(to, {ctx.ops().choose.planner});
      ctx.values[*key] = given;
    } else if (strict) {
      ctx.values[*key] = given;
    }
  });
  *key = hook_key("in", id);
  module.register_backward_hook([=](Module&, Ctx& ctx, std::optional<DTensor>& dx) {
    auto it = ctx.values.find(*key);
    if (it == ctx.values.end() || !dx) return;
    const Placements& given = std::any_cast<const Placements&>(it->second);
    Placements to = dx->placements();
    to[mesh_dim] = grad_placement(given[mesh_dim], to[mesh_dim], /*strict=*/true);
    if (!(to == dx->placements())) dx = dx->redistribute(to, {ctx.ops().choose.planner});
  });
}

void add_output_redistribute(Module& module, int mesh_dim, Placement desired) {
  auto key = std::make_shared<std::string>();
  const int id = module.register_forward_hook([=](Module&, Ctx& ctx, DTensor& y) {
    const Placement want = normalized(desired, y.spec().tensor_ndim());
    const Placements before = y.placements();
    if (before[mesh_dim] == want) return;
    Placements to = before;
    to[mesh_dim] = want;
    y = y.redistribute(to, {ctx.ops().choose.planner});
    ctx.values[*key] = before;
  });
  *key = hook_key("out", id);
  module.register_backward_pre_hook([=](Module&, Ctx& ctx, DTensor& dy) {
    auto it = ctx.values.find(*key);
    if (it == ctx.values.end()) return;
    const Placements& before = std::any_cast<const Placements&>(it->second);
    Placements to = dy.placements();
    to[mesh_dim] = grad_placement(before[mesh_dim], to[mesh_dim], /*strict=*/false);
    if (!(to == dy.placements())) dy = dy.redistribute(to, {ctx.ops().choose.planner});
  });
}

// ---- styles ----

std::string ColwiseParallel::name() const {
  return fmt::format("ColwiseParallel({})", dtensor::to_string(output_));
}
std::string RowwiseParallel::name() const {
  return fmt::format("RowwiseParallel({})", dtensor::to_string(output_));
}
std::string MoETensorParallel::name() const {
  return fmt::format("MoETensorParallel({})", dtensor::to_string(output_));
}
std::string SequenceParallel::name() const { return fmt::format("SequenceParallel({})", dim_); }
std::string PrepareModuleInput::name() const {
  return fmt::format("PrepareModuleInput({})", dtensor::to_string(desired_));
}
std::string PrepareModuleOutput::name() const {
  return fmt::format("PrepareModuleOutput({})", dtensor::to_string(desired_));
}

namespace {

[[noreturn]] void unsupported_module(const ParallelStyle& style, const Module& m, std::string_view fqn) {
  throw InvalidArgument(fmt::format("{} cannot apply to '{}' (a {}): it shards Linear and Embedding layers{}",
                                    style.name(), fqn, m.type(),
                                    m.type() == "Checkpoint" ? " (name the wrapped module's children)" : ""));
}

}  // namespace

void ColwiseParallel::apply(Module& module, std::string_view fqn, int tp) const {
  if (auto* l = dynamic_cast<Linear*>(&module)) {
    set_tp_placement(&l->weight(), tp, Shard{0});
    set_tp_placement(l->bias(), tp, Shard{0});
  } else if (auto* e = dynamic_cast<Embedding*>(&module)) {
    set_tp_placement(&e->weight(), tp, Shard{1});
  } else {
    unsupported_module(*this, module, fqn);
  }
  add_input_redistribute(module, tp, Replicate{}, /*strict=*/false);
  if (!(output_ == Placement{Shard{-1}})) add_output_redistribute(module, tp, output_);
}

void RowwiseParallel::apply(Module& module, std::string_view fqn, int tp) const {
  if (dtensor::is_partial(output_))
    throw InvalidArgument(
        fmt::format("{} on '{}': the output layout must be Replicate or Shard", name(), fqn));
  if (auto* l = dynamic_cast<Linear*>(&module)) {
    set_tp_placement(&l->weight(), tp, Shard{1});
    set_tp_placement(l->bias(), tp, Replicate{});
    add_input_redistribute(module, tp, Shard{-1}, /*strict=*/false);
    l->set_output_reduction(tp, output_);
  } else if (auto* e = dynamic_cast<Embedding*>(&module)) {
    set_tp_placement(&e->weight(), tp, Shard{0});
    add_input_redistribute(module, tp, Replicate{}, /*strict=*/false);
    add_output_redistribute(module, tp, output_);
  } else {
    unsupported_module(*this, module, fqn);
  }
}

void MoETensorParallel::apply(Module& module, std::string_view fqn, int tp) const {
  auto* moe = dynamic_cast<MoE*>(&module);
  if (!moe)
    throw InvalidArgument(fmt::format("{} cannot apply to '{}' (a {}): it applies to MoE blocks", name(), fqn,
                                      module.type()));
  if (dtensor::is_partial(output_))
    throw InvalidArgument(fmt::format("{} on '{}': the output layout must be Replicate or Shard", name(), fqn));
  moe->set_tensor_parallel(tp);
  set_tp_placement(&moe->router(), tp, Replicate{});
  if (MLP* shared = moe->shared_expert()) {
    // fc1 column-wise (input R, output S(-1)), fc2 row-wise without a reduction: Partial, as the
    // routed experts' output it is added to.
    ColwiseParallel().apply(shared->fc1(), fmt::format("{}.shared.fc1", fqn), tp);
    set_tp_placement(&shared->fc2().weight(), tp, Shard{1});
    add_input_redistribute(shared->fc2(), tp, Shard{-1}, /*strict=*/false);
  }
  add_input_redistribute(module, tp, Replicate{}, /*strict=*/true);
  add_output_redistribute(module, tp, output_);
}

void SequenceParallel::apply(Module& module, std::string_view fqn, int tp) const {
  if (!dynamic_cast<LayerNorm*>(&module) && !dynamic_cast<RMSNorm*>(&module))
    throw InvalidArgument(fmt::format("{} cannot apply to '{}' (a {}): it applies to LayerNorm and RMSNorm",
                                      name(), fqn, module.type()));
  for (auto& [n, p] : module.named_parameters()) set_tp_placement(p.get(), tp, Replicate{});
  add_input_redistribute(module, tp, Shard{dim_}, /*strict=*/true);
}

void PrepareModuleInput::apply(Module& module, std::string_view, int tp) const {
  add_input_redistribute(module, tp, desired_, /*strict=*/true);
}

void PrepareModuleOutput::apply(Module& module, std::string_view, int tp) const {
  add_output_redistribute(module, tp, desired_);
}

// ---- plan ----

namespace {

std::vector<std::string> split_name(std::string_view s) {
  std::vector<std::string> out;
  if (s.empty()) return out;
  size_t start = 0;
  while (true) {
    const size_t dot = s.find('.', start);
    out.emplace_back(s.substr(start, dot == std::string_view::npos ? std::string_view::npos : dot - start));
    if (dot == std::string_view::npos) break;
    start = dot + 1;
  }
  return out;
}

bool matches(const std::string& pattern, const std::string& name) {
  const auto p = split_name(pattern), n = split_name(name);
  if (p.size() != n.size()) return false;
  for (size_t i = 0; i < p.size(); ++i)
    if (p[i] != "*" && p[i] != n[i]) return false;
  return true;
}

}  // namespace

void parallelize_module(Module& root, int tp_mesh_dim, const ParallelPlan& plan) {
  auto modules = root.named_modules();
  // A name reached twice (a transparent wrapper and its module): the innermost one.
  std::map<std::string, Module*> by_name;
  for (auto& [n, m] : modules) by_name[n] = m;
  // Tied parameters: the placement each style gave, to catch contradictions.
  std::map<const Parameter*, std::pair<std::string, Placement>> given;
  for (const auto& [pattern, style] : plan) {
    if (!style) throw InvalidArgument(fmt::format("parallelize_module: the style for '{}' is null", pattern));
    int hits = 0;
    for (auto& [name, m] : by_name) {
      if (!matches(pattern, name)) continue;
      ++hits;
      std::vector<std::pair<std::string, std::shared_ptr<Parameter>>> params = m->named_parameters();
      std::vector<Placement> before;
      for (auto& [pn, p] : params) before.push_back(p->placements()[tp_mesh_dim]);
      style->apply(*m, name, tp_mesh_dim);
      // A parameter this style moved that another module's style (tied weights) moved before.
      for (size_t i = 0; i < params.size(); ++i) {
        const auto& [pn, p] = params[i];
        const Placement pl = p->placements()[tp_mesh_dim];
        const std::string full = name.empty() ? pn : name + "." + pn;
        if (pl == before[i]) continue;
        auto [it, fresh] = given.emplace(p.get(), std::make_pair(full, pl));
        if (!fresh && it->second.first != full)
          throw InvalidArgument(fmt::format(
              "parallelize_module: parameter '{}' is shared with '{}' and the plan gives it {} there and {} "
              "here",
              it->second.first, full, dtensor::to_string(it->second.second), dtensor::to_string(pl)));
        it->second = std::make_pair(full, pl);
      }
    }
    if (hits == 0)
      throw InvalidArgument(
          fmt::format("parallelize_module: '{}' ({}) matches no module", pattern, style->name()));
  }
  // Attention split over tp: every rank must hold whole heads.
  for (auto& [name, m] : by_name) {
    auto* attn = dynamic_cast<CausalSelfAttention*>(m);
    if (!attn) continue;
    const Placement q = attn->wq().weight().placements()[tp_mesh_dim];
    if (!(q == Placement{Shard{0}})) continue;
    const int64_t tp = attn->wq().weight().comms()->mesh().size(tp_mesh_dim);
    if (attn->heads() % tp != 0)
      throw InvalidArgument(
          fmt::format("parallelize_module: attention '{}' has {} heads, which do not split evenly over the "
                      "{} ranks of tp "
                      "mesh dim {} (each rank must hold whole heads; use a head count divisible by {})",
                      name, attn->heads(), tp, tp_mesh_dim, tp));
    for (Linear* l : {&attn->wk(), &attn->wv()})
      if (!(l->weight().placements()[tp_mesh_dim] == q))
        throw InvalidArgument(
            fmt::format("parallelize_module: attention '{}': wq is column-sharded but wk/wv are not", name));
  }
}

ParallelPlan gpt_tensor_parallel_plan(const GPTConfig& config, bool sp, bool loss_parallel) {
  const Placement block_out = sp ? Placement{Shard{1}} : Placement{Replicate{}};
  ParallelPlan plan;
  auto add = [&](std::string pattern, std::shared_ptr<const ParallelStyle> style) {
    plan.emplace_back(std::move(pattern), std::move(style));
  };
  add("tok_emb", std::make_shared<RowwiseParallel>(block_out));
  for (const char* norm : {"blocks.*.ln1", "blocks.*.ln2"})
    if (sp) add(norm, std::make_shared<SequenceParallel>(1));
  add("blocks.*.attn", std::make_shared<PrepareModuleInput>(Replicate{}));
  for (const char* l : {"blocks.*.attn.wq", "blocks.*.attn.wk", "blocks.*.attn.wv"})
    add(l, std::make_shared<ColwiseParallel>());
  add("blocks.*.attn.wo", std::make_shared<RowwiseParallel>(block_out));
  bool dense = false, moe = false;  // a pattern must match some block
  for (int64_t i = 0; i < config.layers; ++i) (gpt_block_is_moe(config, i) ? moe : dense) = true;
  if (dense) {
    add("blocks.*.mlp", std::make_shared<PrepareModuleInput>(Replicate{}));
    add("blocks.*.mlp.fc1", std::make_shared<ColwiseParallel>());
    add("blocks.*.mlp.fc2", std::make_shared<RowwiseParallel>(block_out));
  }
  if (moe) add("blocks.*.moe", std::make_shared<MoETensorParallel>(block_out));
  if (sp) add("ln_f", std::make_shared<SequenceParallel>(1));
  // Without sequence parallelism the head's input is replicated: its Partial input gradient is
  // all-reduced once here, at the boundary (with it, the S(1) -> R move does the reduce-scatter).
  if (!sp) add("lm_head", std::make_shared<PrepareModuleInput>(Replicate{}));
  add("lm_head",
      std::make_shared<ColwiseParallel>(loss_parallel ? Placement{Shard{-1}} : Placement{Replicate{}}));
  if (config.layers == 0)  // no blocks: drop their patterns (they would match nothing)
    std::erase_if(plan, [](const auto& e) { return e.first.rfind("blocks.", 0) == 0; });
  return plan;
}

}  // namespace nn
