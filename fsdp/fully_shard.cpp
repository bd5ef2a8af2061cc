#include "fsdp/fully_shard.h"

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

using dtensor::DTensorSpec;
using dtensor::Placement;
using dtensor::Placements;
using kernels::Dims;
using kernels::InvalidArgument;
using kernels::Storage;
using kernels::Tensor;
using kernels::Unsupported;

namespace {

constexpr const char* kExtension = "fsdp";

Placements filled(int n, Placement p) { return Placements(static_cast<size_t>(n), p); }

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

std::shared_ptr<const dtensor::DeviceMesh> mesh_ptr(const std::shared_ptr<const MeshComms>& c) {
  return std::shared_ptr<const dtensor::DeviceMesh>(c, &c->mesh());
}

}  // namespace

// The groups under one root share this: the forward order (for implicit prefetch), the
// reductions in flight (bounded: at most two reduce-scatter inputs alive) and the depth.
struct Runtime {
  Group* root = nullptr;
  std::vector<Group*> groups;
  std::vector<Group*> order;    // pre-forward order of the last complete forward
  std::vector<Group*> current;  // being recorded
  std::vector<Group*> pending;  // groups with a reduction in flight, oldest first
  int prefetch_depth = 1;
};

// One parameter of a group.
struct Slot {
  std::string name;
  std::shared_ptr<nn::Parameter> param;
  DTensorSpec unsharded_spec;  // on the full mesh, orig dtype (dp dims Replicate)
  DTensorSpec sharded_spec;
  Dims local_shape;   // the unsharded local (tensor-parallel) shape
  int shard_dim = 0;  // tensor dim split over the dp shard dim
  Dims padded_shape;  // local_shape with shard_dim -> ceil(n / dp)
  int64_t offset = 0, padded_numel = 0;
  std::vector<dtensor::Chunk> chunks;  // per dp shard coordinate
  std::optional<DTensor> sharded;      // view into the sharded flat buffer
  int64_t unsharded_offset = 0;        // in elements of the unsharded parameter storage
  // Contiguous layout: offset is the global flat offset (unsharded_offset the same), padded_numel
  // the parameter's numel; this rank's overlap with it is [local_begin, + local_numel) of its shard.
  int64_t local_begin = 0, local_numel = 0;
  Tensor accum;                        // no-sync: the unsharded gradient so far (reduce dtype)
  bool released = false;  // quantize_frozen: no master; its extension keeps its gathered inputs
};

class Group {
 public:
  enum class State { kSharded, kUnsharding, kUnsharded, kResharded };

  std::string name;
  std::vector<nn::Module*> modules;
  std::shared_ptr<const MeshComms> comms, dp_comms, k_comms;
  std::vector<int> dp_dims;  // mesh dims of the full mesh that are data parallel, ascending
  int shard_mesh_dim = 0;
  std::optional<int> rep_mesh_dim;
  int dp_index = 0;  // the shard dim's index in dp_comms' mesh
  int64_t dp = 1;
  int64_t my_coord = 0;
  FullyShardOptions opts;
  ReshardAfterForward reshard_mode;
  DType orig_dtype = DType::kF32, param_dtype = DType::kF32, reduce_dtype = DType::kF32;
  std::optional<DType> reduce_wire;  // MixedPrecisionPolicy::reduce_wire
  kernels::Device compute_device, storage_device;
  std::shared_ptr<kernels::Allocator> unsharded_alloc, buffer_alloc;
  std::vector<Slot> slots;
  int64_t slot_numel = 0;  // P: one rank's flat elements
  int64_t flat_numel = 0;  // the flat buffer's global elements (padded: dp * P)
  // Layout::kContiguous (fsdp/contiguous.h): the parameter-major layout and this rank's range;
  // unset: padded.
  std::optional<detail::ContiguousLayout> clayout;
  Tensor grad_in;           // contiguous: the flat reduce-scatter input the gradients are written into
  bool grad_in_accumulating = false;  // it holds earlier no-sync microbatches' sums
  // The trainable prefix: parameters with requires_grad come first in the slots, so gradients
  // (reduce-scatter, sharded gradient buffer) cover only the first grad_numel of the P
  // elements; frozen parameters (QLoRA's base weights) send and keep no gradient bytes.
  int64_t grad_numel = 0;
  int64_t grad_flat_numel = 0;  // the gradient flat buffer's global elements (padded: dp * grad_numel)
  size_t grad_slots = 0;
  kernels::ChunkCatLayout grad_layout;
  kernels::ChunkCatLayout layout;  // the slots, rank-major: chunk_cat / split_copy copies
  int64_t unsharded_numel = 0;
  // With all-gather extensions: one ByteSlot per slot and the bytes of one rank's u8 buffer
  // (fsdp/byte_pack.h); empty otherwise.
  std::vector<detail::ByteSlot> bslots;
  int64_t rank_bytes = 0;
  std::optional<DTensor> sharded_flat;
  std::shared_ptr<Storage> flat_storage, param_storage;
  Tensor grad_flat;    // sharded gradients (orig dtype, storage device)
  Tensor partial_acc;  // HSDP without all-reduce: the [P,S(0)] partial sum so far
  State state = State::kSharded;
  std::optional<dtensor::RedistributeHandle> ag_handle;
  Tensor ag_input;
  std::optional<DTensor> k_buffer;
  struct Pending {
    dtensor::RedistributeHandle handle;
    Tensor input, out;
    bool to_partial = false;       // RS only (HSDP without all-reduce)
    bool all_reduce_after = false;  // add the partial sum, then all-reduce over the replicate dim
    bool into_grad = false;         // out is grad_flat itself
  };
  std::optional<Pending> pending;

