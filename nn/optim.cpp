#include "nn/optim.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <set>

#include "kernels/error.h"
#include "kernels/format.h"
#include "kernels/ops/elementwise.h"
#include "kernels/ops/reduction.h"

namespace nn {

using dtensor::Partial;
using dtensor::Replicate;
using kernels::InvalidArgument;

namespace {

// A zero state tensor for parameter value d: its shape, dtype and placements, on its device (a
// CUDA parameter's state is CUDA memory), from the mesh's allocator (so a trainer's memory limit
// and peak count it).
DTensor zero_state(const DTensor& d) {
  const auto& comms = d.comms();
  if (!comms->in_mesh()) return dtensor::zeros(d.shape(), d.dtype(), comms, d.placements(), d.to_local().device());
  dtensor::DTensorSpec spec = dtensor::make_spec(std::shared_ptr<const dtensor::DeviceMesh>(comms, &comms->mesh()),
                                                 d.placements(), d.shape(), d.dtype());
  Tensor local = Tensor::empty(d.to_local().shape(), d.dtype(), d.to_local().device(), comms->allocator());
  local.fill_(0.0);
  return DTensor(comms, spec, local);
}

}  // namespace

// ---- Optimizer ----

Optimizer::Optimizer(NamedParameters params) : params_(std::move(params)), state_(params_.size()) {
  for (const auto& [n, p] : params_)
    if (!p) throw InvalidArgument(fmt::format("optimizer: parameter '{}' is null", n));
}

void Optimizer::zero_grad(bool set_to_none) {
  for (auto& [n, p] : params_) p->zero_grad(set_to_none);
}

const DTensor& Optimizer::state(std::string_view name, std::string_view key) const {
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].first == name)
      for (const auto& [k, t] : state_[i].tensors)
        if (k == key) return t;
  throw InvalidArgument(fmt::format("optimizer: no state '{}' for parameter '{}'", key, name));
}

const DTensor* Optimizer::checked_grad(size_t i) const {
  const auto& [name, p] = params_[i];
  if (!p->grad() || !p->requires_grad) return nullptr;
  const DTensor& g = *p->grad();
  const DTensor& d = p->data();
  if (!(g.placements() == d.placements()))
    throw InvalidArgument(fmt::format(
        "optimizer: the gradient of '{}' has placements [{}] but the parameter [{}]; reduce the gradients "
        "first (nn::reduce_gradients, or FSDP's reduce-scatter)",
        name, dtensor::to_string(g.placements()), dtensor::to_string(d.placements())));
  if (!(g.shape() == d.shape()))
    throw InvalidArgument(fmt::format("optimizer: the gradient of '{}' has shape {}, the parameter {}", name,
                                      g.shape(), d.shape()));
  return &g;
}

DTensor& Optimizer::state_tensor(size_t i, const std::string& key) {
  for (auto& [k, t] : state_[i].tensors)
    if (k == key) {
      const DTensor& d = params_[i].second->data();
      if (!(t.placements() == d.placements()))
        throw InvalidArgument(fmt::format(
            "optimizer: parameter '{}' moved from [{}] to [{}] after its state was "
            "created; the state stays with the first placements",
            params_[i].first, dtensor::to_string(t.placements()), dtensor::to_string(d.placements())));
      return t;
    }
  const DTensor& d = params_[i].second->data();
  state_[i].tensors.emplace_back(key, zero_state(d));
  return state_[i].tensors.back().second;
}

int64_t Optimizer::step_count(std::string_view name) const {
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].first == name) return state_[i].step;
  throw InvalidArgument(fmt::format("optimizer: no parameter '{}'", name));
}

StateDict Optimizer::state_dict() const {
  StateDict sd;
  for (size_t i = 0; i < params_.size(); ++i) {
    const std::string& name = params_[i].first;
    if (state_[i].step == 0 && state_[i].tensors.empty()) continue;
    for (const auto& [k, t] : state_[i].tensors) sd.tensors.emplace_back("state." + name + "." + k, t);
    sd.values["state." + name + ".step"] = state_[i].step;
  }
  return sd;
}

