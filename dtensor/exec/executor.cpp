#include "dtensor/exec/executor.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <exception>

#include "dtensor/exec/issuer.h"
#include "dtensor/exec/recipe.h"
#include "kernels/error.h"

namespace dtensor {

using collectives::Communicator;
using kernels::DType;
using kernels::InvalidArgument;

namespace {

std::string shape_text(const Dims& d) { return fmt::format("[{}]", fmt::join(d, ",")); }

// The caller's out against the result's local shape and the input (one tensor).
void check_out(const Tensor& out, const Tensor& local, const Dims& want, int rank, const Placements& dst) {
  if (!(out.shape() == want))
    throw InvalidArgument(fmt::format("redistribute: out tensor has shape {} but rank {} holds {} of the result under [{}]",
                                      shape_text(out.shape()), rank, shape_text(want), to_string(dst)));
  if (out.device().type != local.device().type)
    throw InvalidArgument(fmt::format("redistribute: out tensor is on {} but the local tensor on {}",
                                      kernels::to_string(out.device()), kernels::to_string(local.device())));
  if (out.dtype() == DType::kF8E4M3 || out.dtype() == DType::kF8E5M2)
    throw InvalidArgument(fmt::format("redistribute: out dtype {} is storage-only", kernels::to_string(out.dtype())));
  if (out.numel() > 0) (void)out.data_ptr();  // throws when its storage is freed
  if (out.numel() > 0 && local.numel() > 0 && out.shares_storage_with(local))
    throw InvalidArgument("redistribute: the out tensor shares storage with the input (the input is never written)");
}

}  // namespace

// ---- ExecHandle ----

void ExecHandle::kick() const {
  for (Communicator* c : used_) c->kick();
}

ExecHandle& ExecHandle::operator=(ExecHandle&& other) noexcept {
  if (this != &other) {
    finish_quietly();
    works_ = std::move(other.works_);
    results_ = std::move(other.results_);
    used_ = std::move(other.used_);
    other.works_.clear();  // a moved-from handle waits for nothing
    other.results_.clear();
    other.used_.clear();
    default_timeout_ = other.default_timeout_;
    done_ = other.done_;
    failed_ = other.failed_;
    other.done_ = 0;
  }
  return *this;
}

ExecHandle::~ExecHandle() { finish_quietly(); }

void ExecHandle::finish_quietly() noexcept {
  if (std::uncaught_exceptions() > 0 || failed_) return;
  try {
    for (; done_ < works_.size(); ++done_) works_[done_]->settle(default_timeout_);
  } catch (...) {  // NOLINT: destructors never throw
  }
}

bool ExecHandle::ready() {
  while (done_ < works_.size() && works_[done_]->completed()) ++done_;
  if (done_ < works_.size()) return false;
  return true;
}

std::span<const Tensor> ExecHandle::wait(Milliseconds timeout) {
  if (done_ == works_.size() && !failed_) return results();
  const kernels::TraceSpan span(used_.empty() ? nullptr : used_[0]->tracer(), used_.empty() ? 0 : used_[0]->global_rank(),
                                "waits", "redistribute wait");
  // One call left (a one-collective transition): its own timeout is the whole budget, no clock.
  const auto deadline = done_ + 1 == works_.size() ? std::chrono::steady_clock::time_point{}
                                                   : std::chrono::steady_clock::now() + timeout;
  for (size_t i = done_; i < works_.size(); ++i) {
    const auto left = i == done_ ? timeout
                                 : std::max(Milliseconds{0}, std::chrono::duration_cast<Milliseconds>(
                                                                 deadline - std::chrono::steady_clock::now()));
    if (!works_[i]->settle(left)) {
      // Out of time: name the call that holds the transition up and where it stands (which ranks
      // never joined it, or what it waits for), then give it up.
      const std::string why = fmt::format("redistribute timed out after {} ms: {}", timeout.count(), works_[i]->describe());
      works_[i]->give_up(why);
      failed_ = true;  // the later calls may never finish: do not wait for them again
      throw kernels::CommError(why);
    }
    try {
      works_[i]->wait(Milliseconds{0});  // finished: returns, or rethrows its failure
    } catch (...) {
      failed_ = true;
      throw;
    }
    done_ = i + 1;
  }
  return results();
}

void ExecHandle::view_results(const Dims& shape) {
  for (Tensor& t : results_) t = t.view(shape);
}

// ---- entry points ----

namespace {

ExecHandle issue_checked(const Plan& plan, std::span<const DTensorSpec> specs, std::span<const Tensor> locals,
                         const MeshComms& comms, const ReducePolicy& policy, std::span<const Tensor> outs);

// The spec of the view a plan on a RaggedShard view runs on (NOTE [ragged plans]).
DTensorSpec view_spec(const Plan& plan, const DTensorSpec& spec) {
  DTensorSpec view = spec;
  view.shape = plan.shapes.front();
  view.stride = Dims::filled(view.shape.size(), 1);
  for (int t = view.shape.size() - 2; t >= 0; --t) view.stride[t] = view.stride[t + 1] * view.shape[t + 1];
  view.placements = plan.src;
  return view;
}

// NOTE [ragged plans] (transition.h): the caller's tensor as the view the plan runs on, and the
// result back as the caller's local shape; both are reshapes of contiguous tensors (the local
// input is copied when it is not contiguous; an out must be).
ExecHandle issue_on_view(const Plan& plan, const DTensorSpec& spec, const Tensor& local, const MeshComms& comms,
                         const ReducePolicy& policy, const Tensor& out) {
  if (spec.placements != plan.user_src)
    throw InvalidArgument(fmt::format("execute: the tensor has placements [{}], the plan starts at [{}]",
                                      to_string(spec.placements), to_string(plan.user_src)));
  if (!plan.valid_for(spec.shape))
    throw InvalidArgument(fmt::format("execute: the tensor has global shape {}, the plan {} was made for {}",
                                      shape_text(spec.shape), to_string(plan), shape_text(plan.tensor_shape)));
  const DTensorSpec view = view_spec(plan, spec);
  if (!comms.in_mesh()) return ExecHandle({}, {out.defined() ? out : local}, collectives::kDefaultTimeout);
  const ShardLayout mine = *spec.layout(comms.rank());
  if (!(local.shape() == mine.local_shape))
    throw InvalidArgument(fmt::format("execute: local tensor of shape {} but rank {} holds {} of {}",
                                      shape_text(local.shape()), comms.rank(), shape_text(mine.local_shape),
                                      to_string(spec)));
  DTensorSpec user_dst = spec;
  user_dst.placements = plan.user_dst;
  const Dims want = user_dst.layout(comms.rank())->local_shape;
  Tensor view_local = (local.is_contiguous() ? local : local.contiguous()).view(view.layout(comms.rank())->local_shape);
  DTensorSpec view_dst = view;
  view_dst.placements = plan.dst;
  const Dims view_want = view_dst.layout(comms.rank())->local_shape;
  Tensor view_out;
  if (out.defined()) {
    if (!(out.shape() == want))
      throw InvalidArgument(fmt::format("execute: out tensor has shape {} but rank {} holds {} of the result under [{}]",
                                        shape_text(out.shape()), comms.rank(), shape_text(want), to_string(plan.user_dst)));
    if (!out.is_contiguous())
      throw InvalidArgument(fmt::format("execute: the out tensor of a plan on a view ({}) must be contiguous",
                                        to_string(plan)));
    view_out = out.view(view_want);
  }
  ExecHandle h = issue_checked(plan, std::span<const DTensorSpec>(&view, 1), std::span<const Tensor>(&view_local, 1),
                               comms, policy,
                               view_out.defined() ? std::span<const Tensor>(&view_out, 1) : std::span<const Tensor>());
  h.view_results(want);
  return h;
}

}  // namespace

ExecHandle issue_batch(const Plan& plan, std::span<const DTensorSpec> specs, std::span<const Tensor> locals,
                       const MeshComms& comms, const ReducePolicy& policy, std::span<const Tensor> outs) {
  if (plan.on_view()) {
    if (specs.size() != 1 || locals.size() != 1 || outs.size() > 1)
      throw kernels::Unsupported(fmt::format("execute_batch: the plan {} is on a RaggedShard view and moves one tensor "
                                             "(given {})", to_string(plan), specs.size()));
    return issue_on_view(plan, specs[0], locals[0], comms, policy, outs.empty() ? Tensor() : outs[0]);
  }
  return issue_checked(plan, specs, locals, comms, policy, outs);
}

namespace {

ExecHandle issue_checked(const Plan& plan, std::span<const DTensorSpec> specs, std::span<const Tensor> locals,
                         const MeshComms& comms, const ReducePolicy& policy, std::span<const Tensor> outs) {
  if (specs.size() != locals.size())
    throw InvalidArgument(fmt::format("execute_batch: {} specs for {} local tensors", specs.size(), locals.size()));
  if (!outs.empty() && outs.size() != specs.size())
    throw InvalidArgument(fmt::format("execute_batch: {} out tensors for {} tensors (give one per tensor, or none)",
                                      outs.size(), specs.size()));
  std::vector<Item> items;
  for (size_t i = 0; i < specs.size(); ++i) {
    const DTensorSpec& s = specs[i];
    if (s.placements != plan.src)
      throw InvalidArgument(fmt::format("execute: tensor {} has placements [{}], the plan starts at [{}]", i,
                                        to_string(s.placements), to_string(plan.src)));
    if (!(*s.mesh == comms.mesh()))
      throw InvalidArgument(fmt::format("execute: tensor {} is on mesh {}, the communicators on {}", i,
                                        to_string(*s.mesh), to_string(comms.mesh())));
    if (s.dtype != specs[0].dtype || locals[i].dtype() != s.dtype)
      throw InvalidArgument(fmt::format("execute: tensor {} has dtype {} (batch dtype {})", i,
                                        kernels::to_string(locals[i].dtype()), kernels::to_string(specs[0].dtype)));
    items.push_back({&s, locals[i]});
  }
  // NOTE [step validity]: a step valid for one global shape may not be for another.
  for (size_t i = 0; i < items.size() && !plan.on_view(); ++i)
    if (!plan.valid_for(items[i].spec->shape))
      throw InvalidArgument(fmt::format("execute: tensor {} has global shape {}, which the plan {} was not made for "
                                        "(plan it for this shape)",
                                        i, shape_text(items[i].spec->shape), to_string(plan)));
  TensorList out_list(outs.begin(), outs.end());
  if (!comms.in_mesh() || items.empty())
    return ExecHandle({}, out_list.empty() ? TensorList(locals.begin(), locals.end()) : out_list,
                      collectives::kDefaultTimeout);
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& it = items[i];
    const ShardLayout l = *it.spec->layout(comms.rank());
    if (!(it.local.shape() == l.local_shape))
      throw InvalidArgument(fmt::format("execute: local tensor of shape {} but rank {} holds {} of {}",
                                        shape_text(it.local.shape()), comms.rank(), shape_text(l.local_shape),
                                        to_string(*it.spec)));
    if (out_list.empty()) continue;
    const Tensor& o = out_list[i];
    DTensorSpec dst = *it.spec;
    dst.placements = plan.dst;
    const ShardLayout want = *dst.layout(comms.rank());
    if (!o.defined() || !(o.shape() == want.local_shape))
      throw InvalidArgument(fmt::format(
          "execute: out tensor {} has shape {} but rank {} holds {} of the result under [{}]", i,
          o.defined() ? shape_text(o.shape()) : std::string("(undefined)"), comms.rank(),
          shape_text(want.local_shape), to_string(plan.dst)));
    if (o.device().type != it.local.device().type)
      throw InvalidArgument(fmt::format("execute: out tensor {} is on {} but the local tensor on {}", i,
                                        kernels::to_string(o.device()), kernels::to_string(it.local.device())));
    if (o.dtype() != out_list[0].dtype())
      throw InvalidArgument(fmt::format("execute: out tensor {} has dtype {}, out tensor 0 {} (one dtype per batch)",
                                        i, kernels::to_string(o.dtype()), kernels::to_string(out_list[0].dtype())));
    if (o.numel() > 0) (void)o.data_ptr();  // throws when its storage is freed
    for (const Tensor& in : locals)
      if (o.numel() > 0 && in.numel() > 0 && o.shares_storage_with(in))
        throw InvalidArgument(fmt::format("execute: out tensor {} shares storage with an input tensor", i));
  }
  return issue_items(comms, plan, items, std::move(out_list), policy);
}

}  // namespace