  bool requires_gradient_sync = true, reshard_after_backward = true, requires_all_reduce = true;
  bool is_last_backward = true;
  double divide_factor = 1.0;
  bool has_sharded_grad = false;
  std::optional<std::vector<Group*>> fwd_prefetch, bwd_prefetch;
  size_t fwd_pre = 0, fwd_post = 0, bwd_pre = 0, bwd_post = 0;
  std::shared_ptr<Runtime> rt;
  GroupStats stats;
  std::string note;
  // Offload with copies on the copy stream (fsdp/offload.h); null: offload copies, if any, are
  // synchronous.
  std::unique_ptr<detail::OffloadCopies> offload;
  // Per-parameter meshes (fsdp/param_mesh.h): one follower per other mesh, registered on no
  // module; this group's unshard, reshard and gradient steps run theirs first.
  std::vector<std::shared_ptr<Group>> followers;
  bool is_follower = false;

  bool is_root() const { return rt && rt->root == this; }
  bool byte_mode() const { return !bslots.empty(); }
  bool hsdp() const { return rep_mesh_dim.has_value(); }
  int dp_ndim() const { return static_cast<int>(dp_dims.size()); }

  bool contiguous() const { return clayout.has_value(); }
  Placements flat_sharded_placements() const {
    Placements p = filled(dp_ndim(), dtensor::Replicate{});
    p[dp_index] = contiguous() ? clayout->flat_placement() : Placement{dtensor::Shard{0}};
    return p;
  }
  Placements grad_flat_sharded_placements() const {
    Placements p = filled(dp_ndim(), dtensor::Replicate{});
    p[dp_index] = contiguous() ? clayout->grad_flat_placement() : Placement{dtensor::Shard{0}};
    return p;
  }
  DTensorSpec flat_spec(const Placements& p, DType dtype) const {
    return dtensor::make_spec(mesh_ptr(dp_comms), p, Dims{flat_numel}, dtype);
  }
  DTensorSpec grad_flat_spec(const Placements& p, DType dtype) const {
    return dtensor::make_spec(mesh_ptr(dp_comms), p, Dims{grad_flat_numel}, dtype);
  }

  bool reshards_after_forward() const {
    switch (reshard_mode.kind) {
      case ReshardAfterForward::Kind::kAuto: return !is_root();
      case ReshardAfterForward::Kind::kTrue: return true;
      case ReshardAfterForward::Kind::kFalse: return false;
      case ReshardAfterForward::Kind::kInt: return true;
    }
    return true;
  }
  bool reshard_to_k() const { return reshard_mode.kind == ReshardAfterForward::Kind::kInt && k_comms; }

  // ---- storage ----
  Tensor flat_view() {
    if (byte_mode()) {
      if (!flat_storage) flat_storage = Storage::allocate(static_cast<size_t>(dp * rank_bytes), compute_device, unsharded_alloc);
      else flat_storage->reallocate();
      return Tensor::from_storage(flat_storage, DType::kU8, Dims{dp * rank_bytes},
                                  Tensor::contiguous_strides(Dims{dp * rank_bytes}));
    }
    if (!flat_storage)
      flat_storage = Storage::allocate(static_cast<size_t>(flat_numel) * kernels::itemsize(param_dtype),
                                       compute_device, unsharded_alloc);
    else
      flat_storage->reallocate();
    return Tensor::from_storage(flat_storage, param_dtype, Dims{flat_numel}, Tensor::contiguous_strides(Dims{flat_numel}));
  }
  void ensure_param_storage() {
    if (contiguous()) return;  // the parameters are views of the all-gather output
    if (!param_storage)
      param_storage = Storage::allocate(static_cast<size_t>(unsharded_numel) * kernels::itemsize(param_dtype),
                                        compute_device, unsharded_alloc);
    else
      param_storage->reallocate();
  }
  Tensor unsharded_local(const Slot& s) const {
    return Tensor::from_storage(contiguous() ? flat_storage : param_storage, param_dtype, s.local_shape, Tensor::contiguous_strides(s.local_shape),
                                s.unsharded_offset);
  }
  DTensor sharded_grad_view(const Slot& s) const {
    if (contiguous()) return DTensor(comms, s.sharded_spec, grad_flat.narrow(0, s.local_begin, s.local_numel));
    Tensor l = grad_flat.narrow(0, s.offset, s.padded_numel)
                   .view(s.padded_shape)
                   .narrow(s.shard_dim, 0, s.chunks[my_coord].size);
    return DTensor(comms, s.sharded_spec, l);
  }

  // ---- unshard / reshard ----
  // Every parameter materialised (nn::materialize, or a loader's to_empty): an unshard of a
  // group still (partly) meta is refused naming the parameter.
  void require_materialized() const {
    for (const Slot& s : slots)
      if (!s.sharded && !s.released)
        throw InvalidArgument(fmt::format(
            "FSDP group '{}': parameter '{}' is still meta: materialize the model (nn::materialize) or load its "
            "weights before forward",
            name, s.name));
  }