void Optimizer::init_state() {
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].second->requires_grad)
      for (const std::string& k : state_keys()) state_tensor(i, k);
}

void Optimizer::load_state_dict(const StateDict& sd, bool strict) {
  const std::vector<std::string> keys = state_keys();
  std::set<std::string> known;
  std::vector<std::optional<int64_t>> steps(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const std::string base = "state." + params_[i].first + ".";
    known.insert(base + "step");
    for (const std::string& k : keys) known.insert(base + k);
    if (sd.values.count(base + "step")) {
      steps[i] = sd.int_value(base + "step");
    } else if (const DTensor* t = sd.find(base + "step")) {
      if (t->shape().product() != 1)
        throw InvalidArgument(fmt::format("optimizer: load_state_dict: '{}step' has shape {}, expected one element",
                                          base, t->shape()));
      steps[i] = static_cast<int64_t>(t->full_tensor().to(kernels::Device{}).reshape({1}).item({0}));
    }
    if (!steps[i]) {
      for (const std::string& k : keys)
        if (sd.find(base + k))
          throw InvalidArgument(fmt::format("optimizer: load_state_dict: '{}{}' is given but not '{}step'", base, k, base));
      continue;
    }
    if (*steps[i] < 0)
      throw InvalidArgument(fmt::format("optimizer: load_state_dict: '{}step' is {}, expected >= 0", base, *steps[i]));
    const Parameter& p = *params_[i].second;
    for (const std::string& k : keys) {
      const DTensor* t = sd.find(base + k);
      if (!t) throw InvalidArgument(fmt::format("optimizer: load_state_dict: the state dict has no '{}{}'", base, k));
      if (!(t->shape() == p.shape()))
        throw InvalidArgument(fmt::format("optimizer: load_state_dict: '{}{}' has shape {}, the parameter {}", base, k,
                                          t->shape(), p.shape()));
    }
  }
  if (strict) {
    for (const auto& [k, t] : sd.tensors)
      if (!known.count(k)) throw InvalidArgument(fmt::format("optimizer: load_state_dict: unexpected key '{}'", k));
    for (const auto& [k, v] : sd.values)
      if (!known.count(k)) throw InvalidArgument(fmt::format("optimizer: load_state_dict: unexpected key '{}'", k));
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!steps[i]) {
      state_[i] = State{};
      continue;
    }
    const std::string base = "state." + params_[i].first + ".";
    State fresh;
    fresh.step = *steps[i];
    const DTensor& d = params_[i].second->data();
    for (const std::string& k : keys) {
      // Reuse the existing state tensor (a checkpoint may have been loaded into it in place).
      std::optional<DTensor> existing;
      for (const auto& [ek, et] : state_[i].tensors)
        if (ek == k && et.placements() == d.placements() && et.dtype() == d.dtype()) existing = et;
      DTensor t = existing ? *existing : zero_state(d);
      const DTensor& src = *sd.find(base + k);
      if (!(src.to_local().defined() && t.to_local().defined() &&
            src.to_local().shares_storage_with(t.to_local()) &&
            src.to_local().storage_offset() == t.to_local().storage_offset()))
        copy_into(base + k, t, src);
      fresh.tensors.emplace_back(k, std::move(t));
    }
    state_[i] = std::move(fresh);
  }
}

// ---- SGD / AdamW ----

std::vector<std::string> SGD::state_keys() const {
  if (options.momentum == 0) return {};
  return {"momentum_buffer"};
}

std::vector<std::string> AdamW::state_keys() const {
  if (options.amsgrad) return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  return {"exp_avg", "exp_avg_sq"};
}


SGD::SGD(NamedParameters params, kernels::SgdOptions o) : Optimizer(std::move(params)), options(o) {}

