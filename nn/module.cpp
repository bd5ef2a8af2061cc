#include "nn/module.h"

#include <fmt/format.h>

#include <set>

#include "kernels/error.h"
#include "kernels/format.h"

namespace nn {

using kernels::InvalidArgument;

// ---- Ctx ----

const dtensor::ops::OpOptions& Ctx::ops() const { return options_ ? *options_ : default_options_; }

Ctx& Ctx::child(std::string_view key) {
  auto it = children_.find(std::string(key));
  if (it == children_.end()) {
    auto c = std::make_unique<Ctx>(options_);
    c->recomputing_ = recomputing_;
    it = children_.emplace(std::string(key), std::move(c)).first;
  }
  return *it->second;
}

dtensor::ops::Saved& Ctx::op(size_t i) {
  if (ops_.size() <= i) ops_.resize(i + 1);
  return ops_[i];
}

void Ctx::set_recomputing(bool r) {
  recomputing_ = r;
  for (auto& [k, c] : children_) c->set_recomputing(r);
}

void Ctx::clear() {
  ops_.clear();
  tensors.clear();
  values.clear();
  children_.clear();
}

bool Ctx::empty() const {
  if (!ops_.empty() || !tensors.empty() || !values.empty()) return false;
  for (const auto& [k, c] : children_)
    if (!c->empty()) return false;
  return true;
}

// ---- Module ----

DTensor Module::forward(Ctx& ctx, const DTensor& input) {
  DTensor x = input;
  for (auto& [id, h] : pre_forward_.list) h(*this, ctx, x);
  DTensor y = do_forward(ctx, x);
  for (auto& [id, h] : post_forward_.list) h(*this, ctx, y);
  return y;
}

std::optional<DTensor> Module::backward(Ctx& ctx, const DTensor& grad_output) {
  return backward(ctx, DTensor(grad_output));
}

std::optional<DTensor> Module::backward(Ctx& ctx, DTensor&& grad_output) {
  DTensor dy = std::move(grad_output);
  for (auto& [id, h] : pre_backward_.list) h(*this, ctx, dy);
  std::optional<DTensor> dx = do_backward_owned(ctx, std::move(dy));
  for (auto& [id, h] : post_backward_.list) h(*this, ctx, dx);
  ctx.clear();
  return dx;
}

std::shared_ptr<Parameter> Module::add_parameter(std::string name, std::shared_ptr<Parameter> parameter) {
  if (name.empty() || name.find('.') != std::string::npos)
    throw InvalidArgument(fmt::format("{}: parameter name '{}' must be non-empty without '.'", type_, name));
  for (const auto& [n, p] : params_)
    if (n == name) throw InvalidArgument(fmt::format("{}: parameter '{}' is registered twice", type_, name));
  if (!parameter) throw InvalidArgument(fmt::format("{}: parameter '{}' is null", type_, name));
  params_.emplace_back(std::move(name), parameter);
  return parameter;
}

void Module::replace_parameter(std::string_view name, std::shared_ptr<Parameter> parameter) {
  if (!parameter) throw InvalidArgument(fmt::format("{}: parameter '{}' is null", type_, name));
  for (auto& [n, p] : params_)
    if (n == name) {
      p = std::move(parameter);
      return;
    }
  throw InvalidArgument(fmt::format("{}: no parameter '{}' to replace", type_, name));
}

void Module::add_child(std::string name, std::shared_ptr<Module> module) {
  if (name.find('.') != std::string::npos)
    throw InvalidArgument(fmt::format("{}: child name '{}' must not contain '.'", type_, name));
  for (const auto& [n, m] : children_)
    if (n == name) throw InvalidArgument(fmt::format("{}: child '{}' is registered twice", type_, name));
  if (!module) throw InvalidArgument(fmt::format("{}: child '{}' is null", type_, name));
  children_.emplace_back(std::move(name), std::move(module));
}

namespace {

// An empty child name (a transparent wrapper such as Checkpoint) adds no path component.
std::string join(const std::string& prefix, const std::string& name) {
  if (prefix.empty()) return name;
  if (name.empty()) return prefix;
  return prefix + "." + name;
}

void collect_params(const Module& m, const std::string& prefix, std::set<const Parameter*>& seen,
                    std::vector<std::pair<std::string, std::shared_ptr<Parameter>>>& out,
                    const std::vector<std::pair<std::string, std::shared_ptr<Parameter>>>& own) {
  for (const auto& [n, p] : own)
    if (seen.insert(p.get()).second) out.emplace_back(join(prefix, n), p);
  (void)m;
}

}  // namespace

std::vector<std::pair<std::string, std::shared_ptr<Parameter>>> Module::named_parameters() const {
  std::vector<std::pair<std::string, std::shared_ptr<Parameter>>> out;
  std::set<const Parameter*> seen;
  std::function<void(const Module&, const std::string&)> walk = [&](const Module& m,
                                                                    const std::string& prefix) {
    collect_params(m, prefix, seen, out, m.params_);
    for (const auto& [n, c] : m.children_) walk(*c, join(prefix, n));
  };
  walk(*this, "");
  return out;
}

std::vector<std::pair<std::string, Module*>> Module::named_modules() {
  std::vector<std::pair<std::string, Module*>> out;
  std::function<void(Module&, const std::string&)> walk = [&](Module& m, const std::string& prefix) {
    out.emplace_back(prefix, &m);
    for (const auto& [n, c] : m.children_) walk(*c, join(prefix, n));
  };
  walk(*this, "");
  return out;
}

Module& Module::module(std::string_view fqn) {
  Module* found = nullptr;  // the innermost of a transparent wrapper and its module
  for (auto& [n, m] : named_modules())
    if (n == fqn) found = m;
  if (found) return *found;
  throw InvalidArgument(fmt::format("{}: no submodule named '{}'", type_, fqn));
}

Parameter& Module::parameter(std::string_view fqn) {
  for (auto& [n, p] : named_parameters())
    if (n == fqn) return *p;
  throw InvalidArgument(fmt::format("{}: no parameter named '{}'", type_, fqn));
}

int Module::register_forward_pre_hook(ForwardPreHook hook) {
  pre_forward_.list.emplace_back(next_hook_id_, std::move(hook));
  return next_hook_id_++;
}
int Module::register_forward_hook(ForwardHook hook) {
  post_forward_.list.emplace_back(next_hook_id_, std::move(hook));
  return next_hook_id_++;
}
int Module::register_backward_pre_hook(BackwardPreHook hook) {
  pre_backward_.list.emplace_back(next_hook_id_, std::move(hook));
  return next_hook_id_++;
}
int Module::register_backward_hook(BackwardHook hook) {
  post_backward_.list.emplace_back(next_hook_id_, std::move(hook));
  return next_hook_id_++;
}

bool Module::remove_hook(int id) {
  auto erase = [id](auto& list) {
    for (auto it = list.begin(); it != list.end(); ++it)
      if (it->first == id) {
        list.erase(it);
        return true;
      }
    return false;
  };
  return erase(pre_forward_.list) || erase(post_forward_.list) || erase(pre_backward_.list) ||
         erase(post_backward_.list);
}

StateDict Module::state_dict() const {
  StateDict sd;
  for (const auto& [name, p] : named_parameters()) sd.tensors.emplace_back(name, p->data());
  return sd;
}

void Module::load_state_dict(const StateDict& sd, bool strict) {
  const auto params = named_parameters();
  std::set<std::string> names;
  for (const auto& [name, p] : params) {
    names.insert(name);
    const DTensor* t = sd.find(name);
    if (!t) throw InvalidArgument(fmt::format("{}: load_state_dict: the state dict has no '{}'", type_, name));
    if (!(t->shape() == p->shape()))
      throw InvalidArgument(fmt::format("{}: load_state_dict: '{}' has shape {} in the state dict, the parameter {}",
                                        type_, name, t->shape(), p->shape()));
    if (p->is_meta())
      throw InvalidArgument(fmt::format("{}: load_state_dict: parameter '{}' is meta (materialize first)", type_, name));
  }
  if (strict)
    for (const auto& [k, t] : sd.tensors)
      if (!names.count(k))
        throw InvalidArgument(fmt::format("{}: load_state_dict: unexpected key '{}' (no such parameter)", type_, k));
  for (const auto& [name, p] : params) copy_into(name, p->data(), *sd.find(name));
}

void Module::requires_grad_(bool requires_grad) {
  for (auto& [n, p] : named_parameters()) p->requires_grad = requires_grad;
}

void Module::zero_grad(bool set_to_none) {
  for (auto& [n, p] : named_parameters()) p->zero_grad(set_to_none);
}

// ---- Sequential ----

void Sequential::append(std::shared_ptr<Module> module) {
  add_child(std::to_string(children().size()), std::move(module));
}

DTensor Sequential::do_forward(Ctx& ctx, const DTensor& input) {
  DTensor x = input;
  for (const auto& [n, m] : children()) x = m->forward(ctx.child(n), x);
  return x;
}

std::optional<DTensor> Sequential::do_backward(Ctx& ctx, const DTensor& grad_output) {
  return do_backward_owned(ctx, grad_output);
}

// Each child takes its gradient over: none outlives the child that reads it.
std::optional<DTensor> Sequential::do_backward_owned(Ctx& ctx, DTensor grad_output) {
  std::optional<DTensor> dy = std::move(grad_output);
  for (auto it = children().rbegin(); it != children().rend(); ++it) {
    if (!dy)
      throw InvalidArgument(
          fmt::format("Sequential: child '{}' needs a gradient but its successor returned none", it->first));
    DTensor g = std::move(*dy);
    dy.reset();
    dy = it->second->backward(ctx.child(it->first), std::move(g));
  }
  return dy;
}

void materialize(Module& module, uint64_t seed, bool reinit) {
  for (auto& [name, p] : module.named_parameters())
    if (p->is_meta() || reinit) p->materialize(seed, name);
}

void to_empty(Module& module) {
  for (auto& [name, p] : module.named_parameters())
    if (p->is_meta()) p->to_empty(name);
}

}  // namespace nn