  // Where the sharded parameters and gradients live: pinned host memory under offload's copy
  // engine, else the mesh's allocator.
  std::shared_ptr<kernels::Allocator> state_alloc() const {
    std::shared_ptr<kernels::Allocator> a = offload ? offload->engine()->host_allocator() : nullptr;
    return a ? a : comms->allocator();
  }
  // Offload: the sharded parameters host -> device on the copy stream (issued ahead by
  // copy_ahead, or by the unshard itself), then the all-gather input in the parameter dtype.
  void start_copy_in() {
    for (auto& f : followers) f->start_copy_in();
    if (!offload || offload->has_copy_in() || byte_mode() || state != State::kSharded) return;
    for (const Slot& s : slots)
      if (!s.sharded) return;  // still meta: the unshard refuses
    const Tensor& local = flat_shard();
    offload->copy_in(Tensor::empty(local.shape(), orig_dtype, compute_device, buffer_alloc), local);
  }
  Tensor copied_in() {
    start_copy_in();
    Tensor t = offload->take_copy_in();
    if (t.dtype() == param_dtype) return t;
    Tensor c = Tensor::empty(t.shape(), param_dtype, compute_device, buffer_alloc);
    c.copy_(t);
    return c;
  }

  // The sharded flat buffer, allocated (zero: the padding stays zero) on first use.
  const Tensor& flat_shard() {
    if (!sharded_flat) {
      Tensor flat = Tensor::empty(Dims{slot_numel}, orig_dtype, storage_device, state_alloc());
      flat.fill_(0.0);
      sharded_flat = DTensor(dp_comms, flat_spec(flat_sharded_placements(), orig_dtype), flat);
    }
    return sharded_flat->to_local();
  }
  // Slot i's shard inside the flat buffer: [c.size] rows of its padded slot along the shard dim.
  Tensor shard_view(const Slot& s) {
    if (contiguous()) return flat_shard().narrow(0, s.local_begin, s.local_numel);
    const dtensor::Chunk& c = s.chunks[my_coord];
    return flat_shard().narrow(0, s.offset, s.padded_numel).view(s.padded_shape).narrow(s.shard_dim, 0, c.size);
  }
  // Where nn's materialize / to_empty write a meta parameter of this group: its view in the flat
  // buffer (which the first call allocates), from then on the sharded parameter.
  Tensor materialize_target(size_t i) {
    if (state != State::kSharded)
      throw InvalidArgument(fmt::format("FSDP group '{}': parameter '{}' materialised while the group is unsharded",
                                        name, slots[i].name));
    Slot& s = slots[i];
    if (s.released)
      throw InvalidArgument(fmt::format("FSDP group '{}': parameter '{}' is stored as its all-gather extension's codes "
                                        "(fsdp::quantize_frozen): its master is gone; load the codes instead",
                                        name, s.name));
    Tensor view = shard_view(s);
    s.sharded = DTensor(comms, s.sharded_spec, view);
    return view;
  }

  // The communicators' tracer (kernels/trace.h; null: not traced) and this rank's process in it.
  kernels::Tracer* tracer() const { return dp_comms->mesh().ndim() > 0 ? dp_comms->dim(0).tracer() : nullptr; }
  int trace_pid() const { return dp_comms->mesh().ndim() > 0 ? dp_comms->dim(0).global_rank() : 0; }

  void issue_unshard() {
    for (auto& f : followers) f->issue_unshard();
    if (state == State::kUnsharding || state == State::kUnsharded) return;
    if (state == State::kSharded) require_materialized();
    Tensor out = flat_view();
    if (state == State::kResharded) {
      stats.all_gather_bytes += k_buffer->plan_to(filled(k_comms->mesh().ndim(), dtensor::Replicate{})).bytes_per_rank();
      ag_handle = dtensor::redistribute_async(*k_buffer, filled(k_comms->mesh().ndim(), dtensor::Replicate{}), {}, out);
    } else {
      // Copy-in: the shard on the compute device, in the parameter dtype (so the all-gather
      // moves param_dtype bytes; FSDP2 casts before communicating).
      const Tensor& local = flat_shard();
      DTensor src = *sharded_flat;
      if (byte_mode()) {
        // Every slot's gathered pieces (extensions' or the plain cast shard) packed by bytes.
        ag_input = Tensor::empty(Dims{rank_bytes}, DType::kU8, compute_device, buffer_alloc);
        ag_input.fill_(0.0);
        std::vector<Tensor> padded;
        padded.reserve(slots.size());
        for (const Slot& s : slots)
          padded.push_back(s.released ? Tensor() : local.narrow(0, s.offset, s.padded_numel).view(s.padded_shape));
        const kernels::TraceSpan span(tracer(), trace_pid(), "copies", "FSDP copy-in (extensions)");
        stats.extension_bytes += detail::pack(bslots, padded, ag_input);
        stats.copy_bytes += rank_bytes;
        src = DTensor(dp_comms,
                      dtensor::make_spec(mesh_ptr(dp_comms), flat_sharded_placements(), Dims{dp * rank_bytes}, DType::kU8),
                      ag_input);
      } else if (offload) {
        ag_input = copied_in();
        if (param_dtype != orig_dtype) stats.copy_bytes += static_cast<int64_t>(ag_input.nbytes());
        src = DTensor(dp_comms, flat_spec(flat_sharded_placements(), param_dtype), ag_input);
      } else if (local.dtype() != param_dtype || local.device() != compute_device) {
        ag_input = Tensor::empty(local.shape(), param_dtype, compute_device, buffer_alloc);
        const kernels::TraceSpan span(tracer(), trace_pid(), "copies", "FSDP copy-in");
        if (local.device() == compute_device)
          kernels::chunk_cat(ag_input, {local}, kernels::ChunkCatLayout({local.shape()}, 1), opts.copy_threads);
        else
          ag_input.copy_(local);  // offload: host -> device (and cast)
        if (param_dtype != orig_dtype) stats.copy_bytes += static_cast<int64_t>(ag_input.nbytes());
        src = DTensor(dp_comms, flat_spec(flat_sharded_placements(), param_dtype), ag_input);
      }
      stats.all_gather_bytes += src.plan_to(filled(dp_ndim(), dtensor::Replicate{})).bytes_per_rank();
      ag_handle = dtensor::redistribute_async(src, filled(dp_ndim(), dtensor::Replicate{}), {}, out);
    }
    ++stats.all_gathers;
    state = State::kUnsharding;
  }