ExecHandle issue(const Plan& plan, const DTensorSpec& src, const Tensor& local, const MeshComms& comms,
                 const ReducePolicy& policy, const Tensor& out) {
  return issue_batch(plan, std::span<const DTensorSpec>(&src, 1), std::span<const Tensor>(&local, 1), comms, policy,
                     out.defined() ? std::span<const Tensor>(&out, 1) : std::span<const Tensor>());
}

ExecHandle issue_cached(const Transition& t, const Plan& plan, std::shared_ptr<const Recipe> recipe,
                        const DTensorSpec& src, const Tensor& local, const MeshComms& comms, const Tensor& out,
                        bool background) {
  if (!comms.in_mesh()) return ExecHandle({}, {out.defined() ? out : local}, collectives::kDefaultTimeout);
  if (plan.on_view()) {
    // NOTE [ragged plans]: the recipe is of the view; the caller's tensors are reshaped to it.
    const DTensorSpec view = view_spec(plan, src);
    if (!recipe) {
      recipe = make_recipe(RankContext::of(comms), plan, view, t.out_dtype.value_or(src.dtype), t.policy);
      comms.plans().set_recipe(t, recipe);
    }
    if (!(local.shape() == recipe->user_src_local))
      throw InvalidArgument(fmt::format("redistribute: local tensor of shape {} but rank {} holds {} of {}",
                                        shape_text(local.shape()), comms.rank(), shape_text(recipe->user_src_local),
                                        to_string(src)));
    Tensor view_out;
    if (out.defined()) {
      check_out(out, local, recipe->user_dst_local, comms.rank(), plan.user_dst);
      if (!out.is_contiguous())
        throw InvalidArgument(fmt::format("redistribute: the out tensor of a plan on a view ({}) must be contiguous",
                                          to_string(plan)));
      view_out = out.view(recipe->dst_local);
    }
    const Tensor view_local = (local.is_contiguous() ? local : local.contiguous()).view(recipe->src_local);
    ExecHandle h = issue_with_recipe(comms, plan, *recipe, Item{&view, view_local}, view_out, background);
    h.view_results(recipe->user_dst_local);
    return h;
  }
  if (!recipe) {
    recipe = make_recipe(RankContext::of(comms), plan, src, t.out_dtype.value_or(src.dtype), t.policy);
    comms.plans().set_recipe(t, recipe);
  }
  if (!(local.shape() == recipe->src_local))
    throw InvalidArgument(fmt::format("redistribute: local tensor of shape {} but rank {} holds {} of {}",
                                      shape_text(local.shape()), comms.rank(), shape_text(recipe->src_local),
                                      to_string(src)));
  if (out.defined()) check_out(out, local, recipe->dst_local, comms.rank(), plan.dst);
  return issue_with_recipe(comms, plan, *recipe, Item{&src, local}, out, background);
}