void SGD::step() {
  for (size_t i = 0; i < params_.size(); ++i) {
    const DTensor* g = checked_grad(i);
    if (!g) continue;
    const DTensor& p = params_[i].second->data();
    const bool first = state_[i].step == 0;
    ++state_[i].step;
    Tensor buf = options.momentum != 0 ? state_tensor(i, "momentum_buffer").to_local() : Tensor();
    if (p.comms()->in_mesh()) kernels::sgd_step(p.to_local(), g->to_local(), buf, first, options);
  }
}

AdamW::AdamW(NamedParameters params, kernels::AdamWOptions o) : Optimizer(std::move(params)), options(o) {}

void AdamW::step() {
  for (size_t i = 0; i < params_.size(); ++i) {
    const DTensor* g = checked_grad(i);
    if (!g) continue;
    const DTensor& p = params_[i].second->data();
    const int64_t step = ++state_[i].step;
    Tensor m = state_tensor(i, "exp_avg").to_local();
    Tensor v = state_tensor(i, "exp_avg_sq").to_local();
    Tensor vmax = options.amsgrad ? state_tensor(i, "max_exp_avg_sq").to_local() : Tensor();
    if (p.comms()->in_mesh()) kernels::adamw_step(p.to_local(), g->to_local(), m, v, vmax, step, options);
  }
}

// ---- gradient reduction ----

void reduce_gradients(const NamedParameters& params) {
  // Group by (mesh communicators, source and target placements, dtype): one batched
  // redistribute per group, in the parameters' order (the same on every rank).
  struct Group {
    std::vector<size_t> members;
    std::vector<DTensor> grads;
  };
  std::vector<std::pair<std::string, Group>> groups;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i].second;
    if (!p->grad() || !p->requires_grad) continue;
    const DTensor& g = *p->grad();
    if (g.placements() == p->placements()) continue;
    const std::string key = fmt::format("{}|{}|{}|{}", static_cast<const void*>(g.comms().get()),
                                        dtensor::to_string(g.placements()),
                                        dtensor::to_string(p->placements()), kernels::to_string(g.dtype()));
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& e) { return e.first == key; });
    if (it == groups.end()) {
      groups.emplace_back(key, Group{});
      it = groups.end() - 1;
    }
    it->second.members.push_back(i);
    it->second.grads.push_back(g);
  }
  for (auto& [key, group] : groups) {
    const Placements& target = params[group.members[0]].second->placements();
    std::vector<DTensor> out = dtensor::redistribute_batch(group.grads, target);
    for (size_t j = 0; j < group.members.size(); ++j)
      params[group.members[j]].second->grad() = std::move(out[j]);
  }
}

// ---- clipping ----