  void wait_unshard() {
    for (auto& f : followers) f->wait_unshard();
    if (state == State::kUnsharded) return;
    issue_unshard();
    std::optional<kernels::TraceSpan> span(std::in_place, tracer(), trace_pid(), "waits", "FSDP unshard wait");
    DTensor full = ag_handle->wait();
    if (contiguous()) span.reset();
    else span.emplace(tracer(), trace_pid(), "copies", "FSDP copy-out");
    ag_handle.reset();
    ag_input = Tensor();
    k_buffer.reset();
    if (!contiguous()) {  // contiguous: the parameters are views of `full`, nothing to copy
      const Tensor flat = full.to_local();
      ensure_param_storage();
      // Split-copy: every rank's piece of every parameter into its unsharded tensor, one pass.
      std::vector<Tensor> outs;
      outs.reserve(slots.size());
      for (const Slot& s : slots) outs.push_back(unsharded_local(s));
      if (byte_mode()) detail::unpack(bslots, flat, rank_bytes, dp, param_dtype, outs, buffer_alloc);
      else kernels::split_copy(outs, flat, layout, opts.copy_threads);
      stats.copy_bytes += unsharded_numel * static_cast<int64_t>(kernels::itemsize(param_dtype));
      span.reset();
      flat_storage->free();
    }
    for (const Slot& s : slots) {
      DTensorSpec spec = s.unsharded_spec;
      spec.dtype = param_dtype;
      s.param->set_data(DTensor(comms, spec, unsharded_local(s)));
    }
    state = State::kUnsharded;
  }

  void reshard() {
    for (auto& f : followers) f->reshard();
    if (state == State::kUnsharding) {  // a prefetch nobody used
      ag_handle->wait();
      ag_handle.reset();
      ag_input = Tensor();
    }
    if (offload) offload->drop_copy_in();
    for (const Slot& s : slots) {
      if (s.sharded) s.param->set_data(*s.sharded);
      if (s.released) release_master(s);
    }
    if (param_storage) param_storage->free();
    if (flat_storage) flat_storage->free();
    k_buffer.reset();
    state = State::kSharded;
  }

  void release_master(const Slot& s) const {
    s.param->release_data();
    s.param->set_placements(s.sharded_spec.placements);
    s.param->set_dtype(orig_dtype);
  }

  // fsdp::quantize_frozen: each frozen parameter whose extension keeps its inputs runs its
  // (collective) pre_all_gather once, then the flat buffer is re-laid out without it. Returns the
  // bytes released.
  int64_t quantize_frozen() {
    std::vector<size_t> drop;
    for (size_t i = 0; i < bslots.size(); ++i)
      if (!slots[i].released && bslots[i].ext && bslots[i].ext->keeps_inputs() && !slots[i].param->requires_grad)
        drop.push_back(i);
    if (drop.empty()) return 0;
    if (state != State::kSharded)
      throw InvalidArgument(fmt::format("fsdp::quantize_frozen: group '{}' is unsharded; call it between steps", name));
    require_materialized();
    const Tensor old = flat_shard();
    for (size_t i : drop) {
      const Slot& s = slots[i];
      stats.extension_bytes += bslots[i].ext->pre_all_gather(old.narrow(0, s.offset, s.padded_numel).view(s.padded_shape),
                                                             bslots[i].ctx).communicated_bytes;
    }
    for (size_t i : drop) {
      slots[i].released = true;
      slots[i].sharded.reset();
      release_master(slots[i]);
    }
    int64_t kept = 0;
    for (const Slot& s : slots) kept += s.released ? 0 : s.padded_numel;
    Tensor flat = Tensor::empty(Dims{kept}, orig_dtype, storage_device, state_alloc());
    int64_t off = 0;
    for (Slot& s : slots) {
      if (s.released) continue;
      flat.narrow(0, off, s.padded_numel).copy_(old.narrow(0, s.offset, s.padded_numel));
      s.offset = off;
      off += s.padded_numel;
    }
    const int64_t released = (slot_numel - kept) * static_cast<int64_t>(kernels::itemsize(orig_dtype));
    slot_numel = kept;
    flat_numel = dp * kept;
    sharded_flat = DTensor(dp_comms, flat_spec(flat_sharded_placements(), orig_dtype), flat);
    for (size_t i = 0; i < slots.size(); ++i) {
      Slot& s = slots[i];
      if (s.released || !s.sharded) continue;
      s.sharded = DTensor(comms, s.sharded_spec, shard_view(s));
      s.param->set_data(*s.sharded);
    }
    return released;
  }

