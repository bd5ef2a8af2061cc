#include "fsdp/fully_shard.h"

#include "fsdp/group.h"

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <map>
#include <set>

#include "dtensor/layout.h"
#include "fsdp/byte_pack.h"
#include "fsdp/contiguous.h"
#include "fsdp/dp_chunks.h"
#include "fsdp/offload.h"
#include "fsdp/param_mesh.h"
#include "kernels/error.h"
#include "kernels/format.h"
#include "kernels/ops/chunk_cat.h"
#include "kernels/ops/elementwise.h"
#include "kernels/storage.h"
#include "kernels/trace.h"

namespace fsdp {

namespace {

constexpr const char* kExtension = "fsdp";

DTensor cast(const DTensor& d, DType dtype) {
  if (d.dtype() == dtype) return d;
  DTensorSpec spec = d.spec();
  spec.dtype = dtype;
  return DTensor(d.comms(), spec, d.to_local().to(dtype));
}

std::string join_name(const std::string& prefix, const std::string& name) {
  if (prefix.empty()) return name;
  if (name.empty()) return prefix;
  return prefix + "." + name;
}

}  // namespace


void Group::lazy_init() {
  rt = std::make_shared<Runtime>();
  rt->root = this;
  name = name.empty() ? "root" : name;
  std::set<Group*> seen;
  for (nn::Module* m : modules)
    for (auto& [fqn, sub] : m->named_modules()) {
      FSDPModule* st = fsdp::state(*sub);
      if (!st) continue;
      Group* g = &st->group();
      if (!seen.insert(g).second) continue;
      if (g != this) {
        if (g->rt && g->rt->root != this)
          throw InvalidArgument(fmt::format(
              "FSDP: group '{}' already ran under another root; call forward on the outermost module", g->name));
        g->rt = rt;
        g->name = fqn;
      }
      for (auto& f : g->followers) {
        f->rt = rt;
        f->name = fmt::format("{} (on {})", g->name, dtensor::to_string(f->comms->mesh()));
      }
      rt->groups.push_back(g);
    }
}

void Group::on_pre_forward(nn::Ctx& ctx, DTensor& input) {
  if (!rt) lazy_init();
  // A meta parameter anywhere under the root is refused before any state changes (a failed
  // forward leaves every group as it was).
  if (is_root() && fwd_pre == 0 && !ctx.recomputing())
    for (Group* g : rt->groups)
      if (g->state == State::kSharded) g->require_materialized();
  if (ctx.recomputing()) {
    wait_unshard();  // an activation-checkpoint recompute inside backward
  } else if (fwd_pre++ == 0) {
    if (is_root()) rt->current.clear();
    rt->current.push_back(this);
    wait_unshard();
    prefetch(fwd_prefetch ? *fwd_prefetch : implicit_targets(true));
    if (!fwd_prefetch) copy_ahead(true);
  }
  const auto& mp = opts.mp_policy;
  if (mp.param_dtype && mp.cast_forward_inputs && kernels::is_floating_point(input.dtype()) &&
      input.dtype() != *mp.param_dtype) {
    ctx.values["fsdp.input_dtype"] = input.dtype();
    input = cast(input, *mp.param_dtype);
  }
}

void Group::on_post_forward(nn::Ctx& ctx, DTensor& output) {
  const auto& mp = opts.mp_policy;
  if (mp.output_dtype && kernels::is_floating_point(output.dtype()) && output.dtype() != *mp.output_dtype) {
    ctx.values["fsdp.output_dtype"] = output.dtype();
    output = cast(output, *mp.output_dtype);
  }
  if (ctx.recomputing()) return;
  if (++fwd_post < modules.size()) return;
  fwd_pre = fwd_post = 0;
  if (is_root()) rt->order = rt->current;
  if (!reshards_after_forward()) return;
  if (reshard_to_k()) reshard_to_k_buffer();
  else reshard();
}

void Group::on_pre_backward(nn::Ctx& ctx, DTensor& grad_output) {
  auto it = ctx.values.find("fsdp.output_dtype");
  if (it != ctx.values.end()) grad_output = cast(grad_output, std::any_cast<DType>(it->second));
  if (bwd_pre++ != 0) return;
  if (!rt) lazy_init();
  stash_grads();
  wait_unshard();
  if (contiguous()) set_grad_buffers();
  prefetch(bwd_prefetch ? *bwd_prefetch : implicit_targets(false));
  if (!bwd_prefetch) copy_ahead(false);
}

void Group::on_post_backward(nn::Ctx& ctx, std::optional<DTensor>& grad_input) {
  auto it = ctx.values.find("fsdp.input_dtype");
  if (it != ctx.values.end() && grad_input) grad_input = cast(*grad_input, std::any_cast<DType>(it->second));
  if (++bwd_post < modules.size()) return;
  bwd_pre = bwd_post = 0;
  post_backward();
  for (auto& f : followers) f->post_backward();
  if (is_root()) finalize_backward();
}

void Group::finalize_backward() {
  if (is_last_backward) finish_pending_reductions();
  for (Group* g : rt->groups) {
    g->fwd_pre = g->fwd_post = g->bwd_pre = g->bwd_post = 0;
    if (g->state == State::kResharded || g->state == State::kUnsharding) g->reshard();
    else if (g->state == State::kUnsharded && (g->reshard_after_backward || g->requires_gradient_sync)) g->reshard();
  }
  for (Group* g : rt->groups) {  // the optimizer reads and writes the offloaded state next
    if (g->offload) g->offload->drain();
    for (auto& f : g->followers)
      if (f->offload) f->offload->drain();
  }
}

// ---- FSDPModule ----

void UnshardHandle::wait() {
  if (group_) group_->wait_unshard();
}

UnshardHandle FSDPModule::unshard(bool async_op) {
  group_->issue_unshard();
  if (!async_op) group_->wait_unshard();
  return UnshardHandle(group_.get());
}
void FSDPModule::reshard() { group_->reshard(); }

namespace {
// A group and its followers (per-parameter meshes).
std::vector<Group*> own_groups(Group& g) {
  std::vector<Group*> out{&g};
  for (auto& f : g.followers) out.push_back(f.get());
  return out;
}
std::vector<Group*> subtree_groups(Group& g) {
  std::vector<Group*> out{&g};
  for (nn::Module* m : g.modules)
    for (auto& [fqn, sub] : m->named_modules()) {
      FSDPModule* st = fsdp::state(*sub);
      if (st && &st->group() != &g && std::find(out.begin(), out.end(), &st->group()) == out.end())
        out.push_back(&st->group());
    }
  const size_t leaders = out.size();
  for (size_t i = 0; i < leaders; ++i)
    for (auto& f : out[i]->followers) out.push_back(f.get());
  return out;
}
}  // namespace

void FSDPModule::set_requires_gradient_sync(bool sync, bool recurse) {
  for (Group* g : recurse ? subtree_groups(*group_) : own_groups(*group_))
    g->requires_gradient_sync = sync;
}
void FSDPModule::set_reshard_after_backward(bool reshard, bool recurse) {
  for (Group* g : recurse ? subtree_groups(*group_) : own_groups(*group_))
    g->reshard_after_backward = reshard;
}
void FSDPModule::set_reshard_after_forward(ReshardAfterForward mode, bool recurse) {
  for (Group* g : recurse ? subtree_groups(*group_) : own_groups(*group_)) {
    if (mode.kind == ReshardAfterForward::Kind::kInt && !g->k_comms)
      throw InvalidArgument(fmt::format(
          "FSDP group '{}': set_reshard_after_forward({}): reshard_after_forward = k needs the sub-mesh "
          "given at fully_shard (pass it there)",
          g->name, mode.k));
    g->reshard_mode = mode;
  }
}
void FSDPModule::set_requires_all_reduce(bool all_reduce, bool recurse) {
  for (Group* g : recurse ? subtree_groups(*group_) : own_groups(*group_))
    g->requires_all_reduce = all_reduce;
}
void FSDPModule::set_modules_to_forward_prefetch(const std::vector<FSDPModule*>& modules) {
  std::vector<Group*> gs;
  for (FSDPModule* m : modules) {
    if (!m) throw InvalidArgument(fmt::format("FSDP group '{}': a null module in the forward prefetch list", group_->name));
    gs.push_back(m->group_.get());
  }
  if (gs.empty()) group_->fwd_prefetch.reset();  // back to the implicit order
  else group_->fwd_prefetch = gs;
}
void FSDPModule::set_modules_to_backward_prefetch(const std::vector<FSDPModule*>& modules) {
  std::vector<Group*> gs;
  for (FSDPModule* m : modules) {
    if (!m) throw InvalidArgument(fmt::format("FSDP group '{}': a null module in the backward prefetch list", group_->name));
    gs.push_back(m->group_.get());
  }
  if (gs.empty()) group_->bwd_prefetch.reset();
  else group_->bwd_prefetch = gs;
}
void FSDPModule::set_gradient_divide_factor(double factor) {
  if (!(factor > 0))
    throw InvalidArgument(fmt::format("FSDP group '{}': gradient divide factor {}: expected > 0", group_->name, factor));
  group_->divide_factor = factor;
  for (auto& f : group_->followers) f->divide_factor = factor;
}
void FSDPModule::set_is_last_backward(bool last) {
  for (Group* g : subtree_groups(*group_)) g->is_last_backward = last;
}
void FSDPModule::set_prefetch_depth(int depth) {
  if (depth < 0) throw InvalidArgument(fmt::format("FSDP: prefetch depth {}: expected >= 0", depth));
  if (!group_->rt) group_->lazy_init();
  if (!group_->is_root())
    throw InvalidArgument(fmt::format("FSDP group '{}': set_prefetch_depth is a root setting", group_->name));
  group_->rt->prefetch_depth = depth;
}
const std::string& FSDPModule::name() const { return group_->name; }
std::vector<std::string> FSDPModule::parameter_names() const {
  std::vector<std::string> out;
  for (const Group* g : own_groups(*group_))
    for (const Slot& s : g->slots) out.push_back(s.name);
  return out;
}
bool FSDPModule::is_unsharded() const { return group_->state == Group::State::kUnsharded; }
int64_t FSDPModule::unsharded_bytes() const {
  int64_t n = 0;
  for (const Group* g : own_groups(*group_)) {
    if (g->byte_mode())
      n += g->unsharded_numel * static_cast<int64_t>(kernels::itemsize(g->param_dtype)) + g->dp * g->rank_bytes;
    else if (g->contiguous())  // the parameters are views of the all-gather output
      n += g->flat_numel * static_cast<int64_t>(kernels::itemsize(g->param_dtype));
    else
      n += (g->unsharded_numel + g->dp * g->slot_numel) * static_cast<int64_t>(kernels::itemsize(g->param_dtype));
  }
  return n;
}
int64_t FSDPModule::reduce_scatter_input_bytes() const {
  int64_t n = 0;
  for (const Group* g : own_groups(*group_))
    n += g->grad_flat_numel * static_cast<int64_t>(kernels::itemsize(g->reduce_dtype));
  return n;
}
int64_t FSDPModule::sharded_bytes() const {
  int64_t n = 0;
  for (const Group* g : own_groups(*group_)) n += g->slot_numel * static_cast<int64_t>(kernels::itemsize(g->orig_dtype));
  return n;
}
int64_t FSDPModule::resharded_k_bytes() const {
  if (!group_->reshard_to_k()) return 0;
  return group_->k_numel() * static_cast<int64_t>(kernels::itemsize(group_->param_dtype));
}
bool FSDPModule::reshards_after_forward() const { return group_->reshards_after_forward(); }
bool FSDPModule::is_root() const { return group_->is_root(); }
const GroupStats& FSDPModule::stats() const {
  if (group_->followers.empty()) return group_->stats;
  merged_stats_ = group_->stats;  // per-parameter meshes: the sums over every mesh's group
  for (const auto& f : group_->followers) {
    const GroupStats& o = f->stats;
    merged_stats_.all_gathers += o.all_gathers;
    merged_stats_.reduce_scatters += o.reduce_scatters;
    merged_stats_.all_reduces += o.all_reduces;
    merged_stats_.prefetches += o.prefetches;
    merged_stats_.all_gather_bytes += o.all_gather_bytes;
    merged_stats_.extension_bytes += o.extension_bytes;
    merged_stats_.reduce_bytes += o.reduce_bytes;
    merged_stats_.copy_bytes += o.copy_bytes;
  }
  return merged_stats_;
}
const std::string& FSDPModule::note() const { return group_->note; }

int64_t quantize_frozen(nn::Module& module) {
  int64_t released = 0;
  std::set<Group*> done;
  for (auto& [fqn, m] : module.named_modules())
    if (FSDPModule* st = state(*m))
      if (done.insert(&st->group()).second)
        for (Group* g : own_groups(st->group())) released += g->quantize_frozen();  // with its followers
  return released;
}

FSDPModule* state(nn::Module& module) {
  return static_cast<FSDPModule*>(module.find_extension(kExtension).get());
}

dtensor::Unflattening reshard_unflattening(const dtensor::DeviceMesh& mesh, int shard_mesh_dim, int k) {
  const int64_t n = mesh.size(shard_mesh_dim);
  if (k < 1 || n % k != 0)
    throw InvalidArgument(fmt::format("reshard_after_forward = {}: expected a divisor of the dp shard size {}", k, n));
  dtensor::Unflattening u;
  u.mesh_dim = shard_mesh_dim;
  u.sizes = Dims{n / k, k};
  if (mesh.has_names()) {
    const std::string& base = mesh.names()[shard_mesh_dim];
    u.names = {base + "_outer", base + "_inner"};
  }
  return u;
}

// ---- fully_shard ----

namespace {

DataParallelMeshDims resolve_dims(const dtensor::DeviceMesh& mesh, const std::optional<DataParallelMeshDims>& given) {
  if (given) return *given;
  DataParallelMeshDims d;
  if (mesh.has_names()) {
    const auto& n = mesh.names();
    auto find = [&](const char* s) -> std::optional<int> {
      auto it = std::find(n.begin(), n.end(), s);
      if (it == n.end()) return std::nullopt;
      return static_cast<int>(it - n.begin());
    };
    if (auto s = find("dp_shard")) {
      d.shard = *s;
      d.replicate = find("dp_replicate");
      return d;
    }
  }
  if (mesh.ndim() == 1) return d;
  if (mesh.ndim() == 2) return {0, 1};
  throw InvalidArgument(fmt::format(
      "fully_shard: a {}-d mesh {} without dims named dp_shard / dp_replicate: give options.mesh_dims",
      mesh.ndim(), dtensor::to_string(mesh)));
}

}  // namespace

FSDPModule& fully_shard(nn::Module& module, std::shared_ptr<const MeshComms> mesh, const FullyShardOptions& options) {
  return fully_shard(std::vector<nn::Module*>{&module}, std::move(mesh), options);
}

namespace {

// One group on `comms`. given: a follower's parameters (per-parameter meshes), which registers
// no hooks and no module state: its leader drives it.
std::shared_ptr<Group> shard_group(const std::vector<nn::Module*>& modules, std::shared_ptr<const MeshComms> comms,
                                   const FullyShardOptions& options, const detail::NamedParams* given) {
  if (modules.empty()) throw InvalidArgument("fully_shard: no modules given");
  if (!comms) throw InvalidArgument("fully_shard: no mesh given");
  if (options.copy_threads < 0)
    throw InvalidArgument(fmt::format("fully_shard: copy_threads {}: expected 0 (by size) or more", options.copy_threads));
  if (options.layout == Layout::kContiguous) {
    // What the contiguous layout does not do yet, refused before anything changes.
    const char* refused = options.mesh_fn                     ? "per-parameter meshes (mesh_fn)"
                          : options.shard_placement_fn        ? "shard_placement_fn (Shard(d > 0))"
                          : options.all_gather_extension_fn   ? "all-gather extensions (all_gather_extension_fn)"
                          : options.offload_policy.offload_to_cpu ? "CPU offload (offload_policy)"
                                                                  : nullptr;
    if (refused)
      throw Unsupported(fmt::format("fully_shard: layout contiguous does not support {} yet; use Layout::kPadded",
                                    refused));
  }
  auto group = std::make_shared<Group>();
  Group& g = *group;
  g.modules = modules;
  g.comms = comms;
  g.opts = options;
  g.reshard_mode = options.reshard_after_forward;
  g.name = modules.front()->type();
  for (nn::Module* m : modules) {
    if (!m) throw InvalidArgument("fully_shard: a null module");
    if (state(*m))
      throw InvalidArgument(fmt::format("fully_shard: module '{}' is already sharded (one call per module)", m->type()));
  }
  const dtensor::DeviceMesh& mesh = comms->mesh();
  const DataParallelMeshDims dims = resolve_dims(mesh, options.mesh_dims);
  if (dims.shard < 0 || dims.shard >= mesh.ndim() ||
      (dims.replicate && (*dims.replicate < 0 || *dims.replicate >= mesh.ndim() || *dims.replicate == dims.shard)))
    throw InvalidArgument(fmt::format("fully_shard: data-parallel mesh dims (shard {}, replicate {}) invalid for mesh {}",
                                      dims.shard, dims.replicate ? std::to_string(*dims.replicate) : "none",
                                      dtensor::to_string(mesh)));
  g.shard_mesh_dim = dims.shard;
  g.rep_mesh_dim = dims.replicate;
  g.dp_dims = {dims.shard};
  if (dims.replicate) g.dp_dims.push_back(*dims.replicate);
  std::sort(g.dp_dims.begin(), g.dp_dims.end());
  g.dp_index = static_cast<int>(std::find(g.dp_dims.begin(), g.dp_dims.end(), dims.shard) - g.dp_dims.begin());
  g.dp = mesh.size(dims.shard);
  if (!comms->in_mesh()) throw Unsupported("fully_shard: this rank is not in the mesh");
  g.my_coord = comms->coord()[dims.shard];
  g.dp_comms = comms->slice_dims(g.dp_dims);
  if (options.layout == Layout::kContiguous) {
    // HSDP: the flat buffer is [R, Rg] over (dp_replicate, dp_shard), gradients [P,P] -> [R,Rg].
    if (mesh.ndim() != g.dp_ndim())
      throw Unsupported(fmt::format("fully_shard: layout contiguous needs a data-parallel mesh (dp_shard, optionally "
                                    "dp_replicate); {} has other dims (FSDP x TP is not supported yet); use "
                                    "Layout::kPadded",
                                    dtensor::to_string(mesh)));
  }

  // Parameters: everything under the modules not owned by a nested group; a parameter of a
  // nested group used outside that group's modules is an error (tie in the common ancestor).
  std::map<const nn::Parameter*, std::pair<Group*, std::string>> nested_owner;
  for (nn::Module* m : modules)
    for (auto& [fqn, sub] : m->named_modules())
      if (FSDPModule* st = state(*sub))
        for (const Group* og : own_groups(st->group()))
          for (const Slot& s : og->slots) nested_owner[s.param.get()] = {&st->group(), fqn};
  std::set<const nn::Parameter*> ignored;
  for (const auto& p : options.ignored_params) ignored.insert(p.get());
  std::vector<std::pair<std::string, std::shared_ptr<nn::Parameter>>> params;
  std::set<const nn::Parameter*> taken;
  std::function<void(nn::Module&, const std::string&, Group*)> visit = [&](nn::Module& m, const std::string& prefix,
                                                                          Group* inside) {
    FSDPModule* st = state(m);
    if (st) inside = &st->group();
    for (const auto& [n, p] : m.own_parameters()) {
      const std::string fqn = join_name(prefix, n);
      auto it = nested_owner.find(p.get());
      if (it != nested_owner.end()) {
        if (it->second.first != inside)
          throw InvalidArgument(fmt::format(
              "fully_shard: parameter '{}' (module {} '{}') is shared with the group of '{}' but used outside its "
              "modules: a parameter shared by two modules must live in their common ancestor's group (do not shard "
              "'{}' alone)",
              fqn, m.type(), prefix, it->second.second, it->second.second));
        continue;
      }
      if (inside) continue;  // (unreachable: a nested group owns all its parameters)
      if (ignored.count(p.get()) || !taken.insert(p.get()).second) continue;
      params.emplace_back(fqn, p);
    }
    for (const auto& [n, c] : m.children()) visit(*c, join_name(prefix, n), inside);
  };
  if (given) params = *given;
  else
    for (size_t i = 0; i < modules.size(); ++i)
      visit(*modules[i], modules.size() == 1 ? "" : std::to_string(i), nullptr);

  // Trainable parameters first (stable): the gradient buffers cover that prefix only.
  std::stable_partition(params.begin(), params.end(), [](const auto& e) { return e.second->requires_grad; });
  // Per-parameter meshes: this group keeps the parameters on its mesh, a follower per other mesh.
  std::vector<detail::MeshPart> parts;
  if (options.mesh_fn && !given) {
    parts = detail::split_by_mesh(params, comms, options, g.name);
    params = parts.front().params;
  }
  const auto& mp = options.mp_policy;
  bool first = true;
  int64_t offset = 0, uoffset = 0;
  for (auto& [fqn, p] : params) {
    const std::string where = fmt::format("fully_shard({}): parameter '{}'", g.name, fqn);
    // A meta parameter is its shape, dtype and placements: the same spec, no data.
    const bool meta = p->is_meta();
    const DTensorSpec uspec = meta ? dtensor::make_spec(mesh_ptr(p->comms()), p->placements(), p->shape(), p->dtype())
                                   : p->data().spec();
    if (!(*uspec.mesh == mesh))
      throw InvalidArgument(fmt::format("{} lives on mesh {}, not the given mesh {}", where,
                                        dtensor::to_string(*uspec.mesh), dtensor::to_string(mesh)));
    for (int m : g.dp_dims)
      if (!dtensor::is_replicate(uspec.placements[m]))
        throw InvalidArgument(fmt::format(
            "{} is {} on data-parallel mesh dim {} (placements {}): expected Replicate (already sharded? "
            "fully_shard goes bottom-up, children before their parent)",
            where, dtensor::to_string(uspec.placements[m]), m, dtensor::to_string(uspec.placements)));
    if (first) {
      g.orig_dtype = uspec.dtype;
      g.compute_device = meta ? p->device() : p->data().to_local().device();
      first = false;
    } else if (uspec.dtype != g.orig_dtype) {
      throw InvalidArgument(fmt::format("{} is {} but the group's parameters are {}: one dtype per group", where,
                                        kernels::to_string(uspec.dtype), kernels::to_string(g.orig_dtype)));
    }
    Slot s;
    s.name = fqn;
    s.param = p;
    s.unsharded_spec = uspec;
    s.local_shape = meta ? uspec.layout(comms->rank())->local_shape : p->data().to_local().shape();
    const int nd = s.local_shape.size();
    if (nd == 0) throw Unsupported(where + " is 0-d: FSDP shards a tensor dim (ignore it instead)");
    int sd = 0;
    if (options.shard_placement_fn)
      if (auto d = options.shard_placement_fn(fqn, *p)) sd = *d;
    if (sd < 0) sd += nd;
    if (sd < 0 || sd >= nd)
      throw InvalidArgument(fmt::format("{}: shard_placement_fn gave dim {} for a {}-d parameter", where, sd, nd));
    s.shard_dim = sd;
    // The dp placement: Shard(sd), or StridedShard(sd, sf) when later mesh dims (tp) also split
    // sd (FSDP shards the tensor-parallel local tensor: the opposite nesting of left to right).
    Placements sharded = uspec.placements;
    int64_t sf = 1;
    for (int m = g.shard_mesh_dim + 1; m < mesh.ndim(); ++m)
      if (dtensor::shard_dim(sharded[m]) == sd) sf *= mesh.size(m);
    if (sf > 1) sharded[g.shard_mesh_dim] = dtensor::StridedShard{sd, static_cast<int>(sf)};
    else sharded[g.shard_mesh_dim] = dtensor::Shard{sd};
    s.sharded_spec = meta ? dtensor::make_spec(mesh_ptr(comms), sharded, uspec.shape, uspec.dtype)
                          : dtensor::make_spec(mesh_ptr(comms), sharded, uspec.shape, uspec.dtype, p->data().stride());
    // Decided from global data only (no layout per rank), so all ranks agree on an error.
    if (const auto bad = check_dp_chunks(uspec.shape, mesh.shape(), uspec.placements, sharded, g.shard_mesh_dim, sd)) {
      if (bad->kind == DpChunkVerdict::kIndivisible)
        throw InvalidArgument(fmt::format(
            "{}: Shard({}) over {} dp ranks needs dim {} (size {} on a tensor-parallel shard) divisible by {}", where,
            sd, g.dp, sd, bad->size, g.dp));
      throw Unsupported(fmt::format(
          "{}: under {} the dp shards are not chunks of the tensor-parallel shard (uneven FSDP x TP: dim {} of "
          "size {} over tp and dp); pad the dim to a multiple of the mesh sizes",
          where, dtensor::to_string(sharded), sd, uspec.shape[sd]));
    }
    const int64_t n = s.local_shape[sd];
    for (int64_t d = 0; d < g.dp; ++d) s.chunks.push_back(dtensor::chunk(n, g.dp, d));
    s.padded_shape = s.local_shape;
    s.padded_shape[sd] = (n + g.dp - 1) / g.dp;
    s.padded_numel = s.padded_shape.product();
    s.offset = offset;
    offset += s.padded_numel;
    s.unsharded_offset = uoffset;
    uoffset += s.local_shape.product();
    g.slots.push_back(std::move(s));
  }
  g.slot_numel = offset;
  g.flat_numel = g.dp * offset;
  g.unsharded_numel = uoffset;
  for (const Slot& s : g.slots) {
    if (!s.param->requires_grad) break;
    ++g.grad_slots;
    g.grad_numel += s.padded_numel;
  }
  g.grad_flat_numel = g.dp * g.grad_numel;
  {
    std::vector<Dims> shapes;
    std::vector<int> dims;
    for (const Slot& s : g.slots) {
      shapes.push_back(s.local_shape);
      dims.push_back(s.shard_dim);
    }
    g.grad_layout = kernels::ChunkCatLayout(std::vector<Dims>(shapes.begin(), shapes.begin() + g.grad_slots),
                                            std::vector<int>(dims.begin(), dims.begin() + g.grad_slots), g.dp);
    g.layout = kernels::ChunkCatLayout(std::move(shapes), std::move(dims), g.dp);
    for (size_t i = 0; i < g.slots.size(); ++i)
      if (g.layout.offset(i) != g.slots[i].offset || g.layout.chunk_numel() != g.slot_numel)
        throw kernels::InternalError(fmt::format("fully_shard({}): the chunk_cat layout of '{}' disagrees with the slot",
                                                 g.name, g.slots[i].name));
  }
  g.param_dtype = mp.param_dtype.value_or(g.orig_dtype);
  g.reduce_dtype = mp.reduce_dtype.value_or(g.param_dtype);
  if (mp.reduce_wire && *mp.reduce_wire != g.reduce_dtype &&
      (!kernels::is_floating_point(*mp.reduce_wire) || !kernels::is_floating_point(g.reduce_dtype) ||
       kernels::itemsize(*mp.reduce_wire) >= kernels::itemsize(g.reduce_dtype)))
    throw InvalidArgument(fmt::format("fully_shard({}): reduce_wire {} must be a floating dtype narrower than the "
                                      "reduce dtype {}",
                                      g.name, kernels::to_string(*mp.reduce_wire), kernels::to_string(g.reduce_dtype)));
  g.reduce_wire = mp.reduce_wire;
  if (options.layout == Layout::kContiguous) lay_out_contiguous(g);
  g.storage_device = options.offload_policy.offload_to_cpu ? kernels::Device{} : g.compute_device;
  g.offload = detail::make_offload_copies(options.offload_policy, g.compute_device, g.note);
  g.unsharded_alloc = options.unsharded_allocator ? options.unsharded_allocator : comms->allocator();
  g.buffer_alloc = options.buffer_allocator ? options.buffer_allocator : comms->allocator();

  // All-gather extensions: the group's buffer becomes bytes (fsdp/byte_pack.h).
  if (options.all_gather_extension_fn) {
    std::vector<detail::ByteSlot> bs;
    bool any = false;
    for (const Slot& s : g.slots) {
      detail::ByteSlot b;
      b.ext = options.all_gather_extension_fn(s.name, *s.param);
      any = any || b.ext;
      AllGatherContext& c = b.ctx;
      c.name = s.name;
      c.comms = comms;
      c.sharded_spec = s.sharded_spec;
      c.unsharded_spec = s.unsharded_spec;
      c.replicate_mesh_dim = g.rep_mesh_dim;
      c.shard_mesh_dim = g.shard_mesh_dim;
      c.shard_dim = s.shard_dim;
      c.local_shape = s.local_shape;
      c.padded_shape = s.padded_shape;
      c.chunks = s.chunks;
      c.dp_coord = g.my_coord;
      bs.push_back(std::move(b));
    }
    if (any) {
      if (g.reshard_mode.kind == ReshardAfterForward::Kind::kInt && g.reshard_mode.k > 1 && g.reshard_mode.k < g.dp)
        throw Unsupported(fmt::format(
            "fully_shard({}): reshard_after_forward = {} with all-gather extensions: the k buffer would hold "
            "compute-dtype parameters, not the extensions' inputs; use true or false",
            g.name, g.reshard_mode.k));
      g.rank_bytes = detail::lay_out(bs, g.param_dtype);
      g.bslots = std::move(bs);
    }
  }

  // reshard_after_forward = k: 1 is false, the shard size true, otherwise the sub-mesh.
  if (g.reshard_mode.kind == ReshardAfterForward::Kind::kInt) {
    const int k = g.reshard_mode.k;
    if (k < 1 || g.dp % k != 0)
      throw InvalidArgument(fmt::format("fully_shard({}): reshard_after_forward = {}: expected a divisor of the dp "
                                        "shard size {}",
                                        g.name, k, g.dp));
    if (k == 1) g.reshard_mode = ReshardAfterForward::no();
    else if (k == g.dp) g.reshard_mode = ReshardAfterForward::yes();
    else {
      const dtensor::Unflattening u = reshard_unflattening(g.dp_comms->mesh(), g.dp_index, k);
      g.k_comms = g.dp_comms->unflatten(u.mesh_dim, u.sizes, u.names);
    }
  }

  // The flat sharded buffer: rank-major slots, each parameter's shard padded to ceil(n / dp).
  // Materialised parameters are copied in now; meta ones record their sharded placements and are
  // materialised later straight into their view (the buffer exists once any parameter needs it).
  // The parameters may outlive the module (an optimizer holds them): the target holds the group
  // weakly and refuses once it is gone.
  const std::weak_ptr<Group> weak = group;
  auto target = [weak](size_t i) {
    return [weak, i] {
      const std::shared_ptr<Group> live = weak.lock();
      if (!live) throw InvalidArgument("fully_shard: the parameter's FSDP group no longer exists");
      return live->materialize_target(i);
    };
  };
  for (size_t i = 0; i < g.slots.size(); ++i) {
    Slot& s = g.slots[i];
    if (s.param->is_meta()) {
      s.param->set_placements(s.sharded_spec.placements);
      s.param->set_materialize_target(target(i));
      continue;
    }
    const dtensor::Chunk& c = s.chunks[g.my_coord];
    Tensor view = g.shard_view(s);
    if (g.contiguous()) {
      if (s.local_numel > 0)
        view.copy_(s.param->data().to_local().contiguous().reshape(Dims{s.padded_numel}).narrow(
            0, g.clayout->overlap_start(i, g.my_coord) - s.offset, s.local_numel));
    } else if (c.size > 0) {
      view.copy_(s.param->data().to_local().narrow(s.shard_dim, c.offset, c.size));
    }
    s.sharded = DTensor(comms, s.sharded_spec, view);
    s.param->grad().reset();
    s.param->set_data(*s.sharded);
    s.param->set_materialize_target(target(i));
  }

  if (given) return group;
  for (size_t i = 1; i < parts.size(); ++i) {
    FullyShardOptions fo = options;
    fo.mesh_fn = nullptr;
    fo.mesh_dims = parts[i].mesh_dims;
    if (fo.reshard_after_forward.kind == ReshardAfterForward::Kind::kInt) fo.reshard_after_forward = ReshardAfterForward::yes();
    std::shared_ptr<Group> f = shard_group(modules, parts[i].comms, fo, &parts[i].params);
    f->name = g.name;
    f->is_follower = true;
    g.followers.push_back(std::move(f));
  }

  // Hooks on every module of the group.
  Group* gp = group.get();
  for (nn::Module* m : modules) {
    m->register_forward_pre_hook([gp](nn::Module&, nn::Ctx& ctx, DTensor& x) { gp->on_pre_forward(ctx, x); });
    m->register_forward_hook([gp](nn::Module&, nn::Ctx& ctx, DTensor& y) { gp->on_post_forward(ctx, y); });
    m->register_backward_pre_hook([gp](nn::Module&, nn::Ctx& ctx, DTensor& dy) { gp->on_pre_backward(ctx, dy); });
    m->register_backward_hook(
        [gp](nn::Module&, nn::Ctx& ctx, std::optional<DTensor>& dx) { gp->on_post_backward(ctx, dx); });
  }
  return group;
}

}  // namespace

FSDPModule& fully_shard(const std::vector<nn::Module*>& modules, std::shared_ptr<const MeshComms> comms,
                        const FullyShardOptions& options) {
  std::shared_ptr<Group> group = shard_group(modules, std::move(comms), options, nullptr);
  auto handle = std::make_shared<FSDPModule>(group);
  for (nn::Module* m : modules) m->extension(kExtension) = handle;
  return *handle;
}

}  // namespace fsdp