double clip_grad_norm_(const NamedParameters& params, double max_norm, double norm_type,
                       bool error_if_nonfinite) {
  const bool inf_norm = std::isinf(norm_type);
  if (!inf_norm && norm_type != 2.0)
    throw InvalidArgument(
        fmt::format("clip_grad_norm_: norm_type {} is not supported (2 or inf)", norm_type));
  std::vector<const DTensor*> grads;
  std::vector<std::string> names;
  for (const auto& [n, p] : params)
    if (p->grad() && p->requires_grad) {
      grads.push_back(&*p->grad());
      names.push_back(n);
    }
  if (grads.empty()) return 0.0;
  // Per-parameter meshes (expert parallelism carved from dp): the gradients split by mesh, in
  // order of first appearance (the same on every rank); one reduction per mesh, then the
  // meshes' totals (each replicated) combine locally.
  std::vector<std::vector<size_t>> by_mesh;
  for (size_t i = 0; i < grads.size(); ++i) {
    size_t at = by_mesh.size();
    for (size_t b = 0; b < by_mesh.size(); ++b)
      if (grads[by_mesh[b].front()]->device_mesh() == grads[i]->device_mesh()) at = b;
    if (at == by_mesh.size()) by_mesh.emplace_back();
    by_mesh[at].push_back(i);
  }
  double reduced = 0.0;
  for (const std::vector<size_t>& members : by_mesh) {
    const auto& comms = grads[members.front()]->comms();
    const dtensor::DeviceMesh& mesh = comms->mesh();
    const int mesh_ndim = mesh.ndim();
    // The mesh dims any gradient is sharded over: the total is reduced over exactly those.
    std::vector<char> reduce(mesh_ndim, 0);
    for (size_t i : members) {
      for (int m = 0; m < mesh_ndim; ++m) {
        if (mesh.size(m) == 1) continue;
        const auto& pl = grads[i]->placements()[m];
        if (dtensor::is_partial(pl))
          throw InvalidArgument(
              fmt::format("clip_grad_norm_: the gradient of '{}' is still {} on mesh dim {}: its norm is not "
                          "the sum of the "
                          "ranks' norms; call nn::reduce_gradients (or finish FSDP's reduce-scatter) first",
                          names[i], dtensor::to_string(pl), m));
        if (dtensor::shard_dim(pl) || dtensor::is_ragged(pl)) reduce[m] = 1;  // Rg: FSDP's flat shards
      }
    }
    double local = 0.0;
    const dtensor::Dims coord = comms->in_mesh() ? comms->coord() : dtensor::Dims{};
    if (comms->in_mesh()) {
      for (size_t i : members) {
        const DTensor* g = grads[i];
        // A gradient replicated over a mesh dim we reduce over counts on coordinate 0 only.
        bool counts = true;
        for (int m = 0; m < mesh_ndim; ++m)
          if (reduce[m] && dtensor::is_replicate(g->placements()[m]) && coord[m] != 0) counts = false;
        const Tensor& l = g->to_local();
        if (!counts || l.numel() == 0) continue;
        if (inf_norm) {
          // max skips NaN; the norm must not (as torch's): a NaN anywhere makes the sum of squares
          // (accumulated in f64) NaN.
          if (std::isnan(kernels::sum_of_squares(l).item({}))) {
            local = std::numeric_limits<double>::quiet_NaN();
            continue;
          }
          if (std::isnan(local)) continue;
          const Tensor flat = l.reshape({l.numel()});
          const double hi = kernels::max(flat, 0).values.item({});
          const double lo = -kernels::max(kernels::scale(flat, -1.0), 0).values.item({});
          local = std::max({local, std::abs(hi), std::abs(lo)});
        } else {
          local += kernels::sum_of_squares(l).item({});
        }
      }
    }
    Placements pl(mesh_ndim, Replicate{});
    for (int m = 0; m < mesh_ndim; ++m)
      if (reduce[m]) pl[m] = Partial{inf_norm ? dtensor::ReduceOp::kMax : dtensor::ReduceOp::kSum};
    dtensor::DTensorSpec spec = dtensor::make_spec(grads[members.front()]->spec().mesh, pl, {1}, DType::kF64);
    const kernels::Device device = grads[members.front()]->to_local().device();
    Tensor t = comms->in_mesh() ? Tensor::full({1}, local, DType::kF64, device)
                                : Tensor::empty({0}, DType::kF64, device);
    DTensor total(comms, spec, t);
    total = total.redistribute(Placements(mesh_ndim, Replicate{}));
    const double part = comms->in_mesh() ? total.to_local().item({0}) : 0.0;
    if (!inf_norm) reduced += part;
    else if (std::isnan(part) || std::isnan(reduced)) reduced = std::numeric_limits<double>::quiet_NaN();
    else reduced = std::max(reduced, part);
  }
  const double norm = inf_norm ? reduced : std::sqrt(reduced);
  if (error_if_nonfinite && !std::isfinite(norm))
    throw kernels::NonFiniteError(fmt::format(
        "clip_grad_norm_: the total norm of order {} of the gradients is {} (non-finite), so they cannot be clipped",
        norm_type, norm));
  if (max_norm > 0) {
    const double coef = max_norm / (norm + 1e-6);
    if (coef < 1.0)
      for (const DTensor* g : grads)
        if (g->comms()->in_mesh()) kernels::scale_out(g->to_local(), g->to_local(), coef);
  }
  return norm;
}

}  // namespace nn