  // Post-forward with k: the unsharded parameters packed rank-major (the all-gather layout),
  // viewed on (.., dp / k, k) and moved R -> S(0) over the k ranks (a local slice), kept until
  // backward.
  void reshard_to_k_buffer() {
    const Tensor flat = flat_view();
    std::vector<Tensor> ins;
    ins.reserve(slots.size());
    for (const Slot& s : slots) ins.push_back(unsharded_local(s));
    kernels::chunk_cat(flat, ins, layout, opts.copy_threads);
    DTensor whole(dp_comms, flat_spec(filled(dp_ndim(), dtensor::Replicate{}), param_dtype), flat);
    const int kn = k_comms->mesh().ndim();
    DTensor on_k = whole.view_on(k_comms, filled(kn, dtensor::Replicate{}));
    Placements to = filled(kn, dtensor::Replicate{});
    to[kn - 1] = dtensor::Shard{0};
    const int64_t k = k_comms->mesh().size(kn - 1);
    Tensor out = Tensor::empty(Dims{dp * slot_numel / k}, param_dtype, compute_device, unsharded_alloc);
    DTensor kept = on_k.redistribute(to, out);
    reshard();
    k_buffer = kept;
    state = State::kResharded;
  }

  void prefetch(const std::vector<Group*>& targets) {
    for (Group* g : targets)
      if (g->state == State::kSharded || g->state == State::kResharded) {
        g->issue_unshard();
        ++g->stats.prefetches;
      }
  }
  // Offload: the copy-in of the group one past the implicit prefetch (NOTE [offload ordering]).
  void copy_ahead(bool forward) const {
    if (!rt) return;
    const auto& order = rt->order;
    auto it = std::find(order.begin(), order.end(), this);
    if (it == order.end()) return;
    const ptrdiff_t q = (it - order.begin()) + (forward ? 1 : -1) * (std::max(rt->prefetch_depth, 0) + 1);
    if (q >= 0 && q < static_cast<ptrdiff_t>(order.size())) order[q]->start_copy_in();
  }
  std::vector<Group*> implicit_targets(bool forward) const {
    std::vector<Group*> out;
    if (!rt || rt->prefetch_depth <= 0) return out;
    const auto& order = rt->order;
    auto it = std::find(order.begin(), order.end(), this);
    if (it == order.end()) return out;
    const ptrdiff_t pos = it - order.begin();
    for (int i = 1; i <= rt->prefetch_depth; ++i) {
      const ptrdiff_t q = forward ? pos + i : pos - i;
      if (q < 0 || q >= static_cast<ptrdiff_t>(order.size())) break;
      out.push_back(order[q]);
    }
    return out;
  }

  // ---- gradients ----
  // A parameter frozen at fully_shard (after the trainable prefix) has no gradient storage.
  void check_frozen(size_t i) const {
    const Slot& s = slots[i];
    if (i >= grad_slots && (s.param->requires_grad || s.param->grad()))
      throw InvalidArgument(fmt::format(
          "FSDP group '{}': parameter '{}' was frozen (requires_grad false) at fully_shard but now {}; set "
          "requires_grad before fully_shard",
          name, s.name, s.param->grad() ? "holds a gradient" : "requires a gradient"));
  }
  void stash_grads() {
    for (auto& f : followers) f->stash_grads();
    has_sharded_grad = false;
    for (size_t i = 0; i < slots.size(); ++i) {
      check_frozen(i);
      Slot& s = slots[i];
      auto& g = s.param->grad();
      if (!g) continue;
      if (!grad_flat.defined()) allocate_grad_flat();
      DTensor view = sharded_grad_view(s);
      if (g->to_local().data_ptr() != view.to_local().data_ptr() || !(g->placements() == s.sharded_spec.placements)) {
        if (!(g->placements() == s.sharded_spec.placements) || !(g->shape() == s.sharded_spec.shape))
          throw InvalidArgument(fmt::format(
              "FSDP group '{}': parameter '{}' holds a gradient with placements {} before backward; expected "
              "its sharded placements {} (or none)",
              name, s.name, dtensor::to_string(g->placements()), dtensor::to_string(s.sharded_spec.placements)));
        Tensor v = view.to_local();
        v.copy_(g->to_local());
      }
      has_sharded_grad = true;
      g.reset();
    }
  }
  void allocate_grad_flat() {
    grad_flat = Tensor::empty(Dims{grad_numel}, orig_dtype, storage_device, state_alloc());
    grad_flat.fill_(0.0);
  }
  void install_grads() {
    for (size_t i = 0; i < grad_slots; ++i)
      if (slots[i].param->requires_grad) slots[i].param->grad() = sharded_grad_view(slots[i]);
  }