ScheduleCost measure_schedule(const Plan& plan, const DTensorSpec& src, const Dims& coord, bool views,
                              int64_t view_max_bytes) {
  RankContext rc;
  rc.mesh_shape = src.mesh->shape();
  rc.coord = coord;
  rc.rank = src.mesh->rank_at(coord);
  rc.views.assign(rc.mesh_shape.size(), views);
  rc.view_max_bytes.assign(rc.mesh_shape.size(), view_max_bytes);
  DTensorSpec spec = src;
  if (plan.on_view()) {  // NOTE [ragged plans]: the schedules are of the view
    spec.shape = plan.shapes.front();
    spec.placements = plan.src;
  }
  const auto start = std::chrono::steady_clock::now();
  const std::shared_ptr<const Recipe> r = make_recipe(rc, plan, spec, src.dtype, {});
  const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
  return {us, r->schedule_bytes()};
}

std::vector<Tensor> execute_batch(const Plan& plan, std::span<const DTensorSpec> specs, std::span<const Tensor> locals,
                                  const MeshComms& comms, const ReducePolicy& policy, std::span<const Tensor> outs) {
  ExecHandle h = issue_batch(plan, specs, locals, comms, policy, outs);
  const std::span<const Tensor> r = h.wait();
  return {r.begin(), r.end()};
}

Tensor execute(const Plan& plan, const DTensorSpec& src, const Tensor& local, const MeshComms& comms,
               const ReducePolicy& policy, const Tensor& out) {
  ExecHandle h = issue(plan, src, local, comms, policy, out);
  return h.wait()[0];
}

}  // namespace dtensor