  // The unsharded gradient of s as the local tensor of its placements on the non-dp dims, dp
  // dims Partial (a Replicate dp dim counts on coordinate 0 only). Undefined when absent.
  Tensor take_grad(Slot& s) {
    auto& g = s.param->grad();
    if (!g) return Tensor();
    DTensor gd = *g;
    g.reset();
    Placements want = gd.placements();
    bool move = false, zero = false;
    for (int m = 0; m < static_cast<int>(want.size()); ++m) {
      const bool is_dp = std::find(dp_dims.begin(), dp_dims.end(), m) != dp_dims.end();
      if (is_dp) {
        if (dtensor::is_replicate(want[m])) {
          if (comms->coord()[m] != 0) zero = true;
        } else if (!dtensor::is_partial(want[m])) {
          throw InvalidArgument(fmt::format(
              "FSDP group '{}': the gradient of '{}' is {} on data-parallel mesh dim {}; expected Partial "
              "(the batch split over dp) or Replicate",
              name, s.name, dtensor::to_string(want[m]), m));
        }
      } else if (!(want[m] == s.unsharded_spec.placements[m])) {
        want[m] = s.unsharded_spec.placements[m];
        move = true;
      }
    }
    if (move) gd = gd.redistribute(want);  // e.g. a sequence-parallel norm's P on tp -> R
    Tensor l = gd.to_local();
    if (zero) {
      Tensor z = Tensor::empty(l.shape(), l.dtype(), l.device());
      z.fill_(0.0);
      return z;
    }
    return l;
  }

  // ---- gradients, contiguous layout ----
  // Before backward: every trainable parameter's gradient buffer is its view of the flat
  // reduce-scatter input (reduce dtype, Partial over dp), so backward writes the gradient there:
  // over it for the first write of this sync window (the gaps between parameters zeroed once at
  // allocation), added for tied weights and later no-sync microbatches.
  void set_grad_buffers() {
    if (clayout->grad_numel == 0) return;  // (the global prefix: a rank with an empty range reduces too)
    if (!grad_in.defined()) {
      grad_in = Tensor::empty(Dims{clayout->grad_numel}, reduce_dtype, compute_device, buffer_alloc);
      for (size_t i = 0; i < grad_slots; ++i) {  // the alignment gaps: zero (they are reduced too)
        const int64_t end = i + 1 < grad_slots ? slots[i + 1].offset : clayout->grad_numel;
        const int64_t from = slots[i].offset + slots[i].padded_numel;
        if (end > from) grad_in.narrow(0, from, end - from).fill_(0.0);
      }
      grad_in_accumulating = false;
    }
    for (size_t i = 0; i < grad_slots; ++i) {
      Slot& s = slots[i];
      if (!s.param->requires_grad) continue;
      Placements pl = s.unsharded_spec.placements;
      for (int m : dp_dims) pl[m] = dtensor::Partial{};
      const DTensorSpec spec = dtensor::make_spec(mesh_ptr(comms), pl, s.unsharded_spec.shape, reduce_dtype);
      s.param->set_grad_buffer(
          DTensor(comms, spec, grad_in.narrow(0, s.offset, s.padded_numel).view(s.local_shape)),
          grad_in_accumulating);
    }
  }
  // After backward: the gradients are already in grad_in. A parameter that got no gradient in
  // this window contributes zeros.
  void post_backward_contiguous() {
    bool any = false;
    for (size_t i = 0; i < slots.size(); ++i) {
      check_frozen(i);
      Slot& s = slots[i];
      any = any || s.param->requires_grad;
      if (i < grad_slots && s.param->requires_grad && !grad_in_accumulating && s.param->grad_unwritten())
        grad_in.narrow(0, s.offset, s.padded_numel).fill_(0.0);
      s.param->grad().reset();
    }
    if (!requires_gradient_sync) {
      grad_in_accumulating = grad_in.defined();
      if (has_sharded_grad) install_grads();
      if (reshard_after_backward) reshard();
      return;
    }
    if (!any || !grad_in.defined()) {
      if (has_sharded_grad) install_grads();
      reshard();
      return;
    }
    if (rt && !is_follower)
      while (!rt->pending.empty()) {
        Group* g = rt->pending.front();
        rt->pending.erase(rt->pending.begin());
        g->finish_reduce();
      }
    DTensor flat_in(dp_comms, grad_flat_spec(filled(dp_ndim(), dtensor::Partial{}), reduce_dtype), grad_in);
    issue_reduce(flat_in, grad_in);
    grad_in = Tensor();
    grad_in_accumulating = false;
    reshard();
  }

  void post_backward() {
    if (contiguous()) {
      post_backward_contiguous();
      return;
    }
    std::vector<Tensor> grads(slots.size());
    // Whether to reduce is decided by requires_grad (the same on every rank), never by which
    // gradients this rank happens to hold: a rank without one contributes zeros.
    bool any = false;
    for (size_t i = 0; i < slots.size(); ++i) {
      check_frozen(i);
      grads[i] = take_grad(slots[i]);
      any = any || slots[i].param->requires_grad;
    }
    if (!requires_gradient_sync) {
      // No sync: unsharded gradients accumulate (in the reduce dtype) until a synchronising
      // backward reduces their sum once.
      for (size_t i = 0; i < slots.size(); ++i) {
        if (!grads[i].defined()) continue;
        Slot& s = slots[i];
        if (!s.accum.defined()) {
          s.accum = Tensor::empty(s.local_shape, reduce_dtype, compute_device, buffer_alloc);
          s.accum.copy_(grads[i]);
        } else {
          kernels::add_out(s.accum, s.accum, grads[i].dtype() == reduce_dtype ? grads[i] : grads[i].to(reduce_dtype));
        }
      }
      if (has_sharded_grad) install_grads();
      if (reshard_after_backward) reshard();
      return;
    }
    if (!any) {
      if (has_sharded_grad) install_grads();
      reshard();  // a synchronising backward: the optimizer steps the sharded parameters next
      return;
    }
    // Keep at most two reduce-scatter inputs alive: finish the older reductions first (a
    // follower leaves that to its leader, which just did it: its own reduction overlaps too).
    if (rt && !is_follower)
      while (!rt->pending.empty()) {
        Group* g = rt->pending.front();
        rt->pending.erase(rt->pending.begin());
        g->finish_reduce();
      }
    // Chunk-cat copy-in: one pass over every gradient and rank, the cast to the reduce dtype
    // and the zero padding (and zeros for a gradient this rank lacks) fused into it.
    for (size_t i = 0; i < slots.size(); ++i) {
      Slot& s = slots[i];
      if (!s.accum.defined()) continue;
      Tensor& g = grads[i];
      if (g.defined()) kernels::add_out(s.accum, s.accum, g.dtype() == reduce_dtype ? g : g.to(reduce_dtype));
      g = s.accum;
      s.accum = Tensor();
    }
    for (size_t i = 0; i < slots.size(); ++i)
      if (grads[i].defined() && !(grads[i].shape() == slots[i].local_shape))
        throw InvalidArgument(fmt::format("FSDP group '{}': the gradient of '{}' has local shape {}, expected {}", name,
                                          slots[i].name, kernels::to_string(grads[i].shape()),
                                          kernels::to_string(slots[i].local_shape)));
    Tensor in = Tensor::empty(Dims{dp * grad_numel}, reduce_dtype, compute_device, buffer_alloc);
    grads.resize(grad_slots);  // the frozen slots (after the prefix) hold no gradient
    {
      const kernels::TraceSpan span(tracer(), trace_pid(), "copies", "FSDP gradient copy-in");
      kernels::chunk_cat(in, grads, grad_layout, opts.copy_threads);
      stats.copy_bytes += static_cast<int64_t>(in.nbytes());
    }
    grads.clear();
    DTensor flat_in(dp_comms, grad_flat_spec(filled(dp_ndim(), dtensor::Partial{}), reduce_dtype), in);
    issue_reduce(flat_in, in);
    reshard();  // a synchronising backward: the optimizer steps the sharded parameters next
  }

  // The flat P input -> the sharded gradient flat buffer (or a temporary), asynchronously.
  void issue_reduce(const DTensor& flat_in, const Tensor& in) {
    Pending p;
    p.to_partial = hsdp() && !requires_all_reduce;
    p.all_reduce_after = hsdp() && requires_all_reduce && partial_acc.defined();
    Placements target = grad_flat_sharded_placements();
    if (p.to_partial || p.all_reduce_after) {
      for (int m = 0; m < dp_ndim(); ++m)
        if (m != dp_index) target[m] = dtensor::Partial{};
    }
    dtensor::RedistributeOptions ro;
    ro.reduce_dtype = reduce_dtype;
    ro.divide_factor = divide_factor;
    ro.wire_dtype = reduce_wire;
    p.into_grad = !has_sharded_grad && !p.to_partial && !p.all_reduce_after && storage_device == compute_device && !offload;
    if (p.into_grad) {
      if (!grad_flat.defined()) allocate_grad_flat();
      p.out = grad_flat;
    } else {
      p.out = Tensor::empty(Dims{grad_numel}, reduce_dtype, compute_device, buffer_alloc);
    }
    p.input = in;
    p.handle = dtensor::redistribute_async(flat_in, target, ro, p.out);
    stats.reduce_bytes += flat_in.plan_to(target, ro).bytes_per_rank();
    ++stats.reduce_scatters;
    if (hsdp() && !p.to_partial && !p.all_reduce_after) ++stats.all_reduces;
    pending = std::move(p);
    if (rt) rt->pending.push_back(this);
  }

  void finish_reduce() {
    if (!pending) return;
    Pending p = std::move(*pending);
    pending.reset();
    {
      const kernels::TraceSpan span(tracer(), trace_pid(), "waits", "FSDP reduce-scatter wait");
      p.handle.wait();
    }
    p.input = Tensor();
    if (p.to_partial) {
      if (!partial_acc.defined()) partial_acc = p.out;
      else kernels::add_out(partial_acc, partial_acc, p.out);
      if (has_sharded_grad) install_grads();
      return;
    }
    Tensor result = p.out;
    if (p.all_reduce_after) {
      kernels::add_out(result, result, partial_acc);
      partial_acc = Tensor();
      Placements from = flat_sharded_placements();
      for (int m = 0; m < dp_ndim(); ++m)
        if (m != dp_index) from[m] = dtensor::Partial{};
      DTensor part(dp_comms, grad_flat_spec(from, reduce_dtype), result);
      dtensor::RedistributeOptions ro;
      ro.reduce_dtype = reduce_dtype;
      ro.wire_dtype = reduce_wire;
      result = part.redistribute(flat_sharded_placements(), ro).to_local();
      stats.reduce_bytes += part.plan_to(flat_sharded_placements(), ro).bytes_per_rank();
      ++stats.all_reduces;
    }
    if (!p.into_grad) {
      if (!grad_flat.defined()) allocate_grad_flat();
      if (has_sharded_grad) {
        Tensor r = result;
        if (r.dtype() != orig_dtype || r.device() != storage_device) {
          Tensor c = Tensor::empty(r.shape(), orig_dtype, storage_device);
          c.copy_(r);
          r = c;
        }
        kernels::add_out(grad_flat, grad_flat, r);
      } else if (offload) {  // the cast on the device, the move on the copy stream
        Tensor r = result;
        if (r.dtype() != orig_dtype) {
          r = Tensor::empty(result.shape(), orig_dtype, compute_device, buffer_alloc);
          r.copy_(result);
        }
        offload->copy_out(grad_flat, r);
      } else {
        grad_flat.copy_(result);  // cast and device move (offload: to the CPU)
        if (result.dtype() != orig_dtype) stats.copy_bytes += static_cast<int64_t>(grad_flat.nbytes());
      }
    }
    has_sharded_grad = true;
    install_grads();
  }

  // ---- hooks ----
  void lazy_init();
  void on_pre_forward(nn::Ctx& ctx, DTensor& input);
  void on_post_forward(nn::Ctx& ctx, DTensor& output);
  void on_pre_backward(nn::Ctx& ctx, DTensor& grad_output);
  void on_post_backward(nn::Ctx& ctx, std::optional<DTensor>& grad_input);
  void finalize_backward();
};

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
  if (is_last_backward) {
    while (!rt->pending.empty()) {
      Group* g = rt->pending.front();
      rt->pending.erase(rt->pending.begin());
      g->finish_reduce();
    }
  }
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
  const auto& m = group_->k_comms->mesh();
  return group_->dp * group_->slot_numel / m.size(m.ndim() - 1) *
         static_cast<int64_t>(kernels::itemsize(group_->param_dtype));
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

// Layout::kContiguous: the slots re-laid out parameter-major (fsdp/contiguous.h), each sharded
// parameter Rg(0,[its overlaps],1) of its global shape. The padded slot fields computed before
// are replaced.
void lay_out_contiguous(Group& g) {
  std::vector<int64_t> numels;
  for (const Slot& s : g.slots) {
    if (s.local_shape.product() == 0)
      throw Unsupported(fmt::format("fully_shard({}): parameter '{}' has no elements (shape {}): layout contiguous "
                                    "shards elements; ignore it (ignored_params) or use Layout::kPadded",
                                    g.name, s.name, kernels::to_string(s.local_shape)));
    numels.push_back(s.local_shape.product());
  }
  g.clayout = detail::lay_out_contiguous(numels, g.grad_slots, g.dp,
                                         detail::contiguous_align(g.orig_dtype, g.param_dtype, g.reduce_dtype));
  const detail::ContiguousLayout& l = *g.clayout;
  const int64_t me = g.my_coord;
  for (size_t i = 0; i < g.slots.size(); ++i) {
    Slot& s = g.slots[i];
    s.offset = s.unsharded_offset = l.offsets[i];
    s.padded_numel = l.numels[i];
    s.local_begin = l.overlap_start(i, me) - l.begin(me);
    s.local_numel = l.overlap_size(i, me);
    Placements p = s.unsharded_spec.placements;
    p[g.shard_mesh_dim] = l.param_placement(i);
    s.sharded_spec = dtensor::make_spec(mesh_ptr(g.comms), p, s.unsharded_spec.shape, s.unsharded_spec.dtype);
  }
  g.slot_numel = l.size(me);
  g.flat_numel = g.unsharded_numel = l.numel;
  g.grad_numel = l.grad_size(me);
  g.grad_flat_numel = l.grad_numel;
}

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
    if (dims.replicate)
      throw Unsupported("fully_shard: layout contiguous does not support HSDP (a dp_replicate mesh dim) yet; use "
                        "Layout::kPadded");
    if (mesh.ndim() != 1)
      throw Unsupported(fmt::format("fully_shard: layout contiguous needs a 1-D data-parallel mesh; {} has other dims "
                                    "(FSDP x TP is not supported yet); use Layout::kPadded",
                                    dtensor::to_string(mesh)));
    const auto& r = options.reshard_after_forward;
    if (r.kind == ReshardAfterForward::Kind::kInt && r.k > 1 && r.k < g.dp)
      throw Unsupported(fmt::format("fully_shard: layout contiguous does not support reshard_after_forward = {} yet "
                                    "(only true / false); use Layout::kPadded",
                                    r.k));
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
